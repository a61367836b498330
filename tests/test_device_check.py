"""scripts/device_check.sh, the GPU check, here on CPU: a device lease is short and rare, so a check
that breaks on a renamed flag or a moved function must break here, not on the device.

Every train-step variant of scripts/bench/device_check_variants.txt is read by the script itself and
its exact bench_train arguments (the device's shapes) go through bench_train's parser. Then the
whole check runs in its smoke mode (tiny shapes, interpreted kernels): every stage, and every
variant's flags and environment words in a step that runs. On CPU a variant's environment words
only add XLA flags, so the variants are merged into as few steps as no flag (or variable) takes two
values in: each bench_train process costs a compile, and merged they cover the same code."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VARIANTS_FILE = ROOT / "scripts" / "bench" / "device_check_variants.txt"
CUDNN_REFUSED = "attention implementation 'cudnn' needs a CUDA GPU, this backend is cpu"


def file_variants() -> list[str]:
    """The variants file's entries, in order: comments and blank lines dropped, spaces squeezed."""
    lines = (re.split(r"(?:^|\s)#", line, maxsplit=1)[0] for line in VARIANTS_FILE.read_text().splitlines())
    return [" ".join(line.split()) for line in lines if line.strip()]


def list_variants(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`LIST_VARIANTS=1 bash scripts/device_check.sh`: the variants the train stage would run."""
    full = {k: v for k, v in os.environ.items() if k not in ("TRAIN_VARIANTS", "TRAIN_VARIANT_RANGE", "SMOKE")}
    full.update(LIST_VARIANTS="1", OUT=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", "scripts/device_check.sh"], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=60)


def listed(run: subprocess.CompletedProcess) -> list[tuple[int, str, list[str]]]:
    assert run.returncode == 0, run.stderr
    rows = [line.split("\t") for line in run.stdout.splitlines()]
    return [(int(n), words, args.split()) for n, words, args in rows]


def split(variant: str) -> tuple[list[str], list[str]]:
    """A variant's leading NAME=VALUE environment words and its bench_train flags."""
    words = variant.split()
    n = next((i for i, w in enumerate(words) if not re.match(r"[A-Z_][A-Z0-9_]*=", w)), len(words))
    return words[:n], words[n:]


def gpu_only(variant: str) -> bool:
    """Whether bench_train refuses `variant` off a GPU (cuDNN attention), as it does here."""
    flags = split(variant)[1]
    return "--attention" in flags and flags[flags.index("--attention") + 1] == "cudnn"


def merged(variants: list[str]) -> list[str]:
    """Every variant's environment words and flags (but cuDNN attention, refused off a GPU) merged into
    as few variants as no flag or environment variable takes two values in; XLA_FLAGS words add up,
    so each is an item of its own."""
    runs: list[dict[tuple[str, str], tuple[str, ...]]] = []
    for variant in variants:
        envs, flags = split(variant)
        items = {("env", e if e.startswith("XLA_FLAGS=") else e.split("=")[0]): (e,) for e in envs}
        starts = [i for i, w in enumerate(flags) if w.startswith("--")] + [len(flags)]
        items.update({("flag", flags[a]): tuple(flags[a:b]) for a, b in zip(starts, starts[1:])})
        if items.get(("flag", "--attention")) == ("--attention", "cudnn"):
            del items[("flag", "--attention")]
        if not items:
            continue
        run = next((r for r in runs if all(r.get(k, v) == v for k, v in items.items())), None)
        if run is None:
            runs.append(run := {})
        run.update(items)
    return [" ".join(w for kind in ("env", "flag") for (k, _), words in run.items() if k == kind for w in words)
            for run in runs]


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


def test_merged_variants_keep_every_flag_and_split_conflicts():
    got = merged(["--attention cudnn", "--gdn-precision bf16", "XLA_FLAGS=--a", "XLA_FLAGS=--b --attention cudnn",
                  "XLA_FLAGS=--c", "--attention xla", "--batch 4 --remat mlp", "--gdn-precision default",
                  "FOO=1 --core-precisions highest bf16", "FOO=2"])
    assert got == ["XLA_FLAGS=--a XLA_FLAGS=--b XLA_FLAGS=--c FOO=1 --gdn-precision bf16 --attention xla --batch 4 "
                   "--remat mlp --core-precisions highest bf16", "FOO=2 --gdn-precision default"]


def test_the_script_reads_the_variants_file_and_bench_train_parses_each(tmp_path, monkeypatch, capsys):
    expected = file_variants()
    assert expected, f"{VARIANTS_FILE} lists no variant"
    rows = listed(list_variants(tmp_path))
    assert [(n, words) for n, words, _ in rows] == list(enumerate(expected, 1))
    assert not (tmp_path / "out").exists()  # listing writes nothing

    # each variant's arguments exactly as the train stage passes them on the device, through bench_train's
    # own parser (run as a script, its folder is first on the path)
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench"))
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "scripts" / "bench" / "bench_train.py")
    bench_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_train)
    for n, variant, args in rows:
        assert args[:2] == ["--preset", "0.8B"] and args[-2:] == ["--json", str(tmp_path / "out" /
                                                                          f"train_variant_{n}.json")]
        assert " ".join(split(variant)[1]) in " ".join(args), (variant, args)
        if gpu_only(variant):  # refused by the kernel check off a GPU, before anything is built
            with pytest.raises(SystemExit):
                bench_train.parse_args(args)
            assert CUDNN_REFUSED in capsys.readouterr().err
        else:
            bench_train.parse_args(args)

    # TRAIN_VARIANT_RANGE picks by number; TRAIN_VARIANTS replaces the file; a bad range stops the check
    assert [n for n, _, _ in listed(list_variants(tmp_path, TRAIN_VARIANT_RANGE="2-3"))] == [2, 3]
    assert [n for n, _, _ in listed(list_variants(tmp_path, TRAIN_VARIANT_RANGE=f"{len(expected)}-"))] == \
        [len(expected)]
    override = list_variants(tmp_path, TRAIN_VARIANTS="--attention xla; ;XLA_FLAGS=--x  --steps 1 # why",
                             TRAIN_VARIANT_RANGE="2")
    assert [(n, words) for n, words, _ in listed(override)] == [(2, "XLA_FLAGS=--x --steps 1")]
    assert listed(list_variants(tmp_path, TRAIN_VARIANTS="")) == []
    for bad in ("0-2", "two", str(len(expected) + 1)):
        run = list_variants(tmp_path, TRAIN_VARIANT_RANGE=bad)
        assert run.returncode != 0 and "TRAIN_VARIANT_RANGE" in run.stderr, (bad, run.stdout)


