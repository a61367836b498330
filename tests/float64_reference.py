"""transformers (or plain torch) run in float64 end to end: the truth that float32 parity tests compare with.

A `.double()` transformers Qwen3.5 model is not float64 throughout: its modeling code pins float32 in the
RMSNorms, the rotary angles, the attention and router softmax and the gated delta rule (`.float()`,
`.to(torch.float32)`, `dtype=torch.float32`). Such a reference rounds about as much as our float32 model
(on the tiny checkpoints of tests/test_hf_io.py, 7.8e-5 from the float64 truth, against our 7.6e-5), so it
cannot tell our error from its own.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Float64Everywhere(TorchDispatchMode):
    """Every op that asks for float32 gets float64; an op that still returns a narrower float raises."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") == torch.float32:
            kwargs["dtype"] = torch.float64
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                raise AssertionError(f"{func} returned {t.dtype} inside torch_float64(); make inputs float64 first")
        return out


@contextlib.contextmanager
def torch_float64() -> Iterator[None]:
    """Run a float64 model (and its backward) inside: no op rounds to float32, or the op raises.

    Make the inputs float64 (or integer) torch tensors before entering.
    """
    with _Float64Everywhere():
        yield


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of `model`, in eval mode. Upcasting is exact, so a float32 model and its copy hold the
    same numbers. MoE experts run as transformers' per-expert loop (its grouped matmul has no float64 kernel)."""
    ref = copy.deepcopy(model).double().eval()
    if getattr(getattr(ref, "config", None), "num_experts", 0):
        ref.set_experts_implementation("eager")
    return ref
