"""The train step: SFT learns, every mesh and every micro-batching gives the same update, optimizer
state follows the parameters, PPO on-policy has ratio 1, a non-finite batch changes nothing, weight
decay skips vectors, and the .npy batch stream."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.model import Qwen35ForCausalLM, with_config
from qwen35_jax.parallel.mesh import make_mesh, shard_model
from qwen35_jax.scoring import score_batches
from qwen35_jax.train import (ArrayBatches, StepOptions, check_batch_size, init_opt_state, make_optimizer,
                              make_schedule, make_train_step, place_batch, synthetic_data, trainer_step)
from qwen35_jax.train.optim import decays
from qwen35_jax.train.step import UPDATE_FORMS, update_form, update_if

# large enough that the embedding and MLP weights pass MIN_SHARDED_SIZE and are ZeRO-3 sharded
CONFIG = Qwen35Config.preset("tiny", vocab_size=512, intermediate_size=256)


@pytest.fixture(scope="module")
def base_model() -> Qwen35ForCausalLM:
    return Qwen35ForCausalLM(CONFIG, rngs=nnx.Rngs(0))


def packed_data(rng, rows=4, seq=16):
    tokens = rng.integers(0, CONFIG.vocab_size, size=(rows, seq)).astype(np.int32)
    segments = np.ones((rows, seq), np.int32)
    segments[0, 7:] = 2  # two documents
    segments[1, 12:] = 0  # padding tail
    loss_mask = np.ones((rows, seq), np.int32)
    loss_mask[2, :5] = 0  # a prompt
    return {"tokens": tokens, "segment_ids": segments, "loss_mask": loss_mask}


LR, STEPS, TEMPERATURE = 3e-3, 10, 0.7
SCHEDULE = make_schedule(LR, STEPS, warmup_steps=1)
TX = make_optimizer(SCHEDULE, weight_decay=0.01, eps=1e-6)  # one object: its identity keys the jit cache


class State:
    """Sharded params and optimizer state of `base_model` on `layout`, with a jitted step."""

    def __init__(self, base_model, layout, options=StepOptions(temperature=TEMPERATURE)):
        devices = jax.devices()[:1] if layout == "fsdp=1,sp=1" else None
        self.mesh = make_mesh(layout, devices)
        model = nnx.clone(base_model)
        nnx.update(model, jax.tree.map(jnp.copy, nnx.state(model)))  # the step donates: own buffers
        model = shard_model(model, self.mesh)
        self.graphdef = nnx.graphdef(model)
        self.params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        self.opt_state = init_opt_state(TX, self.params, self.mesh)
        shardings = jax.tree.map(lambda x: x.sharding, (self.params, self.opt_state))
        self.step_fn = make_train_step(self.graphdef, TX, options, shardings)

    def step(self, host, grad_accum=1):
        with jax.set_mesh(self.mesh):
            batch = place_batch(host, self.mesh, grad_accum, 1)
            self.params, self.opt_state, metrics = self.step_fn(self.params, self.opt_state, batch)
        return {k: float(v) for k, v in metrics.items()}

    def host_params(self):
        return jax.tree.map(np.asarray, self.params)


def batches(data, batch_size=4):
    return ArrayBatches(data, batch_size, vocab_size=CONFIG.vocab_size, fields=tuple(
        k for k in ("old_log_probs", "advantages", "ref_log_probs") if k in data))


def test_trainer_step_gives_a_library_user_the_trainers_program(base_model):
    # One call: remat "auto" chosen by compiled memory (a model jitted on its own would run "full"),
    # and the trainer's update: the trainer's step of the policy it chose, on the same model and batch,
    # gives the same losses (the same program: equal up to XLA:CPU's thread scheduling of float32 sums).
    host = batches(packed_data(np.random.default_rng(0))).next_batch()
    trainer = State(with_config(base_model, CONFIG.replace(remat="none")), "fsdp=1,sp=1")
    model = nnx.clone(base_model)
    nnx.update(model, jax.tree.map(jnp.copy, nnx.state(model)))  # the step donates: own buffers
    model = shard_model(model, trainer.mesh)
    step, params, opt_state = trainer_step(model, TX, trainer.mesh, StepOptions(temperature=TEMPERATURE))
    losses = []
    for _ in range(2):
        with jax.set_mesh(trainer.mesh):
            params, opt_state, metrics = step(params, opt_state, place_batch(host, trainer.mesh, 1, 1))
        losses.append(float(metrics["loss"]))
    assert step.policy == "none"  # the first rung of the ladder fits this tiny model
    want = [trainer.step(host)["loss"] for _ in range(2)]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert losses[1] < losses[0]


def test_sft_loss_decreases_on_a_fixed_batch(base_model):
    state = State(base_model, "fsdp=2,sp=4")
    host = batches(packed_data(np.random.default_rng(0))).next_batch()
    losses = [state.step(host)["loss"] for _ in range(10)]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0], losses
    metrics = state.step(host)
    # tokens with a label in their document and loss mask 1; per row: 2 document ends; 1 end + 4 padding;
    # 1 end + 5 prompt; 1 end
    assert metrics["tokens"] == 4 * 16 - 2 - 5 - 6 - 1
    assert metrics["batch_tokens"] == 4 * 16 - 4 and metrics["applied"] == 1.0 and metrics["grad_norm"] > 0


def test_one_step_on_1x1_equals_one_step_on_2x4(base_model):
    host = batches(packed_data(np.random.default_rng(1))).next_batch()
    after = []
    for layout in ("fsdp=1,sp=1", "fsdp=2,sp=4"):
        # Adam's first update is lr * g / (|g| + eps): gradients near 0 that differ in rounding between
        # layouts can move by up to 2 lr, so LR is small and eps 1e-6 for a 1e-5 parameter tolerance
        state = State(base_model, layout)
        metrics = state.step(host)
        after.append((state.host_params(), metrics))
    (p1, m1), (p8, m8) = after
    start = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(base_model, nnx.Param)))
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), p1, start)
    assert max(jax.tree.leaves(moved)) > 1e-4  # the step changed the parameters
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), p1, p8)
    for k in m1:
        np.testing.assert_allclose(m1[k], m8[k], rtol=1e-5, err_msg=k)


def uneven_rows(seed):
    """8 rows whose loss-token counts differ a lot between micro-batches (long prompts in the second half)."""
    data = packed_data(np.random.default_rng(seed), rows=8)
    data["loss_mask"][4:, :12] = 0
    data["segment_ids"][6, 3:] = 0
    return data


def test_grad_accumulation_equals_the_whole_batch(base_model):
    """K micro-batches of different token counts give the whole batch's update: the loss is normalised
    by the batch's loss tokens, not averaged over micro-batch means. Three steps; float32 sums in
    another order differ by ~1e-7 relative, amplified by Adam's normalisation to below 1e-5."""
    data = uneven_rows(11)
    results = {}
    for k in (1, 2):
        state, stream = State(base_model, "fsdp=2,sp=4"), batches(data, batch_size=8)
        metrics = [state.step(stream.next_batch(), grad_accum=k) for _ in range(3)]
        results[k] = (state.host_params(), metrics)
    p1, m1 = results[1]
    counts = [m["tokens"] for m in m1]
    for k in (2,):
        pk, mk = results[k]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), p1, pk)
        for a, b in zip(m1, mk):
            np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
            assert a["tokens"] == b["tokens"]
    # the micro-batches really differ: first half 8 rows of 16, second half mostly prompt
    first, second = (place_batch(batches(data, 8).next_batch(), make_mesh("fsdp=2,sp=4"), 2, 1)["loss_mask"]
                     .sum(axis=(1, 2)))
    assert first > 2 * second and counts[0] > 0


