"""scripts/train.py under jax.distributed: 2 processes x 4 CPU devices train the same loss curve as
1 process x 8 devices, and a checkpoint the two processes wrote resumes in one process."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from distributed_testutil import run_processes

from qwen35_jax.objectives import train
from qwen35_jax.train.options import TrainOptions

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dict(preset="tiny", synthetic=True, seq_len=32, batch_size=8, lr=3e-3, warmup_steps=1, steps=6,
               save_every=2, progress=False, mesh="fsdp=2,sp=4")


def losses(out: Path) -> np.ndarray:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return np.array([r["loss"] for r in rows])


@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoint_resumes_in_one(tmp_path):
    single = tmp_path / "single"
    assert train(TrainOptions(**OPTIONS, out=str(single))) == 0

    multi = tmp_path / "multi"
    flags = []
    for name, value in {**OPTIONS, "out": str(multi)}.items():
        flags += [f"--{'' if value else 'no-'}{name.replace('_', '-')}"] if isinstance(value, bool) else \
                 [f"--{name.replace('_', '-')}", str(value)]
    outputs = run_processes([sys.executable, str(ROOT / "scripts" / "train.py"), *flags])
    assert "trained steps 1-6 of 6" in outputs[0] and "trained steps" not in outputs[1]  # process 0 reports
    # each process fed its own rows; float32 sums meet in another order across the two processes
    np.testing.assert_allclose(losses(multi), losses(single), rtol=1e-5)

    resumed = tmp_path / "resumed"
    shutil.copytree(multi, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")  # resume from the step-4 checkpoint of the two processes
    assert train(TrainOptions(**OPTIONS, out=str(resumed))) == 0
    np.testing.assert_allclose(losses(resumed), losses(single), rtol=1e-5)


@pytest.mark.slow
def test_two_processes_run_grpo_like_one(tmp_path):
    """Online GRPO: each of 2 processes x 4 devices samples, scores and trains its own half of every
    step's prompts; the rewards and losses are those of 1 process x 8 devices."""
    from qwen35_jax.demos.grpo import task_rows

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in task_rows(32, seed=0)))
    options = dict(preset="tiny", objective="grpo", data=str(prompts), reward="qwen35_jax.rewards:reversed_digits",
                   group_size=4, batch_size=16, max_new_tokens=6, stop_token_ids="3", temperature=1.0, lr=1e-2,
                   steps=2, save_every=2, progress=False, mesh="fsdp=2,sp=4", eval_data=str(prompts), eval_every=2)
    single = tmp_path / "single"
    assert train(TrainOptions(**{**options, "data": [str(prompts)], "eval_data": [str(prompts)]},
                              out=str(single))) == 0
    multi = tmp_path / "multi"
    flags = []
    for name, value in {**options, "out": str(multi)}.items():
        flags += [f"--{'' if value else 'no-'}{name.replace('_', '-')}"] if isinstance(value, bool) else \
                 [f"--{name.replace('_', '-')}", str(value)]
    run_processes([sys.executable, str(ROOT / "scripts" / "train.py"), *flags])

    def rows(out: Path) -> list[dict]:
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]

    for a, b in zip(rows(multi), rows(single), strict=True):
        # the same samples (keys from the seed, the step and each prompt's place in the step), float32 sums
        # in another order across the processes
        np.testing.assert_allclose([a["reward_mean"], a["response_length_mean"]],
                                   [b["reward_mean"], b["response_length_mean"]], rtol=1e-6)
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5, atol=1e-7)
        assert a["eval_reward"] == pytest.approx(b["eval_reward"], rel=1e-6) if "eval_reward" in b else True
