"""Online GRPO end to end on a tiny model: metrics, the reward rising, exact resume, the sampler's and
the trainer's log-probs agreeing, reward errors; and one GRPO update's loss and lm_head gradient
against NumPy float64."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qwen35_jax.checkpoint import load_checkpoint, save_checkpoint
from qwen35_jax.config import Qwen35Config
from qwen35_jax.generation.prompts import PromptEncoder
from qwen35_jax.loss_aggregation import loss_weights
from qwen35_jax.model import Qwen35ForCausalLM
from qwen35_jax.demos.grpo import task_rows
from qwen35_jax.objectives import train
from qwen35_jax.parallel.mesh import make_mesh
from qwen35_jax.rl.online import OnlineGRPO, step_seed
from qwen35_jax.rl.rollout import RolloutOptions, row_length, sample_rollouts
from qwen35_jax.run_layout import KL_REFERENCE_FILE
from qwen35_jax.scoring import score_batches
from qwen35_jax.train.loop import prepare
from qwen35_jax.train.options import TrainOptions
from qwen35_jax.train.step import StepOptions, _micro_sums, loss_mask_of

LOW_IDS = "def low_ids(sample):\n    ids = sample['completion_ids']\n    return sum(t < 64 for t in ids) / len(ids)\n"


def _files(tmp_path, n=64):
    rows = task_rows(n, seed=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = tmp_path / "low_ids.py"
    reward.write_text(LOW_IDS)
    return str(prompts), f"{reward}:low_ids"


def _options(tmp_path, out, **changes):
    prompts, reward = _files(tmp_path)
    base = dict(preset="tiny", objective="grpo", data=[prompts], reward=reward, group_size=4, batch_size=16,
                max_new_tokens=4, temperature=1.0, lr=3e-2, final_lr_ratio=1.0, steps=4, save_every=2, out=str(tmp_path / out),
                mesh="fsdp=2,sp=4", progress=False, seed=3)
    return TrainOptions(**{**base, **changes})


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# the loss options on (sequence-level ratios, per-completion weights, the dual clip, rollout IS): the
# path they take through the step (a loss_weights field, the sequence mean over sp shards) resumes
# exactly too
LOSS_OPTIONS = dict(policy_loss="gspo", loss_agg="seq-mean-token-mean", clip_ratio_c=3.0, rollout_is="token")


@pytest.mark.slow
def test_grpo_runs_logs_its_metrics_resumes_exactly_and_learns(tmp_path):
    assert train(_options(tmp_path, "full", steps=6, eval_data=[_files(tmp_path)[0]], eval_every=3,
                          **LOSS_OPTIONS)) == 0
    rows = [r for r in _metrics(tmp_path / "full") if "loss" in r]
    for key in ("reward_mean", "reward_std", "frac_reward_zero_std", "response_length_mean", "truncated_fraction", "entropy",
                "clip_fraction", "logprob_mismatch", "rollout_seconds", "update_seconds", "rollout_tokens_per_sec",
                "update_tokens_per_sec"):
        assert all(r[key] is not None for r in rows), key
    assert [r["step"] for r in rows] == list(range(1, 7))
    # the sampler (decode step, float32) and the trainer's fused kernel see the same policy: rounding only
    assert max(r["logprob_mismatch"] for r in rows) < 1e-4 and max(r["logprob_mismatch_max"] for r in rows) < 1e-3
    # float32 sampler and trainer agree, so the rollout IS weights are 1 and none is truncated
    assert all(abs(r["rollout_is_weight"] - 1) < 1e-4 and r["rollout_is_truncated"] == 0 for r in rows)
    # a reward a random tiny model can raise in a few steps: the share of ids below 64 (of 256) it samples
    assert np.mean([r["reward_mean"] for r in rows[-2:]]) > np.mean([r["reward_mean"] for r in rows[:2]]) + 0.2
    assert (tmp_path / "full" / "reward.png").is_file()
    assert any(r.get("eval_reward") is not None for r in _metrics(tmp_path / "full"))
    # the run as if stopped after step 4 (its checkpoint), resumed to 6: the same rewards and losses
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "6")
    assert train(_options(tmp_path, "resumed", steps=6, eval_data=[_files(tmp_path)[0]], eval_every=3,
                          **LOSS_OPTIONS)) == 0
    again = [r for r in _metrics(tmp_path / "resumed") if "loss" in r]
    assert [r["step"] for r in again] == list(range(1, 7))  # steps 5-6 replace the ones after the checkpoint
    for a, b in zip(again[4:], rows[4:], strict=True):
        np.testing.assert_allclose([a["reward_mean"], a["loss"]], [b["reward_mean"], b["loss"]], rtol=1e-5, atol=1e-7)


def test_a_reward_that_raises_stops_the_run_naming_function_and_row(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def reward(sample):\n    return sample['answer']\n")
    with pytest.raises(ValueError, match=rf"^reward {bad}:reward failed on .*prompts.jsonl row \d+ \(sample \d\): "
                                         r"KeyError: 'answer'$"):
        train(_options(tmp_path, "bad", reward=f"{bad}:reward", steps=1))
    assert not (tmp_path / "bad" / "checkpoints" / "1").exists()


@pytest.mark.parametrize("changes,message", [
    ({"batch_size": 10}, "--batch-size 10 counts completions: it must be a multiple of --group-size 4"),
    ({"reward": "nowhere.py:f"}, "file nowhere.py not found"),
    ({"stop_token_ids": "3,x"}, "--stop-token-ids must be comma-separated integers"),
    # a group of one has advantage 0 under grpo and drgrpo: refused rather than logging rewards that train nothing
    ({"group_size": 1}, r"^--group-size 1: --advantage grpo compares the completions of one prompt, .* use "
                        r"--group-size 2 or more$"),
    ({"group_size": 1, "advantage": "drgrpo"}, "^--group-size 1: --advantage drgrpo compares"),
    ({"clip_ratio_c": 1.0}, r"^--clip-ratio-c must be > 1, got 1.0$"),
    ({"loss_agg": "seq-mean"}, r"^--loss-agg must be one of token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"),
    ({"objective": "sft", "loss_agg": "seq-mean-token-mean"}, r"^--loss-agg seq-mean-token-mean applies to "
                                                               r"--objective grpo only$"),
    ({"objective": "sft", "policy_loss": "gspo"}, r"^--policy-loss gspo applies to --objective grpo only$"),
    ({"objective": "sft", "rollout_is": "token"}, r"^--rollout-is token applies to --objective grpo only$"),
    ({"rollout_is_threshold": 0.0}, r"^--rollout-is-threshold must be > 0, got 0.0$"),
])
def test_bad_grpo_options_are_one_line(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        train(_options(tmp_path, "x", **changes))


def test_the_training_loop_alone_does_not_know_online_grpo(tmp_path):
    # train/ implements sft and ppo; online GRPO is an objective it is given (qwen35_jax.objectives)
    from qwen35_jax.train.loop import train as train_with
    with pytest.raises(ValueError, match=r"^--objective grpo is not one the trainer implements itself: pass its "
                                         r"Objective \(qwen35_jax.objectives.objective_for"):
        train_with(_options(tmp_path, "x"))
    assert not (tmp_path / "x").exists()


def _leaves(params) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_the_kl_reference_is_fixed_when_the_run_starts(tmp_path):
    """--model is resumable and a run directory resolves to its newest checkpoint: the reference is the
    checkpoint recorded at the start, kept when that run trains further, and another --model is refused."""
    config = Qwen35Config.preset("tiny")
    sft = tmp_path / "sft"  # a run directory: --model resolves to its newest checkpoint
    (sft / "checkpoints").mkdir(parents=True)
    save_checkpoint(str(sft / "checkpoints" / "1"), Qwen35ForCausalLM(config, rngs=nnx.Rngs(1)), config)
    options = _options(tmp_path, "rl", preset=None, model=str(sft), kl_coef=0.1, stop_token_ids="3", steps=1,
                       save_every=1)
    assert train(options) == 0
    recorded = json.loads((tmp_path / "rl" / KL_REFERENCE_FILE).read_text())
    assert recorded == {"model": str(sft), "checkpoint": str(sft / "checkpoints" / "1")}

    save_checkpoint(str(sft / "checkpoints" / "2"), Qwen35ForCausalLM(config, rngs=nnx.Rngs(2)), config)
    run = prepare(dataclasses.replace(options, steps=2), OnlineGRPO())  # the SFT run has trained further
    run.checkpoints.close()
    mesh = run.mesh
    first = nnx.state(load_checkpoint(str(sft / "checkpoints" / "1"), mesh=mesh)[0], nnx.Param)
    for got, want in zip(_leaves(run.objective.ref_params), _leaves(nnx.to_pure_dict(first)), strict=True):
        np.testing.assert_array_equal(got, want)

    other = tmp_path / "other"
    save_checkpoint(str(other), Qwen35ForCausalLM(config, rngs=nnx.Rngs(3)), config)
    with pytest.raises(ValueError, match=rf"^--model {other}: this run's KL reference is {sft}/checkpoints/1 "
                                         rf"\(its starting point, .*{KL_REFERENCE_FILE}\); resume with --model {sft} "
                                         "or start a new --out$"):
        prepare(dataclasses.replace(options, model=str(other), steps=2), OnlineGRPO())
    assert f"model: {sft}\n" in (tmp_path / "rl" / "config.yaml").read_text()  # refused before it was rewritten


# (StepOptions changes, loss aggregation) of each update form checked against NumPy
UPDATE_VARIANTS = [
    (dict(), "token-mean"),
    (dict(loss_agg="seq-mean-token-mean"), "seq-mean-token-mean"),
    (dict(loss_agg="seq-mean-token-sum-norm"), "seq-mean-token-sum-norm"),
    (dict(dual_clip=1.5), "token-mean"),  # low enough that some negative-advantage tokens are capped
    (dict(sequence_ratio=True, loss_agg="seq-mean-token-mean"), "seq-mean-token-mean"),  # GSPO as verl runs it
    (dict(on_policy=True), "token-mean"),  # one update per rollout: old = the step's own log-probs, ratio 1
    (dict(rollout_is="token", rollout_is_threshold=1.5), "token-mean"),  # truncated trainer/sampler weights
    (dict(rollout_is="sequence", rollout_is_threshold=1.5), "token-mean"),
]


def _numpy_update(lp, old, a, m, variant: dict, aggregation: str, max_new_tokens: int, sampler=None,
                  clip=(0.2, 0.28)):
    """NumPy float64 (loss, d loss / d log p(label) [N, S]) of one update form (see UPDATE_VARIANTS)."""
    if variant.get("on_policy"):
        old = lp
    if variant.get("sequence_ratio"):  # GSPO: each row's mean log-ratio; a token's ratio gradient is s_i
        mean = ((lp - old) * m).sum(-1, keepdims=True) / np.maximum(m.sum(-1, keepdims=True), 1)
        ratio = np.exp(mean) * np.ones_like(lp)
    else:
        ratio = np.exp(lp - old)
    unclipped, clipped = -a * ratio, -a * np.clip(ratio, 1 - clip[0], 1 + clip[1])
    per_token = np.maximum(unclipped, clipped)
    d_ratio = np.where(unclipped >= clipped, -a, 0.0)
    if variant.get("dual_clip"):
        capped = (a < 0) & (per_token > -a * variant["dual_clip"])
        assert capped[m > 0].any()  # the dual clip bites somewhere
        per_token = np.where(capped, -a * variant["dual_clip"], per_token)
        d_ratio = np.where(capped, 0.0, d_ratio)
    if variant.get("rollout_is"):  # weights of the trainer's old log-probs against the sampler's, truncated
        log_w = (old - sampler) * m
        if variant["rollout_is"] == "sequence":
            log_w = np.repeat(log_w.sum(-1, keepdims=True), m.shape[1], axis=1)
        is_w = np.minimum(np.exp(log_w), variant["rollout_is_threshold"])
        assert ((np.exp(log_w) > variant["rollout_is_threshold"]) & (m > 0)).any()  # truncation bites
        per_token, d_ratio = per_token * is_w, d_ratio * is_w
    rows = m.shape[0]
    weights = {"token-mean": m / m.sum(),
               "seq-mean-token-mean": m / (np.maximum(m.sum(-1, keepdims=True), 1) * rows),
               "seq-mean-token-sum-norm": m / (max_new_tokens * rows)}[aggregation]
    return (per_token * weights).sum(), d_ratio * ratio * weights


def test_grpo_update_loss_and_lm_head_gradient_match_numpy_float64():
    """One update's loss and lm_head gradient against NumPy float64 for every aggregation, the dual
    clip and GSPO: the loss computed from the model's final hidden states in float64."""
    config = Qwen35Config.preset("tiny", tie_word_embeddings=False)
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(4))
    rows = task_rows(3, seed=5)
    for i, r in enumerate(rows):
        r["_source"] = f"row {i}"
    prompts = [r["prompt_ids"] for r in rows]
    options = RolloutOptions(group_size=4, max_new_tokens=5, temperature=0.9, advantage="grpo", stop_token_ids=(3,))
    rollout = sample_rollouts(model, rows, prompts, [0, 1, 2], options=options, seed=step_seed(0, 1), mesh=None,
                              reward=(lambda s: float(sum(s["completion_ids"]) % 5), "sum"),
                              encoder=PromptEncoder(None, config.vocab_size), seq_len=row_length(prompts, 5))
    batch = dict(rollout.batch)
    old, _ = score_batches(model, batch["tokens"], batch["segment_ids"], mesh=make_mesh((1, 1), jax.devices()[:1]),
                           temperature=0.9)
    np.testing.assert_allclose(old[batch["loss_mask"] == 1], rollout.sampler_log_probs[batch["loss_mask"] == 1],
                               atol=1e-5)  # what the online step records as logprob_mismatch
    old = old + np.random.default_rng(0).normal(0, 0.3, old.shape).astype(np.float32)  # ratios off 1: clipping
    batch["old_log_probs"] = old
    for row, cut in ((0, 2), (1, 4), (5, 1)):  # completions of several lengths, so the aggregations differ
        batch["loss_mask"][row, np.flatnonzero(batch["loss_mask"][row])[-cut:]] = 0
    graphdef, params = nnx.split(model)

    # NumPy float64 from the final hidden states: logits = H W / T
    micro = {k: jnp.asarray(v) for k, v in batch.items()}
    mask = loss_mask_of(micro["tokens"], micro["segment_ids"], micro["loss_mask"])
    h = np.asarray(model(micro["tokens"], segment_ids=micro["segment_ids"]), np.float64)  # [N, S, D]
    w = np.asarray(model.lm_head.kernel[...], np.float64)
    z = h @ w / 0.9
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    labels = np.concatenate([batch["tokens"][:, 1:], np.zeros_like(batch["tokens"][:, :1])], axis=1)
    lp = np.log(np.take_along_axis(p, labels[..., None], -1)[..., 0])
    m = np.asarray(mask, np.float64)
    a = batch["advantages"].astype(np.float64)[:, None]
    onehot = np.zeros_like(p)
    np.put_along_axis(onehot, labels[..., None], 1.0, -1)
    losses = set()
    for variant, aggregation in UPDATE_VARIANTS:
        step = StepOptions(objective="ppo", temperature=0.9, clip_low=0.2, clip_high=0.28, **variant)
        fed = {k: v for k, v in micro.items() if not (variant.get("on_policy") and k == "old_log_probs")}
        if variant.get("rollout_is"):
            fed["sampler_log_probs"] = jnp.asarray(rollout.sampler_log_probs)
        if aggregation != "token-mean":
            fed["loss_weights"] = jnp.asarray(loss_weights(batch["loss_mask"], aggregation, completions=len(rows) * 4,
                                                           max_new_tokens=5))
        (loss, _), grads = jax.value_and_grad(lambda q: _micro_sums(step, graphdef, q, fed, mask, jnp.sum(mask)),
                                              has_aux=True)(params)
        want_loss, d_lp = _numpy_update(lp, old, a, m, variant, aggregation, max_new_tokens=5,
                                        sampler=rollout.sampler_log_probs.astype(np.float64))
        d_w = np.einsum("nsd,nsv->dv", h, d_lp[..., None] * (onehot - p) / 0.9)
        # float32 log-probs and products over 256 vocab x 64 hidden; measured errors near 1e-7 of the scales
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-7, err_msg=str(variant))
        got = np.asarray(grads["lm_head"]["kernel"][...])
        np.testing.assert_allclose(got, d_w, atol=1e-5 * np.abs(d_w).max(), err_msg=str(variant))
        losses.add(round(float(loss), 6))
    assert len(losses) == len(UPDATE_VARIANTS)  # each form is another number on this batch
