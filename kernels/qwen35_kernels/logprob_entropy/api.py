"""Public entry point: argument checks, backend dispatch (`backend=`, else the kernel choices'
`logprob_backend`), log-prob/entropy from the core statistics."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import LOGPROB_BACKENDS, KernelChoices, overridden

from . import reference, xla

BACKENDS = LOGPROB_BACKENDS


def _pallas(hidden, weight, labels, temperature, *, choices):
    from . import pallas  # imported lazily: the Pallas modules are only needed here

    return pallas.token_stats(hidden, weight, labels, temperature, choices=choices)


def _pallas_xla(hidden, weight, labels, temperature, *, choices):
    from . import pallas_xla

    return pallas_xla.token_stats(hidden, weight, labels, temperature, choices=choices)


def _reference(hidden, weight, labels, temperature, *, choices):
    del choices
    return reference.token_stats(hidden, weight, labels, temperature)


def _xla(hidden, weight, labels, temperature, *, choices):
    return xla.token_stats(hidden, weight, labels, temperature, choices=choices)


# token_stats(hidden, weight, labels, temperature, *, choices) of each resolved backend
IMPLEMENTATIONS = {"reference": _reference, "xla": _xla, "pallas": _pallas, "pallas_xla": _pallas_xla}


def resolve_backend(backend: str | None = None, choices: KernelChoices | None = None) -> str:
    """The backend that runs for `backend` (None: the `choices`' `logprob_backend`; None choices: the
    defaults for jax's backend), "auto" resolved by `KernelChoices.resolve` ("pallas" on TPU, "xla"
    elsewhere); other names are checked and returned."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return overridden(choices, logprob_backend=backend).logprob_backend


def check_inputs(hidden, weight, labels, temperature) -> float:
    """Raise a one-line ValueError naming the bad argument; return the temperature as a float."""
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be [T, D], got shape {tuple(hidden.shape)}")
    if weight.ndim != 2:
        raise ValueError(f"weight must be [D, V], got shape {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[0]:
        raise ValueError(
            f"hidden [T, D] = {tuple(hidden.shape)} and weight [D, V] = {tuple(weight.shape)} disagree on D"
        )
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must be [T] = ({hidden.shape[0]},), got shape {tuple(labels.shape)}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    if isinstance(temperature, jax.core.Tracer):
        raise ValueError("temperature must be a Python number (it is a static argument), got a traced value")
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def token_stats(
    hidden: jax.Array,  # [T, D]
    weight: jax.Array,  # [D, V]
    labels: jax.Array,  # [T] int
    *,
    temperature: float = 1.0,
    backend: str | None = None,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (lse, entropy, label_logit), 3 x [T] float32
    """The differentiable core (see reference.py): per-token logsumexp, entropy and label logit, by
    `backend` (None: the `choices`' `logprob_backend`; None choices: the defaults for jax's backend,
    whose platform also sets the blocks)."""
    t = check_inputs(hidden, weight, labels, temperature)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    choices = overridden(choices, logprob_backend=backend)
    return IMPLEMENTATIONS[choices.logprob_backend](hidden, weight, labels, t, choices=choices)


def log_probs_from_stats(
    lse: jax.Array, label_logit: jax.Array, labels: jax.Array
) -> jax.Array:  # [T] float32
    """log p(label) = z[label] - lse; 0 (and no gradient) where the label is < 0."""
    return jnp.where(labels >= 0, label_logit - lse, 0.0)


def linear_logprob_entropy(
    hidden: jax.Array,  # [T, D]
    weight: jax.Array,  # [D, V]
    labels: jax.Array,  # [T] int, < 0 = ignored
    *,
    temperature: float = 1.0,
    backend: str | None = None,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array]:  # (log_probs [T] float32, entropy [T] float32)
    """Per-token log p(label) and entropy of softmax(hidden @ weight / temperature), never forming [T, V].

    Labels < 0 are ignored: log-prob 0 and no gradient; their entropy is still computed. Labels must be
    < V. Differentiable in hidden and weight (custom VJP recomputing logits tile by tile). backend:
    "auto" (pallas on TPU, xla elsewhere), "pallas", "xla", "pallas_xla" (the Pallas forward with the
    XLA backward) or "reference" (full logits, for tests); None: the `choices`' `logprob_backend`
    ("auto" by default; None choices: the defaults for jax's backend, whose platform also sets the blocks).
    """
    lse, entropy, label_logit = token_stats(
        hidden, weight, labels, temperature=temperature, backend=backend, choices=choices
    )
    return log_probs_from_stats(lse, label_logit, labels), entropy
