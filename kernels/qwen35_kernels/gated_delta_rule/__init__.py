"""The gated delta rule: chunked (XLA, Pallas GPU) and per-token, in FLA's call convention (`api.py`)."""

from .api import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .chunked import chunked_gated_delta_rule
from .reference import document_index, recurrent_gated_delta_rule

__all__ = [
    "chunk_gated_delta_rule",
    "chunked_gated_delta_rule",
    "document_index",
    "fused_recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule",
]
