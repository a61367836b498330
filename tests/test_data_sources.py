"""JSONL lines keep their file and line number through blank lines, CRLF endings, gzip and pickling."""

import gzip
import pickle

import pytest

from qwen35_jax.data.sources import JsonlLines, find_jsonl_files


def test_lines_numbers_blank_lines_and_crlf(tmp_path):
    plain = tmp_path / "a.jsonl"
    plain.write_bytes(b'{"text": "one"}\r\n\n   \n{"text": "two"}')  # no final newline
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress(b'\n{"text": "three"}\n'))
    lines = JsonlLines([str(plain), str(packed)])
    got = [(line.where, line.text) for line in (lines[i] for i in range(len(lines)))]
    assert got == [(f"{plain}:1", b'{"text": "one"}'), (f"{plain}:3", b"   "),
                   (f"{plain}:4", b'{"text": "two"}'), (f"{packed}:2", b'{"text": "three"}')]
    copy = pickle.loads(pickle.dumps(lines))
    assert copy[3].text == b'{"text": "three"}' and lines.lines_per_file == [3, 1]


def test_find_files(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    for name in ("d/z.jsonl", "d/e/a.jsonl.gz", "d/notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert find_jsonl_files(str(tmp_path / "d")) == [str(tmp_path / "d/e/a.jsonl.gz"), str(tmp_path / "d/z.jsonl")]
    with pytest.raises(ValueError, match="not a .jsonl or .jsonl.gz file"):
        find_jsonl_files(str(tmp_path / "d/notes.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: directory holds no .jsonl"):
        find_jsonl_files(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="only blank lines"):
        JsonlLines([str(tmp_path / "d/z.jsonl")])
