"""Every bad input to import/export: one-line error naming the culprit, non-zero exit, nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from flax import nnx

from hf_testutil import edit_config, edit_tensors, load_script, make_hf, script_cmd, subprocess_env
from qwen35_jax.checkpoint import save_checkpoint
from qwen35_jax.hf import export as export_mod
from qwen35_jax.hf.export import export_hf
from qwen35_jax.hf.load import inspect_hf, load_hf

ST = "model.safetensors"
QPROJ = "model.layers.3.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_hf(str(tmp_path_factory.mktemp("base") / "hf"), "dense", "float32", num_layers=4)


@pytest.fixture
def bad(base: str, tmp_path) -> str:
    """A fresh copy of the good checkpoint to break."""
    return shutil.copytree(base, str(tmp_path / "bad"))


def run_import(hf_dir: str, out: str, capsys) -> str:
    """import_hf.py's main in-process: returns its one-line stderr after checking exit code and output."""
    rc = load_script("import_hf").main([hf_dir, out])
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert_nothing_written(out)
    return one_line(err)


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln]  # tqdm bars aside
    assert len(lines) == 1, err
    assert lines[0].startswith(("import_hf: error: ", "export_hf: error: ")), lines[0]
    return lines[0]


def assert_nothing_written(out: str) -> None:
    assert not os.path.lexists(out)
    parent = os.path.dirname(os.path.abspath(out))
    assert not [f for f in os.listdir(parent) if ".partial-" in f], os.listdir(parent)


def test_truncated_file_subprocess(bad, tmp_path):
    path = os.path.join(bad, ST)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    out = str(tmp_path / "out")
    r = subprocess.run(script_cmd("import_hf", bad, out), capture_output=True, text=True, env=subprocess_env())
    assert r.returncode != 0
    msg = one_line(r.stderr)
    assert path in msg and "truncated" in msg
    assert_nothing_written(out)


def test_corrupt_header(bad, tmp_path, capsys):
    path = os.path.join(bad, ST)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"#garbage")
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert path in msg and "corrupt" in msg


def test_header_length_past_end_of_file(bad, tmp_path, capsys):
    path = os.path.join(bad, ST)
    with open(path, "r+b") as f:
        f.write((10**12).to_bytes(8, "little"))
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert path in msg


def test_missing_tensor_subprocess(bad, tmp_path):
    edit_tensors(bad, lambda t: {k: v for k, v in t.items() if k != QPROJ})
    out = str(tmp_path / "out")
    r = subprocess.run(script_cmd("import_hf", bad, out), capture_output=True, text=True, env=subprocess_env())
    assert r.returncode != 0
    msg = one_line(r.stderr)
    assert f"missing tensor {QPROJ}" in msg and ST in msg
    assert_nothing_written(out)


@pytest.mark.parametrize("extra", ["model.layers.0.mlp.experts.0.gate_proj.weight",
                                   "model.layers.4.input_layernorm.weight", "lm_head.bias"])
def test_extra_tensor(bad, tmp_path, capsys, extra):
    edit_tensors(bad, lambda t: {**t, extra: np.zeros((4,), np.float32)})
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert f"unexpected tensor {extra}" in msg and os.path.join(bad, ST) in msg


def test_tied_checkpoint_with_lm_head_is_extra(bad, tmp_path, capsys):
    edit_config(bad, tie_word_embeddings=True)
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert "unexpected tensor lm_head.weight" in msg


def test_wrong_shape(bad, tmp_path, capsys):
    edit_tensors(bad, lambda t: {**t, QPROJ: np.zeros((64, 32), np.float32)})
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert QPROJ in msg and os.path.join(bad, ST) in msg and "[64, 32]" in msg and "[128, 32]" in msg


def test_config_disagreeing_with_tensors_is_a_shape_error(bad, tmp_path, capsys):
    edit_config(bad, intermediate_size=40)
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert "has shape" in msg and "more problems" in msg


@pytest.mark.parametrize("dtype", [np.float16, np.int32])
def test_wrong_dtype(bad, tmp_path, capsys, dtype):
    edit_tensors(bad, lambda t: {**t, QPROJ: t[QPROJ].astype(dtype)})
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert QPROJ in msg and "dtype" in msg and os.path.join(bad, ST) in msg


def test_missing_config(bad, tmp_path, capsys):
    os.remove(os.path.join(bad, "config.json"))
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert os.path.join(bad, "config.json") in msg and "not found" in msg


