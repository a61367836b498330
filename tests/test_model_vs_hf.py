"""Our float32 Qwen3.5 logits and gradients against transformers run in float64 on tiny random models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from float64_reference import torch_float64
from model_hf_copy import build_hf, load_hf_weights, to_ours
from qwen35_jax.config import Qwen35Config
from qwen35_jax.model import Qwen35ForCausalLM

ATTN = ("full_attention",)


def _pair(config: Qwen35Config, seed: int = 0, read_as: Qwen35Config | None = None):
    """Our model and the float64 transformers one of `config`; ours is built from what from_hf reads out of
    transformers' config, which must be `read_as` (default `config`)."""
    hf, hf_config = build_hf(config, seed)
    ours_cfg = Qwen35Config.from_hf(hf_config, remat=config.remat, scan_layers=config.scan_layers)
    assert ours_cfg == (read_as or config).replace(dtype="float32", param_dtype="float32")
    model = Qwen35ForCausalLM(ours_cfg, rngs=nnx.Rngs(seed))
    load_hf_weights(model, hf)
    return model, hf


def _tokens(config, b, s, seed=0):
    return np.random.default_rng(seed).integers(0, config.vocab_size, (b, s), dtype=np.int32)


# Our float32 logits vs the float64 truth: float32 rounding through up to 8 layers, measured max 1.3e-6 (logits
# up to 3.4) on AMD EPYC; 1e-5 leaves 7x headroom, while doubling rope_theta is off by 6e-4 and
# rms_norm_eps 1e-5 instead of 1e-6 by 0.4.
LOGITS_ATOL = 1e-5


def _check_logits(config, b=2, lengths=(24,), positions=None, read_as=None):
    model, hf = _pair(config, read_as=read_as)
    for s in lengths:
        tokens = _tokens(config, b, s)
        kw = {} if positions is None else {"position_ids": torch.from_numpy(np.asarray(positions)).long()}
        ids = torch.from_numpy(tokens).long()
        with torch.no_grad(), torch_float64():
            ref = hf(input_ids=ids, **kw).logits.numpy()
        pos = None if positions is None else jnp.asarray(positions)
        ours = np.asarray(model.logits(model(jnp.asarray(tokens), positions=pos)))
        np.testing.assert_allclose(ours, ref, atol=LOGITS_ATOL, rtol=0, err_msg=f"length {s}")


HYBRID = ("linear_attention",) * 3 + ("full_attention",)


def test_float64_reference_computes_in_float64_where_transformers_pins_float32():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    norm = Qwen3_5RMSNorm(8).double()  # its forward casts to float32
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 8)))
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    with torch.no_grad():
        pinned = norm(x)
        with torch_float64():
            full = norm(x)
    assert (pinned - want).abs().max() > 1e-9 and (full - want).abs().max() < 1e-14
    narrow = np.ones(2, np.float32)
    with torch_float64(), pytest.raises(AssertionError, match="float32 inside torch_float64"):
        torch.from_numpy(narrow)


def test_dense_attention_only_matches_hf():
    _check_logits(Qwen35Config.preset("tiny", layer_types=ATTN * 4, tie_word_embeddings=False))


def test_dense_hybrid_matches_hf_at_chunk_and_off_chunk_lengths():
    cfg = Qwen35Config.preset("tiny", tie_word_embeddings=False)
    # 64 and 70 tokens: a whole number of chunks, and a partial last chunk
    assert cfg.layer_types == HYBRID and 64 % cfg.gdn_chunk(jax.default_backend()) == 0
    _check_logits(cfg, b=2, lengths=(64, 70))


def test_one_kv_head_half_rotary_matches_hf():
    cfg = Qwen35Config.preset("tiny", num_key_value_heads=1, partial_rotary_factor=0.5, mrope_section=(2, 1, 1))
    _check_logits(cfg)


def test_mrope_positions_match_hf():
    cfg = Qwen35Config.preset("tiny", num_hidden_layers=2, layer_types=ATTN * 2, head_dim=32,
                              partial_rotary_factor=0.5, mrope_section=(3, 3, 2))
    pos = np.random.default_rng(1).integers(0, 50, (3, 2, 16))
    _check_logits(cfg, b=2, lengths=(16,), positions=pos)


def test_missing_mrope_section_matches_hf_at_rotary_dim_16():
    """No mrope_section in config.json: transformers' default (11, 11, 10), whose h and w sections stop at
    rotary_dim / 2 = 8 frequencies just as transformers' slices do; text and 3-D positions both match."""
    cfg = Qwen35Config.preset("tiny", num_hidden_layers=2, layer_types=ATTN * 2, partial_rotary_factor=1.0,
                              mrope_section=None)
    assert cfg.rotary_dim == 16 and "mrope_section" not in cfg.to_hf_dict()["rope_parameters"]
    read_as = cfg.replace(mrope_section=(11, 11, 10))
    _check_logits(cfg, lengths=(16,), read_as=read_as)
    pos = np.random.default_rng(2).integers(0, 50, (3, 2, 16))
    _check_logits(cfg, lengths=(16,), positions=pos, read_as=read_as)


