"""Training: the optimizer, the jitted SFT/PPO train step and the batch source (scripts/train.py)."""

from qwen35_jax.train.data import BatchSource, check_batch_size, load_npy_dir, synthetic_data
from qwen35_jax.train.step import OBJECTIVES, create_optimizer, make_optimizer, make_schedule, make_train_step

__all__ = ["OBJECTIVES", "BatchSource", "check_batch_size", "create_optimizer", "load_npy_dir", "make_optimizer",
           "make_schedule", "make_train_step", "synthetic_data"]
