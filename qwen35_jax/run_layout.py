"""The names of what a training run directory (`scripts/train.py --out RUN`) holds: the one place
that knows them.

    RUN/config.yaml          the resolved options of the run (train/run.py); `--config RUN/config.yaml` resumes
    RUN/checkpoints/<step>/  a checkpoint per saved step (train/checkpoints.py), each one `load_model` reads
    RUN/damaged/<step>/      checkpoints that failed to restore, set aside on resume
    RUN/metrics.jsonl        one row per step (train/metrics.py)
    RUN/events.out.tfevents.*  TensorBoard (written by tensorboardX into RUN itself)
    RUN/loss.png             the loss curves, at the end;  RUN/reward.png: the reward of an online RL run
    RUN/synthetic/           the generated rows of a --synthetic run, so that a resume sees the same rows
    RUN/kl_reference.json    the checkpoint an online RL run's KL penalty compares against (rl/reference.py)
    RUN/preprocessor_config.json  a VLM run's image processor, --min/--max-pixels applied (train/loop.py):
                             a run or generate.py started from RUN sizes images as this run did

Other modules take the names from here (the checkpoint loader finds a run's newest checkpoint, the
generation tool reads a run's config.yaml for its tokenizer and model). Loads nothing but `os`.
"""

from __future__ import annotations

import os

CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
DAMAGED_DIR = "damaged"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
REWARD_PLOT_FILE = "reward.png"
SYNTHETIC_DIR = "synthetic"
KL_REFERENCE_FILE = "kl_reference.json"


def is_run_dir(path: str) -> bool:
    """A training run directory: checkpoints under RUN/checkpoints/<step>."""
    return os.path.isdir(os.path.join(path, CHECKPOINTS_DIR))
