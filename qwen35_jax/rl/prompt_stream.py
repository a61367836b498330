"""The prompts of an online run: every row of --data encoded once, then served a fixed number per
step in a seeded order, reshuffled each epoch. Its position (epoch, index) is saved with every
checkpoint, so a resumed run takes exactly the prompts the uninterrupted one would have.

A 'messages' row may hold image parts (`{"type": "image", "image": PATH}`, PATH relative to the JSONL's
folder) for a model with a vision tower: the encoder's image processor turns them into the prompt's
patches and grids (`RowImages`), kept with the prompt for its rollouts and its rows' updates."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from qwen35_jax.data.image_rows import RowImages
from qwen35_jax.generation.prompts import BadRow, PromptEncoder, read_prompt_rows


def load_prompts_with_images(paths: list[str], encoder: PromptEncoder
                             ) -> tuple[list[dict[str, Any]], list[list[int]], list[RowImages | None]]:
    """(rows, prompt ids, each prompt's images or None) of every JSONL file in `paths`; ValueError
    naming the file and row (and the image path of an image that cannot be used)."""
    rows, prompts, images = [], [], []
    for path in paths:
        base_dir = os.path.dirname(os.path.abspath(path))
        for number, row in enumerate(read_prompt_rows(path), 1):
            try:
                ids, row_images = encoder.encode_with_images(row, base_dir)
            except BadRow as err:
                raise ValueError(f"{path} row {number}: {err}") from None
            prompts.append(ids)
            images.append(row_images)
            rows.append({**row, "_source": f"{path} row {number}"})
    return rows, prompts, images


def load_prompts(paths: list[str], encoder: PromptEncoder) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """(rows, prompt ids) of every JSONL file in `paths`; ValueError naming the file and row."""
    rows, prompts, _ = load_prompts_with_images(paths, encoder)
    return rows, prompts


def check_prompt_images(paths: list[str]) -> None:
    """Before anything is written: a one-line ValueError naming the file, row and path of the first image
    part whose file is missing (a malformed conversation is the encoder's to report, later)."""
    from qwen35_jax.data.images import resolve_image_path
    from qwen35_jax.data.rows import check_messages

    for path in paths:
        base_dir = os.path.dirname(os.path.abspath(path))
        for number, row in enumerate(read_prompt_rows(path), 1):
            if not isinstance(row, dict) or "messages" not in row:
                continue
            try:
                images = check_messages(row["messages"])
            except BadRow:
                continue
            for image in images:
                full = resolve_image_path(image, base_dir)
                if not os.path.isfile(full):
                    raise ValueError(f"{path} row {number}: image {full}: file not found")


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
