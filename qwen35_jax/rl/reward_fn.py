"""The reward contract: a user's function of one completion, and the checks around every call.

    def reward(sample: dict) -> float

`sample` holds `prompt_ids`, `completion_ids`, `finish_reason` ("stop" or "length"), `prompt` and
`completion` (text, when a tokenizer is known) and every field of the prompt's data row (e.g.
`answer`). `--reward FILE.py:FUNCTION` or `--reward package.module:function` names it. A call that
raises, or returns something that is not a finite number, stops the run: `RewardError` names the
function, the data row and the problem.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

RewardFn = Callable[[dict[str, Any]], float]


class RewardError(ValueError):
    """A reward function that failed on a sample; the message is one line."""


def load_reward(spec: str) -> tuple[RewardFn, str]:
    """(the function, its name for messages) from "path/to/file.py:function" or "package.module:function"."""
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function:
        raise ValueError(f"--reward {spec!r}: expected FILE.py:FUNCTION or package.module:function")
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            raise ValueError(f"--reward {spec!r}: file {module_name} not found")
        module_spec = importlib.util.spec_from_file_location(f"_reward_{abs(hash(module_name))}", module_name)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            raise ValueError(f"--reward {spec!r}: importing {module_name} failed ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''})") from None
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"--reward {spec!r}: cannot import {module_name} ({err})") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: {module_name} has no function {function!r}")
    return fn, spec


def call_reward(fn: RewardFn, name: str, sample: Mapping[str, Any], where: str) -> float:
    """`fn(sample)` as a float; RewardError naming `name` and `where` (the data row) otherwise."""
    try:
        value = fn(dict(sample))
    except Exception as err:  # the user's code: any exception stops the run with its message
        text = str(err).splitlines()[0] if str(err) else ""
        raise RewardError(f"reward {name} failed on {where}: {type(err).__name__}: {text}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(f"reward {name} returned {type(value).__name__} {value!r:.60} on {where}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"reward {name} returned {value} on {where}, not a finite number")
    return value