def test_non_finite_batch_changes_nothing(base_model):
    state = State(base_model, "fsdp=2,sp=4", StepOptions(objective="ppo"))
    data = packed_data(np.random.default_rng(6))
    data["old_log_probs"] = np.zeros(data["tokens"].shape, np.float32)
    data["advantages"] = np.ones(data["tokens"].shape, np.float32)
    host = batches(data).next_batch()
    host["advantages"][1, 3] = np.nan  # what a broken reward model hands over
    before = (state.host_params(), jax.tree.map(np.asarray, state.opt_state))
    metrics = state.step(host)
    assert metrics["applied"] == 0.0 and not np.isfinite(metrics["loss"])
    jax.tree.map(np.testing.assert_array_equal, before[0], state.host_params())
    jax.tree.map(np.testing.assert_array_equal, before[1], jax.tree.map(np.asarray, state.opt_state))
    host["advantages"][1, 3] = 1.0
    assert state.step(host)["applied"] == 1.0  # the next good batch trains


@pytest.mark.parametrize("form", UPDATE_FORMS)
@pytest.mark.parametrize("ok", [True, False])
def test_update_if_forms_agree_bit_for_bit(form, ok):
    # both ways of skipping a non-finite update (the CPU's cond, the GPU's select), under jit: the
    # update when ok, else the inputs exactly, even when the rejected update is NaN
    tx = make_optimizer(make_schedule(1e-2, 10))
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    opt_state = tx.init(params)
    grads = {"w": jnp.full((2, 3), 0.5), "b": jnp.array([1.0, jnp.nan, 2.0])}
    if ok:
        grads["b"] = grads["b"].at[1].set(-1.0)

    def update(p, s):
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    got = jax.jit(lambda p, s: update_if(jnp.asarray(ok), update, p, s, form=form))(params, opt_state)
    want = jax.jit(update)(params, opt_state) if ok else (params, opt_state)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert update_form("cpu") == "cond" and update_form("gpu") == "select" == update_form("tpu")


