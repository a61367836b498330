"""SFT and offline PPO/GRPO: every batch comes from files (--data, or --synthetic rows), one optimizer
update per batch; the evaluation is the held-out token means over --eval-data."""

from __future__ import annotations

from typing import Any

import jax

from qwen35_jax.train.data import BatchStream, place_batch
from qwen35_jax.train.objective import Metrics, Objective, ObjectiveRun, RunSetup, TrainState, step_options_of
from qwen35_jax.train.optim import Params
from qwen35_jax.train.options import TrainOptions
from qwen35_jax.train.sources import open_eval_stream, open_train_stream
from qwen35_jax.train.step import StepOptions, finish_eval, make_eval_step
from qwen35_jax.train.vision import carries_images, vision_batch

OFFLINE = ("sft", "ppo")


class OfflineObjective(Objective):
    """--objective sft (token-mean NLL) or ppo (the clipped surrogate on rollouts from files)."""

    def __init__(self, name: str):
        if name not in OFFLINE:
            raise ValueError(f"an offline objective is one of {', '.join(OFFLINE)}, got {name!r}")
        self.name = name

    def step_options(self, options: TrainOptions) -> StepOptions:
        return step_options_of(options, self.name)

    def open(self, setup: RunSetup) -> ObjectiveRun:
        return FileBatches(setup)


class FileBatches(ObjectiveRun):
    """The training stream, the held-out stream and the eval step of an offline run."""

    def __init__(self, setup: RunSetup):
        options, fields = setup.options, setup.step_options.required_fields()
        self.mesh, self.grad_accum, self.shard_count = setup.mesh, options.grad_accum, setup.shard_count
        self.config, self.max_patches = setup.config, options.max_patches
        self.stream: BatchStream = open_train_stream(
            options, config=setup.config, mesh=setup.mesh, batch_size=setup.batch_size,
            shard_index=setup.shard_index, shard_count=setup.shard_count, fields=fields, graphdef=setup.graphdef,
            params=setup.params, scoring=setup.step_options.scoring)
        self.eval_stream, self.eval_batches = open_eval_stream(
            options, config=setup.config, batch_size=setup.batch_size, shard_index=setup.shard_index,
            shard_count=setup.shard_count, fields=fields)
        # every evaluation reads the same first batches: the held-out stream's position before them
        self.eval_start = self.eval_stream.get_state() if self.eval_stream is not None else None
        self.eval_step = make_eval_step(setup.graphdef, setup.step_options, kernels=setup.config.kernels)

    @property
    def evaluates(self) -> bool:
        return self.eval_stream is not None

    def place(self, host: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        """A host batch on the mesh; a VLM batch with its positions and vision inputs (`train/vision.py`)."""
        if carries_images(host):
            host = vision_batch(host, self.config, grad_accum=self.grad_accum, max_patches=self.max_patches,
                                step=step)
        return place_batch(host, self.mesh, self.grad_accum, self.shard_count)

    def step(self, state: TrainState, step: int) -> tuple[Metrics, int]:
        batch = self.place(self.stream.next_batch(), step)
        state.params, state.opt_state, metrics = state.train_step(state.params, state.opt_state, batch)
        return jax.device_get(metrics), batch["tokens"].shape[-1]

    def evaluate(self, params: Params) -> dict[str, float]:
        """Held-out token means over the first `eval_batches` batches of --eval-data (the same each time)."""
        self.eval_stream.set_state(self.eval_start)
        totals: dict[str, float] = {}
        for _ in range(self.eval_batches):
            batch = self.place(self.eval_stream.next_batch())
            for name, value in jax.device_get(self.eval_step(params, batch)).items():
                totals[name] = totals.get(name, 0.0) + float(value)
        return {f"eval_{name}": value for name, value in finish_eval(totals).items()}

    def get_state(self) -> dict[str, Any]:
        return self.stream.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.stream.set_state(state)

    def epoch(self) -> float:
        return float(getattr(self.stream, "epoch", 0.0))
