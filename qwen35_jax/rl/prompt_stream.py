"""The prompts of an online run: every row of --data encoded once, then served a fixed number per
step in a seeded order, reshuffled each epoch. Its position (epoch, index) is saved with every
checkpoint, so a resumed run takes exactly the prompts the uninterrupted one would have."""

from __future__ import annotations

from typing import Any

import numpy as np

from qwen35_jax.generation.prompts import BadRow, PromptEncoder, read_prompt_rows


def load_prompts(paths: list[str], encoder: PromptEncoder) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """(rows, prompt ids) of every JSONL file in `paths`; ValueError naming the file and row."""
    rows, prompts = [], []
    for path in paths:
        for number, row in enumerate(read_prompt_rows(path), 1):
            try:
                prompts.append(encoder.encode(row))
            except BadRow as err:
                raise ValueError(f"{path} row {number}: {err}") from None
            rows.append({**row, "_source": f"{path} row {number}"})
    return rows, prompts


class PromptStream:
    """`next_prompts()` -> the next `per_step` indices into the rows, in a per-epoch permutation of
    `seed`; `get_state` / `set_state` for checkpoints."""

    def __init__(self, n_rows: int, per_step: int, *, seed: int, shuffle: bool = True):
        if n_rows < 1:
            raise ValueError("no prompts")
        self.n_rows, self.per_step, self.seed, self.shuffle = n_rows, per_step, seed, shuffle
        self.epoch, self.index = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_rows)
        return np.random.default_rng((self.seed, epoch)).permutation(self.n_rows)

    def next_prompts(self) -> list[int]:
        out = []
        while len(out) < self.per_step:
            if self.index == self.n_rows:
                self.epoch, self.index = self.epoch + 1, 0
            take = min(self.per_step - len(out), self.n_rows - self.index)
            out += self._order(self.epoch)[self.index:self.index + take].tolist()
            self.index += take
        return out

    @property
    def epoch_fraction(self) -> float:
        return self.epoch + self.index / self.n_rows

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
