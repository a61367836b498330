"""Fused linear -> log-softmax -> (label log-prob, entropy) without a [T, V] logits array."""

from .api import BACKENDS, linear_logprob_entropy, resolve_backend, token_stats
from .sharded import MODES, sharded_linear_logprob_entropy

__all__ = [
    "BACKENDS",
    "MODES",
    "linear_logprob_entropy",
    "resolve_backend",
    "sharded_linear_logprob_entropy",
    "token_stats",
]
