"""The run directory: its resolved options, whether it can be resumed, and how a run starts or resumes.

RUN/config.yaml holds the resolved options of the run (TrainOptions), readable by --config; the rest of
the directory's layout is in `qwen35_jax.run_layout`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from qwen35_jax.files import write_text_atomically
from qwen35_jax.run_layout import CONFIG_FILE
from qwen35_jax.train.options import RESUMABLE_CHANGES, TrainOptions, differences


def stored_options(run_dir: str) -> dict[str, Any] | None:
    """The options a run directory was made with, or None for a new (absent or empty) directory."""
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            stored = yaml.safe_load(f)
        return dict(stored)
    except (OSError, yaml.YAMLError, TypeError, ValueError) as err:
        raise ValueError(f"{path} is not a readable run configuration ({type(err).__name__}); "
                         "use another --out") from None


def open_run_dir(run_dir: str, options: TrainOptions) -> tuple[TrainOptions, bool]:
    """(options, whether `run_dir` continues an earlier run). Resuming, run-defining options left
    unset (None: batch size, schedule length, ...) take the stored, resolved values. A one-line
    ValueError when the directory holds another run or something that is not a run directory."""
    if os.path.isfile(run_dir):
        raise ValueError(f"--out {run_dir} is a file, not a run directory")
    if not os.path.isdir(run_dir):
        return options, False
    stored = stored_options(run_dir)
    if stored is None:
        if os.listdir(run_dir):
            raise ValueError(f"--out {run_dir} exists and is not a run directory (no {CONFIG_FILE}); "
                             "use a new or empty directory")
        return options, False
    unset = {name: stored[name] for name, value in options.to_dict().items()
             if value is None and stored.get(name) is not None and name not in RESUMABLE_CHANGES}
    options = dataclasses.replace(options, **unset)
    changed = differences(stored, options)
    if changed:
        raise ValueError(f"--out {run_dir} holds another run: {'; '.join(changed)}. Use a new --out, "
                         "or the same settings to resume")
    return options, True


def write_config(run_dir: str, options: TrainOptions) -> None:
    """RUN/config.yaml (the resolved options; `--config RUN/config.yaml` resumes), replaced atomically."""
    os.makedirs(run_dir, exist_ok=True)
    text = yaml.safe_dump(options.to_dict(), sort_keys=False)
    write_text_atomically(os.path.join(run_dir, CONFIG_FILE), text)
