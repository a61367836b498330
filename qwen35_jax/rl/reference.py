"""The KL reference of an online run (--kl-coef > 0): the policy it starts from, fixed for the whole run.

`--model` may change when a run resumes (a moved checkpoint), and a run directory given as --model
resolves to its newest checkpoint, which moves on if that run trains further. So the checkpoint the run
started from is recorded in RUN/kl_reference.json when it starts, and every resume loads the reference
from there; a resume whose --model resolves to another checkpoint is refused before anything is
written (`check_reference`, one of the objective's option checks). A --preset run's reference is the
--preset init of --seed, both fixed with the run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from qwen35_jax.checkpoint import latest_run_checkpoint, resolve_checkpoint
from qwen35_jax.files import write_text_atomically
from qwen35_jax.parallel.processes import is_lead_process, sync_processes
from qwen35_jax.run_layout import KL_REFERENCE_FILE, is_run_dir
from qwen35_jax.train.objective import RunSetup
from qwen35_jax.train.optim import Params
from qwen35_jax.train.options import TrainOptions

def _resolved(model: str) -> str:
    return os.path.abspath(resolve_checkpoint(os.path.abspath(model)))


def read_reference(run_dir: str) -> dict[str, Any] | None:
    """RUN/kl_reference.json: {"model": --model as given, "checkpoint": what it resolved to} (None for
    a --preset run), or None when the run has not recorded one."""
    path = os.path.join(run_dir, KL_REFERENCE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _record(run_dir: str, model: str | None) -> None:
    record = None if model is None else {"model": os.path.abspath(model), "checkpoint": _resolved(model)}
    if is_lead_process():
        write_text_atomically(os.path.join(run_dir, KL_REFERENCE_FILE), json.dumps(record) + "\n")
    sync_processes("qwen35_kl_reference_recorded")


def check_reference(options: TrainOptions) -> None:
    """A one-line ValueError when `options` resume a run (one with a checkpoint) whose recorded KL
    reference --model no longer names, or whose recorded checkpoint is gone. Needs no devices and
    writes nothing: the run's config.yaml keeps the --model that matches it."""
    if options.kl_coef <= 0 or options.model is None or options.out is None:
        return
    if not is_run_dir(options.out) or latest_run_checkpoint(options.out) is None:
        return  # the run starts now (again): its reference is recorded then
    recorded, path = read_reference(options.out), os.path.join(options.out, KL_REFERENCE_FILE)
    if recorded is None:  # a run directory from before the reference was recorded
        return
    if os.path.abspath(options.model) != recorded["model"] and _resolved(options.model) != recorded["checkpoint"]:
        raise ValueError(f"--model {options.model}: this run's KL reference is {recorded['checkpoint']} (its "
                         f"starting point, {path}); resume with --model {recorded['model']} or start a new --out")
    if not os.path.isdir(recorded["checkpoint"]):
        raise ValueError(f"the KL reference {recorded['checkpoint']} ({path}) is gone: restore it to resume "
                         "this run, or start a new --out")


def kl_reference(setup: RunSetup) -> Params:
    """The reference parameters (sharded like the trained ones). A run that starts now: a copy of its
    starting parameters, their checkpoint recorded. A resumed run: the recorded checkpoint's
    (`check_reference` has refused a --model that names another one)."""
    options = setup.options
    if not setup.restored:  # the parameters are the starting point: record where they came from
        _record(options.out, options.model)
        return jax.tree.map(jnp.copy, setup.params)
    if options.model is None:  # --preset: the init of the run's seed
        return setup.start_params(None)
    recorded = read_reference(options.out)
    if recorded is None:  # a run directory from before the reference was recorded: --model, from now on
        _record(options.out, options.model)
        recorded = read_reference(options.out)
    return setup.start_params(recorded["checkpoint"])
