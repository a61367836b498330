"""What `scripts/bench/bench_long_context.py` runs: one length or the search, and the per-component report."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from qwen35_jax.config import GDN_SP_MODES, REMAT_POLICIES, SCAN_LAYERS_FLAGS, Qwen35Config
from qwen35_jax.memory.budget import step_budget
from qwen35_jax.memory.search import longest_fitting, parse_bytes
from qwen35_jax.memory.step_memory import StepMemory, step_memory, traced_config


def components(m: StepMemory) -> dict[str, int]:
    """The compiler's per-device split: what the step holds across it, what it allocates inside it."""
    return {"arguments (parameters, AdamW state, batch)": m.arguments,
            "outputs not aliased to arguments": m.outputs - m.aliased,
            "temporaries (activations, gradients, workspace)": m.temporaries}


def run(*, preset: str, mesh: str, device_memory: str | None, seq: int | None = None, remat: str = "nested",
        gdn_mode: str = "all_to_all", tile: int | None = 8192, start: int | None = None,
        target: str | None = None, scan_layers: str = "auto", image_patches: int | None = None,
        log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """target: a GPU or TPU of `targets.COMPILE_TARGETS` whose compiler sizes the step (device_memory
    None: that device's); None: this process's devices (simulated ones on CPU, device_memory required).
    scan_layers: a key of `config.SCAN_LAYERS_FLAGS` ("auto": as the target's platform resolves it, a
    GPU's without a target). image_patches: the step of a VLM batch that also holds one bucket of that
    many image patches (the preset's vision tower kept); None: the text model's step."""
    import jax

    from qwen35_jax.memory.targets import target_backend, target_compiler, target_memory_bytes
    from qwen35_jax.parallel.mesh import parse_mesh

    measurable = tuple(policy for policy in REMAT_POLICIES if policy != "auto")
    if remat not in measurable:
        raise ValueError(f"--remat {remat!r}: measure one of {measurable} ('auto' is the trainer's "
                         "choice among 'none', 'mlp' and 'full' at its first step)")
    if gdn_mode not in GDN_SP_MODES:
        raise ValueError(f"--gdn-mode {gdn_mode!r} is not one of {GDN_SP_MODES}")
    if scan_layers not in SCAN_LAYERS_FLAGS:
        raise ValueError(f"--scan-layers {scan_layers!r} is not one of {tuple(SCAN_LAYERS_FLAGS)}")
    backend = jax.default_backend() if target is None else target_backend(target)  # checks the name
    if device_memory is None and target is None:
        raise ValueError("--device-memory is needed without --target")
    limit = target_memory_bytes(target) if device_memory is None else parse_bytes(device_memory)
    fsdp, sp = parse_mesh(mesh, fsdp_sp_product(mesh))
    if target is None and fsdp * sp > jax.device_count():
        raise ValueError(f"--mesh {mesh} needs {fsdp * sp} devices, there are {jax.device_count()}")
    config = Qwen35Config.preset(preset, dtype="bfloat16", param_dtype="float32", remat=remat,
                                 scan_layers=SCAN_LAYERS_FLAGS[scan_layers])
    config = traced_config(config if image_patches else config.text_only(), target)
    scanned = config.scan_layers
    compiler = target_compiler(target) if target else f"XLA:{backend.upper()}"
    say = log or (lambda _: None)
    granule = sp * config.gdn_chunk_size  # sequence shards of whole delta-rule chunks

    def measure(s: int) -> StepMemory:
        return step_memory(config, s, (fsdp, sp), gdn_mode=gdn_mode, tile=tile, target=target,
                           image_patches=image_patches)

    if seq is not None:
        if seq < 1:
            raise ValueError(f"--seq must be >= 1, got {seq}")
        best = measure(seq)
        fits = best.total <= limit
    else:
        if start is None:  # the analytic budget's guess, as a power of two
            per_token = sum(step_budget(config, 2 * granule, (fsdp, sp), tile=tile).values()) \
                - sum(step_budget(config, granule, (fsdp, sp), tile=tile).values())
            fixed = sum(step_budget(config, granule, (fsdp, sp), tile=tile).values()) - per_token
            guess = max(granule, (limit - fixed) / max(per_token / granule, 1) / 4)
            start = 2 ** max(int(math.log2(granule)), int(math.log2(guess)))
        say(f"# {preset}, mesh fsdp={fsdp},sp={sp}, remat {remat}, blocks {'scanned' if scanned else 'unrolled'}, "
            f"GDN {gdn_mode}, tile {tile}, "
            f"limit {limit / 2**30:.1f} GiB per device, compiled by {compiler}")
        found, _ = longest_fitting(measure, limit, start=start, granule=granule, log=say)
        if found is None:
            best, fits = measure(granule), False
        else:
            best, fits = found, True
    parts = components(best)
    budget = step_budget(config, best.seq, (fsdp, sp), tile=tile)
    say(f"\n{compiler}: S = {best.seq:,} tokens ({best.seq // sp:,} per device): {'fits' if fits else 'does not fit'}, "
        f"{best.total / 2**30:.2f} GiB per device (compile {best.compile_s:.0f} s)")
    for name, value in parts.items():
        say(f"  {name:<50} {value / 2**30:9.2f} GiB")
    say("analytic budget (what must exist on a bf16 device):")
    for name, value in budget.items():
        say(f"  {name:<50} {value / 2**30:9.2f} GiB")
    return {"preset": preset, "mesh": f"fsdp={fsdp},sp={sp}", "seq": best.seq, "fits": fits,
            "total_bytes": best.total, "components": parts, "budget": budget, "remat": remat,
            "gdn_mode": gdn_mode, "scan_layers": scanned, "tile": tile, "device_memory": limit, "target": target,
            "compile_s": round(best.compile_s, 1), "image_patches": image_patches}


def fsdp_sp_product(spec: str) -> int:
    """F * S of a 'fsdp=F,sp=S' string (parse_mesh checks it against this device count)."""
    sizes = {}
    for part in spec.split(","):
        name, _, value = part.strip().partition("=")
        try:
            sizes[name.strip()] = int(value)
        except ValueError:
            raise ValueError(f"bad mesh {spec!r}: expected 'fsdp=F,sp=S'") from None
    return sizes.get("fsdp", 1) * sizes.get("sp", 1)
