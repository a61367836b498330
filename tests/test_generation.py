"""Generation: prefill + per-token decode against the full forward pass, against transformers in
float64, across batches and meshes, and its input checks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from float64_reference import torch_float64
from model_hf_copy import build_hf, load_hf_weights
from qwen35_jax.config import Qwen35Config, hybrid_layer_types
from qwen35_jax.generation import cache_bytes, generate
from qwen35_jax.generation.forward import decode_step, prefill
from qwen35_jax.model import Qwen35ForCausalLM, with_config
from qwen35_jax.parallel.mesh import shard_model

PROMPT_LENGTHS = (1, 3, 4, 63, 64, 65)  # around the conv window (Kc - 1 = 3) and the GDN chunk (64)
STEPS = 4


def config(moe: bool, scan: bool, blocks: int = 2) -> Qwen35Config:
    """`blocks` blocks of 3 GDN + 1 attention layer, GDN chunk 64, 8 value heads and 4 query heads."""
    return Qwen35Config.preset("tiny-moe" if moe else "tiny", vocab_size=96, hidden_size=32,
                               num_hidden_layers=4 * blocks, layer_types=hybrid_layer_types(4 * blocks, 4),
                               num_attention_heads=4, head_dim=8, linear_num_value_heads=8, linear_key_head_dim=8,
                               linear_value_head_dim=8, gdn_chunk_size=64, scan_layers=scan)


def _prompts(rng, lengths, vocab):
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


# Decode vs the full forward: the per-token recurrence against the chunked form and one query against
# blocked attention, both float32; measured max 1.5e-6 on logits of size ~1. 1e-5 is the bound.
# tiled: prompts longer than the GDN sequence tile run tile by tile, the state carried across tiles
@pytest.mark.parametrize("moe,scan,tile", [(False, True, None), (False, False, None), (True, True, None),
                                           (True, False, None), (False, True, 64)])
def test_decode_logits_equal_the_full_forward(moe, scan, tile):
    cfg = config(moe, scan)
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    b, s = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)
    full = rng.integers(0, cfg.vocab_size, size=(b, s + STEPS)).astype(np.int32)
    lengths = np.array(PROMPT_LENGTHS, np.int32)
    prompts = np.where(np.arange(s)[None] < lengths[:, None], full[:, :s], 0)
    rows = np.arange(b)
    cont = np.stack([full[rows, lengths + t] for t in range(STEPS)], axis=1)  # [B, STEPS] teacher-forced

    @nnx.jit
    def steps(model, prompts, lengths, cont):  # the decode steps in a scan: one compiled step
        hidden, cache = prefill(model, prompts, lengths, s + STEPS)
        graphdef, state = nnx.split(model)

        def one(cache, token):
            hidden, cache = decode_step(nnx.merge(graphdef, state), token, cache, jnp.ones((b,), bool))
            return cache, nnx.merge(graphdef, state).logits(hidden)

        _, later = jax.lax.scan(one, cache, cont.T)  # [STEPS, B, V]
        return jnp.concatenate([model.logits(hidden)[:, None], jnp.moveaxis(later, 0, 1)], axis=1)

    tiled = with_config(model, cfg.replace(kernels=cfg.kernels.replace(sequence_tile=tile)))
    got = np.asarray(steps(tiled, jnp.asarray(prompts), jnp.asarray(lengths), jnp.asarray(cont)))
    seq = np.where(np.arange(s + STEPS)[None] < (lengths + STEPS)[:, None], full, 0)
    seg = (np.arange(s + STEPS)[None] < (lengths + STEPS)[:, None]).astype(np.int32)
    want_all = np.asarray(nnx.jit(lambda m, t, g: m.logits(m(t, segment_ids=g)))(model, jnp.asarray(seq),
                                                                                 jnp.asarray(seg)))
    want = np.stack([want_all[rows, lengths - 1 + t] for t in range(STEPS + 1)], axis=1)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_cache_bytes_are_the_prefilled_cache():
    cfg = config(False, True)
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    _, cache = nnx.jit(lambda m, t, n: prefill(m, t, n, 24))(model, jnp.zeros((3, 16), jnp.int32),
                                                            jnp.full((3,), 5, jnp.int32))
    size = cache_bytes(cfg, 3, 24)
    arrays = sum(x.nbytes for layer in cache.layers for x in layer)
    assert size["total"] == arrays
    assert cache_bytes(cfg, 3, 48)["gdn"] == size["gdn"]  # constant in the length
    assert cache_bytes(cfg, 3, 48)["attention"] == 2 * size["attention"]
    half = cache_bytes(cfg.replace(dtype="bfloat16"), 3, 24)  # the state stays float32
    assert half["attention"] * 2 == size["attention"] and half["gdn"] > size["gdn"] // 2


def _hf_pair():
    cfg = Qwen35Config.preset("tiny", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                              num_attention_heads=4, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                              partial_rotary_factor=0.5, mrope_section=(1, 1, 2), tie_word_embeddings=False)
    hf, hf_config = build_hf(cfg, seed=3)
    ours = Qwen35ForCausalLM(Qwen35Config.from_hf(hf_config), rngs=nnx.Rngs(0))
    load_hf_weights(ours, hf)
    return ours, hf


def test_greedy_tokens_are_transformers_float64_argmax():
    model, hf = _hf_pair()
    rng = np.random.default_rng(4)
    prompts = _prompts(rng, (5, 11), model.config.vocab_size)
    out = generate(model, prompts, max_new_tokens=12, temperature=0)
    for prompt, completion in zip(prompts, out):
        ids = torch.tensor([prompt + completion.completion_ids], dtype=torch.long)
        with torch.no_grad(), torch_float64():
            ref = torch.log_softmax(hf(input_ids=ids).logits[0], dim=-1).numpy()  # [S, V] float64
        at = np.arange(len(prompt) - 1, len(prompt) - 1 + len(completion.completion_ids))
        chosen = ref[at, completion.completion_ids]
        # each token is float64's argmax up to float32 rounding of near-ties
        assert np.all(chosen >= ref[at].max(axis=-1) - 1e-4)
        np.testing.assert_allclose(completion.log_probs, chosen, atol=2e-4, rtol=0)
        assert completion.finish_reason == "length"


def test_a_row_in_a_mixed_batch_equals_the_row_alone_and_any_mesh(mesh_2x4):
    cfg = config(False, True, blocks=1)
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(2))
    prompts = _prompts(np.random.default_rng(5), (7, 2, 19), cfg.vocab_size)
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=20, seed=11)
    batch = generate(model, prompts, num_samples=2, **kw)
    alone = generate(model, [prompts[2]], first_row=2, num_samples=2, **kw)
    for a, b in zip(batch[4:], alone):
        assert (a.prompt_index, a.sample, a.completion_ids) == (2, b.sample, b.completion_ids)
        np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-5)
    assert batch[4].completion_ids != batch[5].completion_ids  # the sample index changes the draws
    with jax.set_mesh(mesh_2x4):
        sharded = shard_model(Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(2)), mesh_2x4)
    for options in (dict(temperature=0), kw):
        one = generate(model, prompts, **{**kw, **options})
        mesh = generate(sharded, prompts, mesh=mesh_2x4, **{**kw, **options})
        assert [c.completion_ids for c in one] == [c.completion_ids for c in mesh]
        for a, b in zip(one, mesh):
            np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-5)


def test_a_stop_token_ends_its_row_and_no_other():
    cfg = config(False, True, blocks=1)
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(3))
    prompts = _prompts(np.random.default_rng(6), (4, 9), cfg.vocab_size)
    free = generate(model, prompts, max_new_tokens=8, temperature=1.0, seed=1)
    first, other = free[0].completion_ids, free[1].completion_ids
    stop = next(t for t in first[1:] if t not in other)  # ends row 0 after at least one token
    cut = first.index(stop) + 1
    out = generate(model, prompts, max_new_tokens=8, temperature=1.0, seed=1, stop_token_ids=[stop])
    assert out[0].completion_ids == first[:cut] and out[0].finish_reason == "stop"
    assert out[0].log_probs == free[0].log_probs[:cut]
    assert out[1].completion_ids == other and out[1].finish_reason == "length"


@pytest.mark.parametrize("prompts,kw,message", [
    ([[1, 2], []], {}, "prompt 1: must be a non-empty"),
    ([[1, 96]], {}, "prompt 0: token id 96 is outside the vocabulary"),
    ([[1] * 10], {"max_length": 12}, "prompt 0: 10 tokens + max_new_tokens 4 exceed the maximum length 12"),
    ([[1]], {"temperature": -1}, "temperature must be >= 0"),
    ([[1]], {"top_p": 0.0}, "top_p must be in (0, 1]"),
    ([[1]], {"stop_token_ids": [200]}, "stop token ids [200]"),
])
def test_bad_input_is_named(prompts, kw, message):
    model = Qwen35ForCausalLM(config(False, True, blocks=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        generate(model, prompts, max_new_tokens=4, **kw)
