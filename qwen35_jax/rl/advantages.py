"""Per-completion advantages from the rewards of each prompt's group of completions.

- grpo: (r - group mean) / (group std + eps), std with Bessel's correction (a group of one: std 1);
- drgrpo ("Dr. GRPO"): r - group mean, no division (no bias towards low-variance groups);
- rloo: r - mean of the group's other completions = G / (G - 1) (r - group mean); needs G >= 2.

A group whose rewards are all equal gets advantage 0 under each, never NaN. Computed in float64.
"""

from __future__ import annotations

import numpy as np

ADVANTAGES = ("grpo", "drgrpo", "rloo")
STD_EPS = 1e-6


def group_advantages(rewards: np.ndarray, method: str) -> np.ndarray:  # [P, G] -> [P, G] float64
    """Advantages of `rewards` [prompts, group size] by `method` (one of ADVANTAGES)."""
    if method not in ADVANTAGES:
        raise ValueError(f"advantage must be one of {', '.join(ADVANTAGES)}, got {method!r}")
    r = np.asarray(rewards, np.float64)
    if r.ndim != 2 or r.size == 0:
        raise ValueError(f"rewards must be [prompts, group size], got shape {r.shape}")
    g = r.shape[1]
    # a group of equal rewards is exactly 0 (its float mean may differ from them in the last bit)
    equal = r.max(axis=1, keepdims=True) == r.min(axis=1, keepdims=True)
    centred = np.where(equal, 0.0, r - r.mean(axis=1, keepdims=True))
    if method == "drgrpo":
        return centred
    if method == "rloo":
        if g < 2:
            raise ValueError("rloo needs a group size of at least 2 (each completion's baseline is the others' mean)")
        return centred * (g / (g - 1))
    std = r.std(axis=1, ddof=1, keepdims=True) if g > 1 else np.ones_like(r[:, :1])
    return centred / (std + STD_EPS)


def zero_std_fraction(rewards: np.ndarray) -> float:
    """The share of groups in `rewards` [prompts, group size] whose rewards are all equal: they get
    advantage 0 and teach nothing (TRL logs it as frac_reward_zero_std)."""
    r = np.asarray(rewards, np.float64)
    if r.ndim != 2 or r.size == 0:
        raise ValueError(f"rewards must be [prompts, group size], got shape {r.shape}")
    return float(np.mean(r.max(axis=1) == r.min(axis=1)))