@pytest.mark.slow
def test_device_check_smoke_runs_every_stage_and_variant(tmp_path):
    variants = file_variants()
    # the GPU-only variants as they are (refused here), then everything merged
    smoke = [v for v in variants if gpu_only(v)] + merged(variants)
    env = dict(os.environ)
    env.pop("TRAIN_VARIANT_RANGE", None)
    env.update(SMOKE="1", STAGES="kernels,train,generate", PYTHON=sys.executable, OUT=str(tmp_path),
               TRAIN_VARIANTS=";".join(smoke))
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
    for n, variant in enumerate(smoke, 1):
        if gpu_only(variant):  # parsed, then refused by the kernel check before anything is built
            assert not (tmp_path / f"train_variant_{n}.json").exists()
            assert f"error: {CUDNN_REFUSED}" in log
            continue
        assert step_time(f"train_variant_{n}.json") > 0, variant
        result = json.loads((tmp_path / f"train_variant_{n}.json").read_text())
        row = result["runs"][0]
        envs, flags = split(variant)
        for word in envs:  # XLA_FLAGS=... reached the call's XLA_FLAGS (and XLA accepted it)
            if word.startswith("XLA_FLAGS="):
                assert word.removeprefix("XLA_FLAGS=") in result["xla_flags"].split(), (variant, result["xla_flags"])
        for flag, value in (("--gdn-precision", row["ours"].get("gdn_precision")),
                            ("--attention", row["ours"].get("attention")),
                            ("--logprob-backend", row["ours"].get("logprob_backend")),
                            ("--batch", str(row["batch"])), ("--remat", row["remat"])):
            if flag in flags:  # the variant's setting reached the timed step
                assert value == flags[flags.index(flag) + 1], (variant, flag, row)
    core, local = json.loads((tmp_path / "gdn_core.json").read_text())["runs"]
    timed = [k for k in core if k.startswith("ours ")]
    assert len(timed) == 3 and all(core[k]["median_s"] > 0 for k in timed)  # 3 precisions x the smoke's 1 block
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
    assert took == ["0"] + ["2" if gpu_only(v) else "0" for v in smoke] + ["0"]
    generation = json.loads((tmp_path / "generate.json").read_text())
    assert [r["case"] for r in generation["rows"]] == ["decode", "prefill"]
    assert all(r["ours_decode_tokens_per_s"] > 0 and r["cache_bytes"] > 0 for r in generation["rows"])
