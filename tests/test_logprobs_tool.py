"""scripts/logprobs.py end to end: output format and values, meshes, packing, and bad input."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.hf.export import export_hf
from qwen35_jax.model import Qwen35ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import logprobs  # noqa: E402

CONFIG = Qwen35Config.preset("tiny", num_attention_heads=8, linear_num_value_heads=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Qwen35ForCausalLM]:
    model = Qwen35ForCausalLM(CONFIG, rngs=nnx.Rngs(7))
    path = tmp_path_factory.mktemp("ckpt") / "hf"
    export_hf(nnx.state(model, nnx.Param), CONFIG, str(path))
    return path, model


def expected(model, tokens, segments, temperature):
    hidden = model(jnp.asarray(tokens), segment_ids=jnp.asarray(segments))
    logp = np.asarray(jax.nn.log_softmax(model.logits(hidden) / temperature, axis=-1), np.float64)
    lp = np.zeros(tokens.shape)
    same = (segments[:, :-1] == segments[:, 1:]) & (segments[:, :-1] > 0)
    lp[:, :-1] = np.where(same, np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0], 0)
    ent = np.where(segments > 0, -(np.exp(logp) * logp).sum(-1), 0)
    return lp, ent


@pytest.mark.parametrize("mesh", [None, "fsdp=2,sp=4", "fsdp=1,sp=8"])
def test_scores_equal_full_logits(checkpoint, tmp_path, mesh):
    path, model = checkpoint
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, size=(3, 21)).astype(np.int64)  # 3 % 2 and 21 % 4 != 0
    segments = np.ones_like(tokens)
    segments[0, 10:] = 2
    segments[2, 15:] = 0
    np.save(tmp_path / "tokens.npy", tokens)
    np.save(tmp_path / "seg.npy", segments)
    args = ["--model", str(path), "--tokens", str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "out.npz"),
            "--temperature", "1.5", "--segment-ids", str(tmp_path / "seg.npy")]
    assert logprobs.main(args + (["--mesh", mesh] if mesh else [])) == 0
    out = np.load(tmp_path / "out.npz")
    assert set(out.files) == {"log_probs", "entropy"}
    assert out["log_probs"].dtype == np.float32 and out["log_probs"].shape == tokens.shape
    want_lp, want_ent = expected(model, tokens, segments, 1.5)
    np.testing.assert_allclose(out["log_probs"], want_lp, atol=1e-5)
    np.testing.assert_allclose(out["entropy"], want_ent, atol=1e-5)


def test_without_segment_ids_only_the_last_position_is_zero(checkpoint, tmp_path):
    path, model = checkpoint
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, size=(2, 9))
    np.save(tmp_path / "t.npy", tokens)
    assert logprobs.main(["--model", str(path), "--tokens", str(tmp_path / "t.npy"),
                          "--out", str(tmp_path / "o.npz"), "--batch-size", "1"]) == 0
    out = np.load(tmp_path / "o.npz")
    want_lp, want_ent = expected(model, tokens, np.ones_like(tokens), 1.0)
    np.testing.assert_allclose(out["log_probs"], want_lp, atol=1e-5)
    assert (out["log_probs"][:, -1] == 0).all() and (out["log_probs"][:, :-1] < 0).all()


@pytest.mark.parametrize("array, message", [
    (np.ones((2, 4), np.float32), "must be integers, got dtype float32"),
    (np.ones(4, np.int32), "must be 2-D"),
    (np.array([[1, 2, 999]]), r"token id 999 at \(0, 2\) is outside \[0, 256\)"),
    (np.array([[1, -3, 2]]), r"token id -3 at \(0, 1\) is outside"),
])
def test_bad_tokens_fail_in_one_line_and_write_nothing(checkpoint, tmp_path, capsys, array, message):
    np.save(tmp_path / "bad.npy", array)
    out = tmp_path / "out.npz"
    code = logprobs.main(["--model", str(checkpoint[0]), "--tokens", str(tmp_path / "bad.npy"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code != 0 and not out.exists() and not list(tmp_path.glob(".out.npz*"))
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert __import__("re").search(message, err), err


def test_bad_segment_ids_and_options(checkpoint, tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.ones((2, 4), np.int32))
    np.save(tmp_path / "s.npy", np.ones((2, 5), np.int32))
    base = ["--model", str(checkpoint[0]), "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "o.npz")]
    assert logprobs.main(base + ["--segment-ids", str(tmp_path / "s.npy")]) == 2
    assert "segment ids" in capsys.readouterr().err
    assert logprobs.main(base + ["--temperature", "0"]) == 2
    assert "--temperature must be > 0" in capsys.readouterr().err
    assert logprobs.main(base + ["--mesh", "fsdp=3,sp=1"]) == 2
    assert "valid layouts" in capsys.readouterr().err
    assert logprobs.main(base[:1] + [str(tmp_path / "missing")] + base[2:]) == 2
    assert "missing" in capsys.readouterr().err
    assert logprobs.main(base + ["--attention", "cudnn"]) == 2
    assert "attention implementation 'cudnn' needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "o.npz").exists()


def test_help():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "logprobs.py"), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--segment-ids" in result.stdout and "log_probs" in result.stdout
