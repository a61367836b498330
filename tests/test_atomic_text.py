"""Config and metrics files are replaced in one rename: a failed write leaves the old file and no temporary."""

import os

import pytest

from qwen35_jax.train.atomic_text import write_text_atomically


def test_write_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "config.yaml"
    write_text_atomically(str(path), "a: 1\n")
    write_text_atomically(str(path), "a: 2\n")
    assert path.read_text() == "a: 2\n"
    assert os.listdir(tmp_path) == ["config.yaml"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    with pytest.raises(TypeError):
        write_text_atomically(str(path), b"not text")  # type: ignore[arg-type]
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
