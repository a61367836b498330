"""scripts/device_check.sh, the GPU check, runs end to end here in its smoke mode (tiny shapes,
interpreted kernels), with every train-step variant docs/results.md tells the next GPU lease to
time. A device lease is short and rare: a check that breaks on a renamed flag or a moved function
must break here, not on the device."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def documented_variants() -> list[str]:
    """Every ';'-separated TRAIN_VARIANTS entry that docs/results.md names, in order, once each."""
    text = (ROOT / "docs" / "results.md").read_text()
    found = [" ".join(v.split()) for group in re.findall(r'TRAIN_VARIANTS="([^"]*)"', text) for v in group.split(";")]
    return list(dict.fromkeys(v for v in found if v))


def gpu_only(variant: str) -> bool:
    """Whether bench_train refuses `variant` off a GPU (cuDNN attention), as it does here."""
    flags = variant.split()
    return "--attention" in flags and flags[flags.index("--attention") + 1] == "cudnn"


def find_errors(node: object, path: str = "") -> list[str]:
    """Every "error" entry in a device_check result tree, with its path."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return []
    errors = []
    for key, value in items:
        errors += [f"{path}: {value}"] if key == "error" else find_errors(value, f"{path}/{key}")
    return errors


@pytest.mark.slow
def test_device_check_smoke_runs_every_stage_and_documented_variant(tmp_path):
    variants = documented_variants()
    assert variants, "docs/results.md names no TRAIN_VARIANTS for the next GPU lease"
    env = dict(os.environ)
    env.update(SMOKE="1", STAGES="kernels,train", PYTHON=sys.executable, OUT=str(tmp_path),
               TRAIN_VARIANTS=";".join(variants))
    run = subprocess.run(["bash", "scripts/device_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    kernels = json.loads((tmp_path / "device_check.json").read_text())
    assert {"correctness", "matmul", "pallas_fwd_bwd", "xla_fwd_bwd", "attention"} <= set(kernels)
    # cuDNN attention is the one entry that cannot run here: it must fail on the missing cuDNN only
    # (jax says "not detected" on a CPU-only install, "not found" with the gpu-compile extra's CUDA plugin)
    for name in ("cudnn", "cudnn_fallback"):
        error = kernels["attention"].pop(name)["error"]
        assert "cuDNN is not detected" in error or "cuDNN not found" in error, error
    assert find_errors(kernels) == []
    assert kernels["attention"]["ok"]

    def step_time(name: str) -> float:
        rows = json.loads((tmp_path / name).read_text())["runs"]
        assert len(rows) == 1 and find_errors(rows) == []
        return rows[0]["ours"]["median_s"]

    assert step_time("train_step.json") > 0
    log = (tmp_path / "train_step_log.txt").read_text()
    for i, variant in enumerate(variants):
        if gpu_only(variant):  # parsed, then refused by the kernel check before anything is built
            assert not (tmp_path / f"train_variant_{i}.json").exists()
            assert "error: attention implementation 'cudnn' needs a CUDA GPU, this backend is cpu" in log
            continue
        assert step_time(f"train_variant_{i}.json") > 0, variant
        result = json.loads((tmp_path / f"train_variant_{i}.json").read_text())
        ours = result["runs"][0]["ours"]
        flags = variant.split()
        for word in flags:  # leading NAME=VALUE words: XLA_FLAGS=... reached the call's XLA_FLAGS
            if word.startswith("XLA_FLAGS="):
                assert word.removeprefix("XLA_FLAGS=") in result["xla_flags"].split(), (variant, result["xla_flags"])
        for flag, key in (("--gdn-precision", "gdn_precision"), ("--attention", "attention"),
                          ("--logprob-backend", "logprob_backend")):
            if flag in flags:  # the variant's setting reached the timed step
                assert ours[key] == flags[flags.index(flag) + 1], (variant, ours)
    core, local = json.loads((tmp_path / "gdn_core.json").read_text())["runs"]
    timed = [k for k in core if k.startswith("ours ")]
    assert len(timed) == 9 and all(core[k]["median_s"] > 0 for k in timed)  # 3 precisions x 3 blocks
    # the chunk-local kernels against the XLA ops at each precision (interpreted here: float32 rounding
    # at highest, bf16 rounding at bf16)
    assert local["config"] == "gdn_chunk_local"
    for precision, bound in (("highest", 1e-5), ("default", 1e-5), ("bf16", 3e-2)):
        assert local[f"ours xla {precision}"]["median_s"] > 0
        assert local[f"ours pallas {precision}"]["max_rel_grad_err_vs_xla"] < bound, (precision, local)
    assert (tmp_path / "train_step_hlo.txt.gz").stat().st_size > 0
    took = re.findall(r"^== took \d+ s, exit (\d+): bench_train", log, re.M)
    # every call's wall time, for budgeting a lease: the traced step, the variants (the GPU-only ones
    # exit 2 here), the GDN core
    assert took == ["0"] + ["2" if gpu_only(v) else "0" for v in variants] + ["0"]