def test_optimizer_state_follows_parameter_shardings(base_model):
    state = State(base_model, "fsdp=2,sp=4")

    def key(path):
        return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)

    def check():
        params = {key(p): x for p, x in jax.tree.flatten_with_path(state.params)[0]}
        assert any(not x.sharding.is_fully_replicated for x in params.values())
        matched = 0
        for path, leaf in jax.tree.flatten_with_path(state.opt_state)[0]:
            names = key(path)
            if leaf.ndim == 0:  # counts
                assert leaf.sharding.is_fully_replicated and leaf.sharding.mesh == state.mesh
                continue
            owner = max((p for p in params if names[-len(p):] == p), key=len)  # ('norm', 'weight') ends others
            assert names[-len(owner) - 1] in ("mu", "nu"), names
            param = params[owner]
            assert leaf.shape == param.shape and leaf.sharding.is_equivalent_to(param.sharding, leaf.ndim), names
            matched += 1
        assert matched == 2 * len(params)  # mu and nu for every parameter
        return {p: (x.sharding, x.ndim) for p, x in params.items()}

    before = check()
    state.step(batches(packed_data(np.random.default_rng(2))).next_batch())
    after = check()  # still after an update, and the parameters kept theirs
    assert all(after[p][0].is_equivalent_to(s, ndim) for p, (s, ndim) in before.items())


def test_weight_decay_skips_norms_biases_a_log_and_dt_bias(base_model):
    params = nnx.to_pure_dict(nnx.state(base_model, nnx.Param))
    flat = {jax.tree_util.keystr(p): decays(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    no_decay = sorted(k for k, v in flat.items() if not v)
    assert all(any(n in k for n in ("norm", "A_log", "dt_bias")) for k in no_decay), no_decay
    assert any("A_log" in k for k in no_decay) and any("dt_bias" in k for k in no_decay)
    assert any("q_norm" in k for k in no_decay) and "['norm']['weight']" in no_decay
    assert flat["['embed_tokens']['embedding']"] and all(v for k, v in flat.items() if k.endswith("['kernel']"))
    # behaviour: with zero gradients only decayed weights move (AdamW's decay term alone)
    tx = make_optimizer(make_schedule(0.1, 10), weight_decay=0.5, clip_norm=None)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    moved = {jax.tree_util.keystr(p): bool(np.any(np.asarray(u) != 0))
             for p, u in jax.tree_util.tree_flatten_with_path(updates)[0]}
    assert moved == {k: v or False for k, v in flat.items()}


def test_ppo_on_policy_step_has_ratio_one_and_no_clipping(base_model):
    options = StepOptions(objective="ppo", temperature=0.8, kl_coef=0.1)
    state = State(base_model, "fsdp=2,sp=4", options)
    data = packed_data(np.random.default_rng(3))
    model = nnx.merge(state.graphdef, state.params)
    data["old_log_probs"], _ = score_batches(model, data["tokens"], data["segment_ids"], mesh=state.mesh,
                                             temperature=0.8)
    data["ref_log_probs"] = data["old_log_probs"]
    data["advantages"] = np.random.default_rng(4).standard_normal(4).astype(np.float32)  # GRPO: per sequence
    before = state.host_params()
    metrics = state.step(batches(data).next_batch())
    np.testing.assert_allclose(metrics["ratio_mean"], 1.0, atol=1e-5)
    assert metrics["clip_fraction"] == 0.0
    assert abs(metrics["approx_kl"]) < 1e-6 and abs(metrics["kl"]) < 1e-6
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    after = state.host_params()
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(after))
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), after, before))) > 0