def test_moe_tied_hybrid_matches_hf():
    cfg = Qwen35Config.preset("tiny-moe")
    assert cfg.tie_word_embeddings and cfg.layer_types == HYBRID
    _check_logits(cfg, b=1, lengths=(64, 70))


def test_non_repeating_layer_types_unrolled_matches_hf():
    kinds = ("linear_attention", "full_attention", "full_attention")
    cfg = Qwen35Config.preset("tiny", num_hidden_layers=3, layer_types=kinds)
    assert cfg.block_period == 3 and cfg.num_blocks == 1
    _check_logits(cfg, b=2, lengths=(20,))


@pytest.mark.slow
def test_two_blocks_of_a_period_match_hf():
    cfg = Qwen35Config.preset("tiny-moe", num_hidden_layers=4, layer_types=("linear_attention", "full_attention") * 2)
    assert cfg.block_period == 2 and cfg.num_blocks == 2
    _check_logits(cfg, b=2, lengths=(20,))


def test_no_remat_same_logits():
    cfg = Qwen35Config.preset("tiny", num_hidden_layers=2, layer_types=ATTN * 2)
    a, _ = _pair(cfg)
    b, _ = _pair(cfg.replace(remat=False))
    t = jnp.asarray(_tokens(cfg, 1, 12))
    np.testing.assert_array_equal(np.asarray(a(t)), np.asarray(b(t)))


def test_packed_documents_equal_separate_runs():
    cfg = Qwen35Config.preset("tiny", layer_types=ATTN * 4)
    model, _ = _pair(cfg)
    tokens = _tokens(cfg, 1, 20)
    lens = [7, 9]
    seg = np.zeros((1, 20), np.int32)
    seg[0, :7], seg[0, 7:16] = 1, 2  # 4 padding tokens at the end
    packed = np.asarray(model(jnp.asarray(tokens), segment_ids=jnp.asarray(seg)))
    start = 0
    for n in lens:
        alone = np.asarray(model(jnp.asarray(tokens[:, start:start + n])))
        np.testing.assert_allclose(packed[:, start:start + n], alone, atol=1e-5, rtol=0)
        start += n


def _grad_errors(config, param_paths, s=16) -> dict[str, float]:
    """max |ours - float64 torch autograd| / max |torch| of d(sum(logits * R)) / d(param), per HF tensor."""
    model, hf = _pair(config)
    tokens = _tokens(config, 2, s)
    r = np.random.default_rng(3).standard_normal((2, s, config.vocab_size)).astype(np.float32)

    ids, r64 = torch.from_numpy(tokens).long(), torch.from_numpy(r.astype(np.float64))
    with torch_float64():
        (hf(input_ids=ids).logits * r64).sum().backward()
    hf_grads = {n: p.grad.numpy() for n, p in hf.named_parameters()}

    def loss(m):
        return jnp.sum(m.logits(m(jnp.asarray(tokens))) * r)

    grads = nnx.to_flat_state(nnx.grad(loss)(model))
    grads = {path: np.asarray(v.get_value()) for path, v in grads}
    errors = {}
    for path, hf_name in param_paths:
        ref = to_ours(path, hf_grads[hf_name])
        ours = grads[path]
        if path[0] == "blocks":
            ours = ours[int(hf_name.split(".")[2]) // config.block_period]
        assert ours.shape == ref.shape and np.abs(ref).max() > 0, hf_name
        errors[hf_name] = float(np.abs(ours - ref).max() / np.abs(ref).max())
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_gradients_match_torch(scan_layers):
    cfg = Qwen35Config.preset("tiny-moe", layer_types=("linear_attention", "full_attention") * 2,
                              tie_word_embeddings=False, scan_layers=scan_layers)
    errors = _grad_errors(cfg, [
        (("embed_tokens", "embedding"), "model.embed_tokens.weight"),
        (("lm_head", "kernel"), "lm_head.weight"),
        (("blocks", "layers", 1, "self_attn", "q_proj", "kernel"), "model.layers.3.self_attn.q_proj.weight"),
        (("blocks", "layers", 0, "linear_attn", "A_log"), "model.layers.0.linear_attn.A_log"),
        (("blocks", "layers", 0, "linear_attn", "in_proj_qkv", "kernel"), "model.layers.2.linear_attn.in_proj_qkv.weight"),
        (("blocks", "layers", 0, "mlp", "experts", "gate_up_proj"), "model.layers.0.mlp.experts.gate_up_proj"),
        (("blocks", "layers", 1, "mlp", "experts", "down_proj"), "model.layers.3.mlp.experts.down_proj"),
        (("blocks", "layers", 0, "mlp", "gate", "kernel"), "model.layers.2.mlp.gate.weight"),
    ])
    # Our float32 gradients vs float64 autograd, relative to each tensor's largest entry: float32 rounding
    # through 4 layers forward and back, measured max 2.3e-6 (A_log; the others <= 1e-6) on AMD EPYC;
    # 2e-5 leaves 8x headroom.
    assert max(errors.values()) < 2e-5, errors


def test_long_sequence_query_blocked_attention_matches_hf():
    """Past 1024 tokens attention runs in query blocks; still transformers' logits."""
    cfg = Qwen35Config.preset("tiny", num_hidden_layers=1, layer_types=ATTN)
    _check_logits(cfg, b=1, lengths=(1030,))
