"""The trainer's step compiled by XLA:GPU for an H100 or H200 that is not here, and read.

`memory.step_memory.compile_train_step(..., target=)` compiles it for compile-only devices of the
target (`memory.gpu_targets`); what comes back is real: the program's per-device memory
(`memory_analysis()`) and its optimised HLO, which `hlo_census` reads kernel by kernel. Nothing runs, so there are no times, only the roofline's lower
bound. `run` is what `scripts/bench/gpu_compile.py` prints.
"""

from __future__ import annotations

from typing import Any

from qwen35_kernels.logprob_entropy import BACKENDS as LOGPROB_BACKENDS

from qwen35_jax.config import Qwen35Config
from qwen35_jax.memory.gpu_targets import GPU_TARGETS
from qwen35_jax.memory.step_memory import compile_train_step


def run(*, preset: str, target: str, seq: int, batch: int, mesh: str, remat: str, attention: str,
        gdn_mode: str, gdn_precision: str | None, top: int, hlo_path: str | None = None,
        from_hlo: str | None = None, gdn_remat: str | None = None, logprob_backend: str = "auto",
        scan_layers: str = "auto", log: Any = print) -> dict[str, Any]:
    """What `scripts/bench/gpu_compile.py` prints: the compiled step's memory, then `census_report` of its
    program. from_hlo: read that optimised HLO text (.gz allowed; e.g. the one `device_check.sh`
    brings back from a GPU) instead of compiling; the shape arguments then only size the model FLOPs.
    gdn_remat: what the GDN mixers keep for the backward (`KernelChoices.gdn_remat`; None: "auto").
    logprob_backend: the fused log-prob kernel's (`qwen35_kernels.BACKENDS`). scan_layers: a key of
    `config.SCAN_LAYERS_FLAGS` ("auto": as `model.scans_layers` resolves it on a GPU)."""
    from qwen35_kernels.choices import KernelChoices

    from qwen35_jax.config import REMAT_POLICIES, SCAN_LAYERS_FLAGS
    from qwen35_jax.memory.report import fsdp_sp_product
    from qwen35_jax.model import scans_layers
    from qwen35_jax.parallel.mesh import parse_mesh
    from qwen35_jax.train.flops import train_flops
    from qwen35_jax.train.remat_choice import compiled_bytes

    if remat not in REMAT_POLICIES or remat == "auto":
        raise ValueError(f"--remat {remat!r}: compile one of {tuple(p for p in REMAT_POLICIES if p != 'auto')}")
    if seq < 1 or batch < 1:
        raise ValueError(f"--seq and --batch must be >= 1, got {seq} and {batch}")
    if target not in GPU_TARGETS:
        raise ValueError(f"--target {target!r} is not one of {sorted(GPU_TARGETS)}")
    kernels = KernelChoices(gdn_remat=gdn_remat or "auto")  # a one-line error for a name it does not know
    if logprob_backend not in LOGPROB_BACKENDS:
        raise ValueError(f"--logprob-backend {logprob_backend!r} is not one of {LOGPROB_BACKENDS}")
    if scan_layers not in SCAN_LAYERS_FLAGS:
        raise ValueError(f"--scan-layers {scan_layers!r} is not one of {tuple(SCAN_LAYERS_FLAGS)}")
    fsdp, sp = parse_mesh(mesh, fsdp_sp_product(mesh))
    config = Qwen35Config.preset(preset, dtype="bfloat16", param_dtype="float32", remat=remat,
                                 scan_layers=SCAN_LAYERS_FLAGS[scan_layers], kernels=kernels).text_only()  # a text step
    scanned = scans_layers(config, backend="gpu")
    say = log or (lambda _: None)
    setting = (f"{preset}, {batch} x {seq:,} tokens, mesh fsdp={fsdp},sp={sp}, remat {remat}, "
               f"blocks {'scanned' if scanned else 'one after another'}, attention {attention}, "
               f"GDN {gdn_mode}{f' {gdn_precision}' if gdn_precision else ''}"
               f"{f', GDN remat {gdn_remat}' if gdn_remat else ''}"
               f"{f', log-prob {logprob_backend}' if logprob_backend != 'auto' else ''}")
    result: dict[str, Any] = {"preset": preset, "target": target, "batch": batch, "seq": seq,
                              "mesh": f"fsdp={fsdp},sp={sp}", "remat": remat, "scan_layers": scanned,
                              "attention": attention,
                              "gdn_mode": gdn_mode, "gdn_precision": gdn_precision, "gdn_remat": gdn_remat,
                              "logprob_backend": logprob_backend}
    gpu = GPU_TARGETS[target]
    if from_hlo:
        text = read_hlo(from_hlo)
        say(f"# {from_hlo}, read as the program of {setting}")
    else:
        compiled, seconds = compile_train_step(config, seq, (fsdp, sp), target=target, batch=batch,
                                               attention=attention, gdn_mode=gdn_mode, gdn_precision=gdn_precision,
                                               logprob_backend=logprob_backend)
        text = compiled.as_text()
        if hlo_path:
            with open(hlo_path, "w") as f:
                f.write(text)
        m = compiled.memory_analysis()
        total = compiled_bytes(compiled)
        say(f"# {setting}: compiled for {gpu.description} in {seconds:.0f} s, not run")
        say(f"memory per device: {total / 2**30:.2f} GiB of {gpu.memory_bytes / 2**30:.1f} GiB "
            f"(arguments {m.argument_size_in_bytes / 2**30:.2f}, temporaries {m.temp_size_in_bytes / 2**30:.2f}, "
            f"outputs not aliased {(m.output_size_in_bytes - m.alias_size_in_bytes) / 2**30:.2f})")
        result.update(compile_s=round(seconds, 1), memory_bytes=total, device_memory_bytes=gpu.memory_bytes,
                      temporaries_bytes=m.temp_size_in_bytes)
    model_flops = train_flops(config, batch, seq) / (fsdp * sp)  # per device
    return {**result, **census_report(text, target, model_flops, top=top, log=say)}


