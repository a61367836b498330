"""Every training objective by its `--objective` name, and `train` with the one the options name.

It sits above `train/` (SFT and offline PPO, and the interface) and `rl/` (online GRPO), so that neither
of those imports the other's objectives: `scripts/train.py --objective NAME` picks one here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qwen35_jax.train.objective import Objective
    from qwen35_jax.train.options import TrainOptions
    from qwen35_jax.train.signals import StopRequest


def objective_for(name: str) -> Objective:
    """The objective `--objective name` trains: sft, ppo (batches from files) or grpo (online)."""
    if name == "grpo":
        from qwen35_jax.rl.online import OnlineGRPO

        return OnlineGRPO()
    from qwen35_jax.train.offline import OfflineObjective

    return OfflineObjective(name)


def train(options: TrainOptions, stop: StopRequest | None = None) -> int:
    """`qwen35_jax.train.loop.train` of `options` with the objective it names; the exit code."""
    from qwen35_jax.train.loop import train as train_with

    return train_with(options, stop, objective_for(options.objective))