def test_ppo_needs_its_fields():
    with pytest.raises(ValueError, match="needs old_log_probs.npy, advantages.npy"):
        ArrayBatches(synthetic_data(4, 8, 64), 4, vocab_size=64, fields=("old_log_probs", "advantages"))


def test_batch_not_divisible_by_fsdp_times_grad_accum_is_one_line_error():
    with pytest.raises(ValueError, match=r"batch size 6 must be a positive multiple of fsdp x grad-accum = 4 x 1.*4, 8, 12") as err:
        check_batch_size(6, 4)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"batch size 8 must be a positive multiple of fsdp x grad-accum = 4 x 4.*16, 32"):
        check_batch_size(8, 4, 4)


def test_token_ids_out_of_range_are_rejected():
    data = synthetic_data(4, 8, 64)
    data["tokens"][1, 3] = 64
    with pytest.raises(ValueError, match=r"token id 64 at \(1, 3\) is outside \[0, 64\)"):
        ArrayBatches(data, 4, vocab_size=64)


def test_npy_dir_is_read_checked_and_padded_to_the_mesh(tmp_path):
    from qwen35_jax.train import load_npy_dir

    rng = np.random.default_rng(5)
    np.save(tmp_path / "tokens.npy", rng.integers(0, 64, size=(4, 13)))
    np.save(tmp_path / "advantages.npy", np.ones(4, np.float32))  # per sequence
    np.save(tmp_path / "old_log_probs.npy", np.full((4, 13), -1.0, np.float32))
    data = load_npy_dir(str(tmp_path))
    assert sorted(data) == ["advantages", "old_log_probs", "tokens"]
    stream = ArrayBatches(data, 4, vocab_size=64, fields=("old_log_probs", "advantages"))
    stream.next_batch()
    host = stream.next_batch()  # rows 4..7 wrap to 0..3
    np.testing.assert_array_equal(host["tokens"], data["tokens"])
    assert stream.get_state()["batches_taken"] == 2
    batch = place_batch(host, make_mesh("fsdp=2,sp=4"), 2, 1)
    assert batch["tokens"].shape == (2, 2, 16) and batch["advantages"].shape == (2, 2)
    tokens, segments = np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"])
    assert (segments[..., 13:] == 0).all() and (segments[..., :13] == 1).all()  # S padded to a multiple of sp
    np.testing.assert_array_equal(tokens.reshape(4, 16)[:, :13], data["tokens"])

    np.save(tmp_path / "loss_mask.npy", np.ones((4, 12), np.int32))
    with pytest.raises(ValueError, match=r"loss_mask has shape \(4, 12\), tokens have \(4, 13\)"):
        load_npy_dir(str(tmp_path))
    np.save(tmp_path / "loss_mask.npy", np.full((4, 13), 2, np.int32))
    with pytest.raises(ValueError, match="loss_mask must hold only 0 and 1"):
        load_npy_dir(str(tmp_path))
    (tmp_path / "tokens.npy").unlink()
    with pytest.raises(ValueError, match="no tokens.npy"):
        load_npy_dir(str(tmp_path))
