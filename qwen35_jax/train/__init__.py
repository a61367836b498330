"""Training: options, the optimizer, the jitted SFT/PPO step, batch streams, objectives (SFT and offline
PPO here; online GRPO in `qwen35_jax.rl`), and the run loop (run directory, checkpoints, metrics,
signals) behind scripts/train.py.

Names are loaded on first use, so the command line parses options and installs its signal handler
before jax loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArrayBatches": "data", "BatchStream": "data", "check_batch_size": "data", "load_npy_dir": "data",
    "place_batch": "data", "synthetic_data": "data",
    "init_opt_state": "optim", "make_optimizer": "optim", "make_schedule": "optim", "opt_state_shardings": "optim",
    "TrainOptions": "options", "parse_options": "options",
    "OBJECTIVES": "step", "StepOptions": "step", "make_eval_step": "step", "make_train_step": "step",
    "Objective": "objective", "ObjectiveRun": "objective", "OfflineObjective": "offline",
    "train": "loop", "trainer_step": "library",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qwen35_jax.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"qwen35_jax.train.{_EXPORTS[name]}"), name)
