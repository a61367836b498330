"""The gated DeltaNet's input ops: causal conv1d + SiLU within documents, L2 norm (XLA, Pallas GPU)."""

from .api import IMPLEMENTATIONS, conv_silu
from .pallas import L2_EPS, pallas_conv_silu
from .xla import causal_conv1d_silu, causal_conv1d_update, l2_normalize

__all__ = ["IMPLEMENTATIONS", "L2_EPS", "causal_conv1d_silu", "causal_conv1d_update", "conv_silu", "l2_normalize",
           "pallas_conv_silu"]