def read_hlo(path: str) -> str:
    """An HLO text file, gzipped or not."""
    import gzip

    with open(path, "rb") as f:
        data = f.read()
    return (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode()


def census_report(hlo_text: str, target: str, model_flops: float, *, top: int = 25,
                  log: Any = print) -> dict[str, Any]:
    """The program's kernels by category and by model part with their roofline times on `target`, the
    bound that puts on MFU for `model_flops` per device, and the source lines moving the most
    non-matmul bytes; printed as markdown tables, returned as a dict."""
    from qwen35_bench.hlo_census import DEVICE_PEAKS, by_category, by_part, by_source, census
    from qwen35_bench.report import markdown_table

    peaks = DEVICE_PEAKS[target]
    kernels = census(hlo_text)
    categories = by_category(kernels, peaks)
    bound_s = sum(r["roofline_ms"] for r in categories) / 1e3
    mfu_bound = model_flops / bound_s / peaks.bf16_flops
    parts = by_part(kernels, peaks)
    sources = by_source(kernels, peaks)[:top]
    say = log or (lambda _: None)

    def rows(table: list[dict], flops: bool = True) -> list[list]:
        return [[r["name"], r["launches"], f"{r['gb']:.2f}", *([f"{r['tflop']:.2f}"] if flops else []),
                 f"{r['roofline_ms']:.2f}"] for r in table]

    say(f"\nkernels per step, roofline at {peaks.name} datasheet rates ({peaks.memory_bandwidth / 1e12:.2f} TB/s, "
        f"{peaks.bf16_flops / 1e12:.0f} bf16 TFLOP/s):")
    say(markdown_table(["category", "launches", "GB", "TFLOP", "roofline ms"], rows(categories)))
    say(f"lower bound {bound_s * 1e3:.1f} ms a step (attention and log-prob kernels by their FLOPs too, "
        "GDN kernels by their bytes): "
        f"MFU at most {100 * mfu_bound:.1f}% ({model_flops / 1e12:.1f} model TFLOP per device)")
    say("\nby model part (every category):")
    say(markdown_table(["part", "launches", "GB", "TFLOP", "roofline ms"], rows(parts)))
    say(f"\nnon-matmul memory traffic by source line (top {top}):")
    say(markdown_table(["source line", "launches", "GB", "roofline ms"], rows(sources, flops=False)))
    return {"launches": sum(r["launches"] for r in categories), "categories": categories, "parts": parts,
            "roofline_s": bound_s, "mfu_bound": mfu_bound, "top_sources": sources}
