"""A run's checkpoints: orbax `CheckpointManager`, asynchronous, the newest `keep` kept.

    RUN/checkpoints/<step>/params      the parameters (pure dict, sharded)  } a qwen35_jax checkpoint:
    RUN/checkpoints/<step>/meta        config, HF layout, the run's state  } `load_model` reads it
    RUN/checkpoints/<step>/opt_state   the optimizer state

`meta["train"]` holds the step, the data position, the skipped-step count and the seed: with the
parameters and optimizer state, everything a resumed run needs to continue the same loss curve. Orbax
writes each step into a temporary directory and renames it when complete, so a checkpoint cut off
mid-write is never listed. A checkpoint that fails to restore is moved to RUN/damaged/ and the one
before it is used.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp

from qwen35_jax.checkpoint import FORMAT, VERSION, tree_handler
from qwen35_jax.run_layout import CHECKPOINTS_DIR, DAMAGED_DIR


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    return {"params": tree_handler(), "opt_state": tree_handler(), "meta": ocp.JsonCheckpointHandler()}


def _with_restore_shardings(abstract: Any) -> Any:
    return ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


class RunCheckpoints:
    """Save and restore (params, opt_state, meta) of one run directory."""

    def __init__(self, run_dir: str, *, keep: int):
        self.run_dir = os.path.abspath(run_dir)
        self.directory = os.path.join(self.run_dir, CHECKPOINTS_DIR)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def model_config(self) -> dict[str, Any] | None:
        """The model config of the run (the same in every checkpoint), read from the newest checkpoint
        whose metadata reads, so that a damaged newest one still leaves the run resumable."""
        from qwen35_jax.checkpoint import read_metadata
        for step in reversed(self.steps()):
            try:
                return read_metadata(os.path.join(self.directory, str(step)))["config"]
            except (ValueError, OSError, KeyError):
                continue
        return None

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
        """Start writing step `step` in the background (training goes on; `wait` blocks until done)."""
        meta = {"format": FORMAT, "version": VERSION, **meta}
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.PyTreeSave(params), opt_state=ocp.args.PyTreeSave(opt_state), meta=ocp.args.JsonSave(meta)),
            force=True)

    def restore_latest(self, abstract_params: Any, abstract_opt_state: Any) -> tuple[int, Any, Any, dict[str, Any]] | None:
        """(step, params, opt_state, meta) of the newest checkpoint that restores, onto the shardings of
        the abstract targets (any mesh); None when there is none. Damaged ones are moved aside."""
        for step in reversed(self.steps()):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    params=_with_restore_shardings(abstract_params),
                    opt_state=_with_restore_shardings(abstract_opt_state), meta=ocp.args.JsonRestore()))
                meta = restored["meta"]
                if not isinstance(meta, dict) or "train" not in meta:
                    raise ValueError("its metadata has no training state")
            except Exception as err:  # any failure to read it: corrupt files, wrong shapes, missing items
                self._set_aside(step, err)
                continue
            return step, restored["params"], restored["opt_state"], meta
        return None

    def _set_aside(self, step: int, err: Exception) -> None:
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        target = os.path.join(self.run_dir, DAMAGED_DIR, str(step))
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.exists(target):
                shutil.rmtree(target)
            shutil.move(os.path.join(self.directory, str(step)), target)
            print(f"warning: checkpoint {step} of {self.run_dir} does not restore ({reason}); moved it to "
                  f"{target} and resuming from the one before", file=sys.stderr, flush=True)
        from qwen35_jax.parallel.processes import sync_processes
        sync_processes(f"qwen35_ckpt_aside_{step}")
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
