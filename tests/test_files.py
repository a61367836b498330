"""Files and directories appear in one rename: a failed write leaves the old file (or nothing) and no temporary."""

import os
import stat

import numpy as np
import pytest

from qwen35_jax.files import replaced_atomically, staged_directory, write_text_atomically


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


def test_a_binary_file_through_a_file_object_gets_the_permissions_open_gives(tmp_path):
    path = tmp_path / "out.npz"
    with replaced_atomically(path, "wb") as f:
        np.savez(f, x=np.arange(3))
    assert np.load(path)["x"].tolist() == [0, 1, 2]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask
    with pytest.raises(RuntimeError), replaced_atomically(path, "wb") as f:
        f.write(b"half")
        raise RuntimeError("cut off")
    assert np.load(path)["x"].tolist() == [0, 1, 2]
    assert os.listdir(tmp_path) == ["out.npz"]


def test_a_staged_directory_appears_complete_or_not_at_all(tmp_path):
    out = tmp_path / "dataset"
    with pytest.raises(RuntimeError), staged_directory(out) as stage:
        with open(os.path.join(stage, "a.npy"), "wb") as f:
            f.write(b"x")
        raise RuntimeError("cut off")
    assert os.listdir(tmp_path) == []
    with staged_directory(out) as stage:
        assert not out.exists()
        with open(os.path.join(stage, "a.npy"), "wb") as f:
            f.write(b"x")
    assert os.listdir(tmp_path) == ["dataset"] and os.listdir(out) == ["a.npy"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~umask
