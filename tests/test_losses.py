"""SFT and PPO/GRPO losses against hand-computed NumPy values; the fused path at model level."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qwen35_jax import losses
from qwen35_jax.config import Qwen35Config
from qwen35_jax.model import Qwen35ForCausalLM


def test_sft_token_mean_nll():
    lp = jnp.array([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = jnp.array([[1, 1, 0], [0, 1, 1]])
    loss, metrics = losses.sft_loss(lp, mask)
    assert np.isclose(loss, (1 + 2 + 5 + 6) / 4)
    assert metrics["tokens"] == 4
    grad = jax.grad(lambda x: losses.sft_loss(x, mask)[0])(lp)
    np.testing.assert_allclose(grad, -np.asarray(mask) / 4.0)


def test_sft_empty_mask_is_zero():
    loss, _ = losses.sft_loss(jnp.full((2, 3), -1.0), jnp.zeros((2, 3)))
    assert loss == 0.0


def test_ppo_hand_values():
    # Four tokens with chosen ratios: 1.5 (A>0, clipped at 1.2), 0.5 (A>0, unclipped),
    # 0.5 (A<0, clipped at 0.8), 1.1 (A<0, inside the range).
    old = jnp.zeros((1, 4))
    ratio = np.array([1.5, 0.5, 0.5, 1.1])
    lp = jnp.asarray(np.log(ratio))[None]
    adv = jnp.array([[1.0, 2.0, -1.0, -3.0]])
    mask = jnp.ones((1, 4))
    loss, m = losses.policy_loss(lp, old, adv, mask, clip_low=0.2)
    per_token = np.array([-1.2, -1.0, 0.8, 3.3])  # max(-A r, -A clip(r))
    assert np.isclose(loss, per_token.mean(), atol=1e-6)
    assert np.isclose(m["clip_fraction"], 0.5)
    assert np.isclose(m["approx_kl"], np.mean(ratio - 1 - np.log(ratio)), atol=1e-6)
    assert np.isclose(m["ppo_kl"], np.mean(-np.log(ratio)), atol=1e-6)
    assert np.isclose(m["ratio_mean"], ratio.mean(), atol=1e-6)
    # Gradient: zero where clipped, -A * r where not (d ratio / d logp = ratio).
    grad = jax.grad(lambda x: losses.policy_loss(x, old, adv, mask, clip_low=0.2)[0])(lp)
    np.testing.assert_allclose(grad[0], np.array([0.0, -2.0 * 0.5, 0.0, 3.0 * 1.1]) / 4, atol=1e-6)


def test_ppo_asymmetric_and_dual_clip():
    old = jnp.zeros((1, 3))
    ratio = np.array([1.25, 5.0, 0.7])
    lp = jnp.asarray(np.log(ratio))[None]
    adv = jnp.array([[1.0, -1.0, -1.0]])
    mask = jnp.ones((1, 3))
    # clip-higher 0.28: 1.25 stays unclipped; ratio 5 with A<0 gives 5, capped by dual clip 3.
    loss, m = losses.policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    per_token = np.array([-1.25, 3.0, 0.8])
    assert np.isclose(loss, per_token.mean(), atol=1e-6)
    assert np.isclose(m["dual_clip_fraction"], 1 / 3)
    assert np.isclose(m["clip_fraction"], 1 / 3)  # only the 0.7 token (clipped to 0.8 for A<0)


def _np_ppo(lp, old, adv, mask, eps, agg):
    r = np.exp(lp - old)
    pt = np.maximum(-adv * r, -adv * np.clip(r, 1 - eps, 1 + eps))
    if agg == "token_mean":
        return (pt * mask).sum() / mask.sum()
    seq = [(pt[b] * mask[b]).sum() / mask[b].sum() for b in range(len(pt)) if mask[b].sum() > 0]
    return np.mean(seq)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_ppo_aggregation_random(aggregation):
    rng = np.random.default_rng(0)
    lp, old = rng.normal(size=(2, 4, 7)) * 0.3 - 1.0
    adv = rng.normal(size=(4,))  # GRPO: one advantage per sequence
    mask = (rng.uniform(size=(4, 7)) < 0.6).astype(np.float32)
    mask[2] = 0  # an empty sequence is left out of seq_mean
    ent = rng.uniform(size=(4, 7))
    loss, m = losses.policy_loss(
        jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
        clip_low=0.2, aggregation=aggregation, entropy=jnp.asarray(ent), entropy_coef=0.01,
    )
    adv_t = np.broadcast_to(adv[:, None], lp.shape)
    pg = _np_ppo(lp, old, adv_t, mask, 0.2, aggregation)
    if aggregation == "token_mean":
        ent_agg = (ent * mask).sum() / mask.sum()
    else:
        ent_agg = np.mean([(ent[b] * mask[b]).sum() / mask[b].sum() for b in range(4) if mask[b].sum() > 0])
    np.testing.assert_allclose(m["policy_loss"], pg, rtol=1e-5)
    np.testing.assert_allclose(m["entropy"], ent_agg, rtol=1e-5)
    np.testing.assert_allclose(loss, pg - 0.01 * ent_agg, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_low=0.0), "clip_low and clip_high must be > 0"),
        (dict(dual_clip=1.0), "dual_clip must be > 1"),
        (dict(aggregation="sum"), "aggregation must be one of"),
    ],
)
def test_policy_loss_bad_arguments(kwargs, match):
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match=match):
        losses.policy_loss(x, x, x, x, **kwargs)


def test_policy_loss_shape_mismatch():
    with pytest.raises(ValueError, match="inputs must have one shape"):
        losses.policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.zeros((2, 3)), jnp.ones((2, 3)))


def test_model_fused_log_probs_equal_full_logits():
    config = Qwen35Config.preset("tiny")
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)
    labels = jnp.concatenate([tokens[:, 1:], jnp.full((2, 1), -1)], axis=1)
    hidden = model(tokens)  # [B, S, D]
    logits = model.logits(hidden).astype(jnp.float32)  # [B, S, V]
    logp_full = jax.nn.log_softmax(logits, axis=-1)
    want_lp = jnp.where(labels >= 0, jnp.take_along_axis(logp_full, jnp.maximum(labels, 0)[..., None], -1)[..., 0], 0)
    want_ent = -jnp.sum(jnp.exp(logp_full) * logp_full, axis=-1)
    lp, ent = losses.token_log_probs(hidden, model.lm_head_weight(), labels, backend="xla")
    np.testing.assert_allclose(lp, want_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, rtol=1e-5, atol=1e-5)




def test_kl_estimators_against_float64_numpy():
    rng = np.random.default_rng(0)
    lp = rng.uniform(-6, -0.1, size=(2, 5))
    ref = lp + rng.normal(0, 0.5, size=(2, 5))
    log_r = lp - ref  # log p / p_ref of the sampled tokens
    expected = {"k1": log_r, "k2": 0.5 * log_r**2, "k3": np.exp(-log_r) - 1 + log_r,
                "low_var_kl": np.clip(np.exp(-log_r) - 1 + log_r, -10, 10)}
    for name, want in expected.items():
        got = losses.kl_penalty(jnp.asarray(lp, jnp.float32), jnp.asarray(ref, jnp.float32), name)
        # float32 inputs: exp and differences of values ~6 carry ~1e-6 relative rounding
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
    with pytest.raises(ValueError, match="KL estimator must be one of"):
        losses.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4")


def test_policy_loss_adds_the_kl_penalty_and_needs_ref_log_probs():
    lp = jnp.log(jnp.array([[0.5, 0.25]]))
    ref = jnp.log(jnp.array([[0.25, 0.25]]))
    mask = jnp.ones((1, 2))
    base, _ = losses.policy_loss(lp, lp, jnp.array([1.0]), mask)
    with_kl, m = losses.policy_loss(lp, lp, jnp.array([1.0]), mask, ref_log_probs=ref, kl_coef=0.5,
                                    kl_estimator="k1")
    np.testing.assert_allclose(m["kl"], np.log(2) / 2, rtol=1e-6)
    np.testing.assert_allclose(with_kl - base, 0.5 * np.log(2) / 2, rtol=1e-6)
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_log_probs"):
        losses.policy_loss(lp, lp, jnp.array([1.0]), mask, kl_coef=0.1)


def test_rollout_is_weights_against_numpy():
    """Truncated importance weights of the trainer against the sampler, per token and per sequence (the
    product of a row's token ratios), 0 off the mask; `truncated` marks those cut to the threshold."""
    from qwen35_jax.losses import rollout_is_weights

    rng = np.random.default_rng(3)
    old, sampler = rng.normal(-2, 1, (3, 6)), rng.normal(-2, 1, (3, 6))
    mask = np.ones((3, 6))
    mask[0, 4:] = 0
    mask[2, :] = 0  # a row without completion tokens
    old[0, 1] = sampler[0, 1] + 1.0  # a token whose own ratio (e) is truncated
    old[1] = sampler[1] + 0.3  # tokens under the threshold (1.35), a sequence over it (e^1.8)
    old[0, [0, 2, 3]] = sampler[0, [0, 2, 3]] - 1.0  # row 0's sequence ratio e^-2 stays under it
    for level in ("token", "sequence"):
        got, truncated = rollout_is_weights(jnp.asarray(old, jnp.float32), jnp.asarray(sampler, jnp.float32),
                                            jnp.asarray(mask), level=level, threshold=2.0)
        log_w = (old - sampler) * mask
        if level == "sequence":
            log_w = np.repeat(log_w.sum(-1, keepdims=True), 6, axis=1)
        want = np.minimum(np.exp(log_w), 2.0) * mask
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)  # float32 exp of a float64 sum
        np.testing.assert_array_equal(np.asarray(truncated), (np.exp(log_w) > 2.0) & (mask > 0))
        assert np.asarray(truncated).any() and not np.asarray(truncated).all()
    with pytest.raises(ValueError, match="token or sequence"):
        rollout_is_weights(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), level="seq", threshold=2.0)
