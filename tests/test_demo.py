"""The README's main job: `python scripts/train.py` with no arguments trains the tiny model on the
bundled corpus, its loss falls clearly and it shows what the model learned. The
HF import / score / export walk-through (scripts/hf_roundtrip.py) runs end to end too."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from compile_flags import with_devices

ROOT = Path(__file__).resolve().parents[1]


def demo_env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "XLA_FLAGS": with_devices(8)}  # the eight devices both scripts default to
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # where the corpus is written
    return env


@pytest.mark.slow
def test_training_demo_learns(tmp_path):
    """40 steps of the demo; resuming a run directory is the same code path, tested in test_train_run."""
    out = tmp_path / "demo"
    train = [sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(out)]
    result = subprocess.run([*train, "--steps", "40"], capture_output=True, text=True, timeout=900,
                            env=demo_env(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 40 and losses[-1] < 0.8 * losses[0], losses  # falls by a fifth or more
    assert any(r.get("eval_loss") for r in rows)
    assert (out / "loss.png").is_file() and (out / "checkpoints" / "40").is_dir()
    assert "what the model learned" in result.stdout and "trained:" in result.stdout
    assert "continuations of held-out text" in result.stdout and result.stdout.count("random init: ...") == 3


@pytest.mark.slow
def test_grpo_demo_raises_held_out_accuracy(tmp_path):
    """`scripts/train.py --demo grpo`: brief SFT, then online GRPO; the greedy exact-answer rate on
    held-out prompts rises clearly (41% -> 95% on 2026-12-07)."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--demo", "grpo"], capture_output=True,
                            text=True, timeout=900, env=demo_env(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("held-out greedy accuracy (exact"))
    before, after = (int(x) / 100 for x in re.findall(r"after (?:SFT|GRPO) (\d+)%", line))
    assert after >= before + 0.2, line
    assert (tmp_path / "runs" / "demo-grpo" / "grpo" / "reward.png").is_file()
    rows = [json.loads(x) for x in (tmp_path / "runs" / "demo-grpo" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["logprob_mismatch"] for r in rows if "logprob_mismatch" in r) < 1e-4


@pytest.mark.slow
def test_hf_roundtrip_runs_end_to_end(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "hf_roundtrip.py"), "--workdir",
                             str(tmp_path / "roundtrip")], capture_output=True, text=True, timeout=600,
                            env=demo_env(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "on mesh {'fsdp': 2, 'sp': 4}" in result.stdout
    assert "bit-identical: True" in result.stdout
    assert (tmp_path / "roundtrip" / "scores.npz").is_file()
