"""What a run trains: an `Objective` checks its options, sizes its batches, builds the `StepOptions` of
its update and, once the model exists, opens an `ObjectiveRun`: where the run's batches come from, its
step, its evaluation and the state its checkpoints keep.

    SFT and offline PPO/GRPO (batches from files):  qwen35_jax.train.offline.OfflineObjective
    online GRPO (sample, reward, update):           qwen35_jax.rl.online.OnlineGRPO

The loop (`train.loop`) knows only this interface, so `train/` imports neither `rl` nor `generation`;
`qwen35_jax.objectives.objective_for` picks the one `--objective` names.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.train.optim import Params
from qwen35_jax.train.options import TrainOptions
from qwen35_jax.train.step import Batch, StepOptions

TrainStep = Callable[[Params, Any, Batch], tuple[Params, Any, dict[str, jax.Array]]]
Metrics = dict[str, Any]  # host scalars of one step


class TrainState(Protocol):
    """What a step updates: the parameters and optimizer state, by the run's jitted `train_step`."""
    params: Params
    opt_state: Any
    train_step: TrainStep


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What an objective's side of a run is built from, once the model exists."""
    options: TrainOptions  # resolved: batch size, schedule length and compute dtype filled in
    mesh: jax.sharding.Mesh
    config: Qwen35Config  # the run's (compute dtype, remat, kernel choices)
    graphdef: nnx.GraphDef  # of `config`
    params: Params  # the starting or restored parameters, sharded
    step_options: StepOptions  # the run's, the one source of its scoring settings
    batch_size: int
    shard_index: int  # this process's share of every batch's rows
    shard_count: int
    restored: bool  # the parameters come from one of the run's checkpoints
    start_params: Callable[[str | None], Params]  # a --model path's parameters (None: the --preset init)


class ObjectiveRun(abc.ABC):
    """One run's side of its objective."""

    @property
    def evaluates(self) -> bool:
        """Whether `evaluate` has anything to measure."""
        return False

    @abc.abstractmethod
    def step(self, state: TrainState, step: int) -> tuple[Metrics, int]:
        """(metrics, padded row length) of optimizer step `step`; updates state.params and opt_state.
        Metrics hold at least loss, applied and batch_tokens; "updates_applied" when a step makes
        several updates."""

    def evaluate(self, params: Params) -> dict[str, float]:
        """eval_* metrics of `params`."""
        return {}

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]:
        """The JSON-serialisable position of its batch source, saved with every checkpoint."""

    @abc.abstractmethod
    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from a `get_state()`."""

    def epoch(self) -> float:
        """Passes over the training data so far (logged with every step)."""
        return 0.0

    def plots(self, run_dir: str) -> list[str]:
        """Files it plots in the run directory at the end, beside loss.png."""
        return []

    def summary(self, trained: list[Metrics]) -> str:
        """What the end-of-run line adds after the loss (", ..." or empty), from the trained rows."""
        return ""


class Objective(abc.ABC):
    """A training objective by its `--objective` name."""
    name: str

    def check(self, options: TrainOptions) -> None:
        """Its checks that need no devices; one-line ValueErrors."""

    def default_batch_size(self, options: TrainOptions, fsdp: int) -> int:
        """Rows per optimizer step without --batch-size: one per fsdp shard and micro-batch."""
        return fsdp * options.grad_accum

    def updates_per_step(self, options: TrainOptions) -> int:
        """Optimizer updates per step (the learning-rate schedule counts updates)."""
        return 1

    @abc.abstractmethod
    def step_options(self, options: TrainOptions) -> StepOptions:
        """What the jitted step computes."""

    @abc.abstractmethod
    def open(self, setup: RunSetup) -> ObjectiveRun:
        """Its side of the run: batch source, step, evaluation."""


def step_options_of(options: TrainOptions, loss: str, *, on_policy: bool = False) -> StepOptions:
    """The StepOptions of `options` with the step's loss `loss` (sft or ppo; `on_policy`: its old
    log-probs are its own, see StepOptions): the only place the scoring settings (temperature,
    log-prob backend, lm_head mode) are read from the options."""
    return StepOptions(
        objective=loss, temperature=options.temperature, clip_low=options.clip_ratio,
        clip_high=options.clip_ratio_high, entropy_coef=options.entropy_coef, kl_coef=options.kl_coef,
        kl_estimator=options.kl_estimator, backend=options.logprob_backend, lm_head_mode=options.lm_head,
        freeze_vision=options.freeze_vision, dual_clip=options.clip_ratio_c if loss == "ppo" else None,
        sequence_ratio=options.policy_loss == "gspo", loss_agg=options.loss_agg,
        on_policy=on_policy, rollout_is=options.rollout_is, rollout_is_threshold=options.rollout_is_threshold)
