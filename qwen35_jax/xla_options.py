"""XLA compiler options of our jitted steps, per backend.

On CPU, jax 0.10's XLA hands dots, elementwise ops and reductions to YNNPACK. Its reductions are
slow on the shapes a train step has, such as a [64, 4, 2, 64, 64] array summed over the axis of size 2
(the gradient of a key-head Gram matrix shared by two value heads) or a [4096, 256] column sum (a norm
weight's gradient). With YNNPACK fusions off, XLA's own emitters and its other dot libraries run the
same HLO in less time (docs/lab_log.md has the figures). Turning off only the
reductions is not an option: dot and elementwise fusions without them fail at run time on some of
our layouts ("unsupported layout in YNN fusion").

XLA:CPU also expands jax.checkpoint's optimization barriers before its common-subexpression
elimination, which then merges the backward's recomputed forward into the saved one: every remat
policy compiled to the program without remat (same dots, same memory). With that pass
(`cse_barrier_expander`) disabled the barriers stay, recomputation happens where remat puts it, and
compile-time memory on CPU tells the policies apart (`tests/test_xla_options.py` holds remat to saving
memory). Programs without checkpoints compile as before.

XLA:CPU's scheduler is left at its default: its memory-optimised one
(`xla_cpu_scheduler_type`) made some of our programs smaller and others much larger
(docs/lab_log.md, 2026-12-06), and the default is the one whose figure matched an H200's.

Generation's prefill and decode programs have no backward pass and compile with XLA's defaults
(`generation/programs.py`).

Options are probed one by one, once: a jaxlib that no longer knows one (or one of its values)
compiles without it instead of failing. GPU and TPU get no options.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

CPU_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "",  # "": the empty list of YNNPACK fusion kinds
    "xla_disable_hlo_passes": "cse_barrier_expander",  # keep remat's optimization barriers (see above)
}


@functools.cache
def _accepted_cpu_options(options: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The options this jaxlib compiles with (on the default backend, CPU), each tried on its own."""
    accepted = {}
    for name, value in options:
        try:
            jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(jnp.zeros(())).compile()
        except Exception:  # noqa: BLE001 - an unknown option or value: XLA's default for it
            continue
        accepted[name] = value
    return accepted


def compiler_options(platform: str | None = None) -> dict[str, str]:
    """The `compiler_options=` for `jax.jit` of a program for `platform` (None: jax's backend)."""
    if (platform or jax.default_backend()) != "cpu":
        return {}
    return dict(_accepted_cpu_options(tuple(CPU_OPTIONS.items())))