def test_unsupported_model_type(bad, tmp_path, capsys):
    edit_config(bad, model_type="llama")
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert "'llama'" in msg and os.path.join(bad, "config.json") in msg


def test_no_weights(bad, tmp_path, capsys):
    os.remove(os.path.join(bad, ST))
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert bad in msg and ST in msg


def test_index_names_missing_shard(bad, tmp_path, capsys):
    os.rename(os.path.join(bad, ST), os.path.join(bad, "model-00001-of-00002.safetensors"))
    with open(os.path.join(bad, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {QPROJ: "model-00002-of-00002.safetensors"}}, f)
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert "model-00002-of-00002.safetensors" in msg and "does not exist" in msg


def test_index_disagrees_with_shard(bad, tmp_path, capsys):
    shard = "model-00001-of-00001.safetensors"
    os.rename(os.path.join(bad, ST), os.path.join(bad, shard))
    with open(os.path.join(bad, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {QPROJ: shard}}, f)
    msg = run_import(bad, str(tmp_path / "out"), capsys)
    assert "is not listed in model.safetensors.index.json" in msg and shard in msg


def test_import_output_exists(base, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc = load_script("import_hf").main([base, str(out)])
    msg = one_line(capsys.readouterr().err)
    assert rc != 0 and str(out) in msg and "already exists" in msg
    assert os.listdir(out) == ["keep.txt"]


def test_export_errors(base, tmp_path, capsys):
    model, config, ckpt = load_hf(base)
    ours = str(tmp_path / "ours")
    save_checkpoint(ours, model, config, layout=ckpt.layout, hf_config=ckpt.raw_config)
    exp = load_script("export_hf")
    taken = tmp_path / "taken"
    taken.mkdir()
    assert exp.main([ours, str(taken)]) != 0
    msg = one_line(capsys.readouterr().err)
    assert str(taken) in msg and "already exists" in msg and os.listdir(taken) == []
    out = str(tmp_path / "out")
    assert exp.main([base, out]) != 0  # an HF dir is not one of our checkpoints
    msg = one_line(capsys.readouterr().err)
    assert base in msg and "not a qwen35_jax checkpoint" in msg
    assert_nothing_written(out)
    with pytest.raises(SystemExit):
        exp.main([ours, out, "--max-shard-size", "lots"])
    assert "bad size 'lots'" in capsys.readouterr().err


def test_failure_while_writing_leaves_nothing(base, tmp_path, monkeypatch):
    model, config, ckpt = load_hf(base)
    calls = {"n": 0}
    real = export_mod.write_checkpoint

    def failing(directory, tensors, **kw):
        def boom():
            raise ValueError("disk full")

        calls["n"] += 1
        return real(directory, tensors[:3] + [tensors[3].__class__(tensors[3].name, tensors[3].dtype,
                                                                      tensors[3].shape, boom)], **kw)

    monkeypatch.setattr(export_mod, "write_checkpoint", failing)
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="disk full"):
        export_hf(nnx.state(model, nnx.Param), config, out, layout=ckpt.layout)
    assert calls["n"] == 1
    assert_nothing_written(out)


def test_library_errors_are_value_errors(bad):
    edit_tensors(bad, lambda t: {k: v for k, v in t.items() if k != QPROJ})
    with pytest.raises(ValueError, match="missing tensor"):
        inspect_hf(bad)
    with pytest.raises(ValueError, match="not a directory"):
        inspect_hf(os.path.join(bad, "nope"))


def test_bad_mesh(base, tmp_path, capsys):
    rc = load_script("import_hf").main([base, str(tmp_path / "out"), "--mesh", "fsdp=3,sp=1"])
    msg = one_line(capsys.readouterr().err)
    assert rc != 0 and "fsdp=3" in msg and "valid layouts" in msg
    assert_nothing_written(str(tmp_path / "out"))


def test_export_rejects_params_that_do_not_match_the_config(base, tmp_path):
    model, config, ckpt = load_hf(base)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params["blocks"]["layers"][0]["extra_scale"] = np.zeros((1, 3), np.float32)
    with pytest.raises(ValueError, match=r"blocks\.layers\.0\.extra_scale"):
        export_hf(params, config, str(tmp_path / "out"), layout=ckpt.layout)
    del params["blocks"]["layers"][0]["extra_scale"]
    params["norm"]["weight"] = np.zeros((7,), np.float32)
    with pytest.raises(ValueError, match=r"norm\.weight has shape \[7\]"):
        export_hf(params, config, str(tmp_path / "out"), layout=ckpt.layout)
    assert_nothing_written(str(tmp_path / "out"))
