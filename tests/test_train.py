"""The train step and script: SFT learns, every mesh gives the same update, optimizer state follows the
parameters, PPO on-policy has ratio 1, bad batch sizes and a 2-step CLI run that writes a checkpoint."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qwen35_jax.checkpoint import load_model
from qwen35_jax.config import Qwen35Config
from qwen35_jax.model import Qwen35ForCausalLM
from qwen35_jax.parallel.mesh import make_mesh, shard_model
from qwen35_jax.scoring import score_batches
from qwen35_jax.train import (BatchSource, check_batch_size, create_optimizer, make_optimizer, make_schedule,
                              make_train_step, synthetic_data)

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="module")
def sft_step():
    """One jitted SFT step shared by the tests, so each mesh layout compiles once."""
    return make_train_step(SCHEDULE, objective="sft", temperature=TEMPERATURE)


def setup(base_model, layout):
    devices = jax.devices()[:1] if layout == "fsdp=1,sp=1" else None
    mesh = make_mesh(layout, devices)
    model = nnx.clone(base_model)
    nnx.update(model, jax.tree.map(jnp.copy, nnx.state(model)))  # the step donates: own buffers
    model = shard_model(model, mesh)
    optimizer = create_optimizer(model, TX, mesh)
    return mesh, model, optimizer


def params_of(model) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_sft_loss_decreases_on_a_fixed_batch(base_model, sft_step):
    mesh, model, optimizer = setup(base_model, "fsdp=2,sp=4")
    source = BatchSource(packed_data(np.random.default_rng(0)), 4, mesh, vocab_size=CONFIG.vocab_size)
    batch_host = source.host_batch(0)
    losses = []
    with jax.set_mesh(mesh):
        for _ in range(10):
            metrics = sft_step(model, optimizer, source.batch(0))
            losses.append(float(metrics["loss"]))
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0], losses
    # tokens with a label in their document and loss mask 1; per row: 2 document ends; 1 end + 4 padding;
    # 1 end + 5 prompt; 1 end
    assert float(metrics["tokens"]) == 4 * 16 - 2 - 5 - 6 - 1
    assert float(metrics["grad_norm"]) > 0 and float(metrics["lr"]) > 0
    assert int(optimizer.step[...]) == 10 and batch_host["tokens"].shape == (4, 16)


def test_one_step_on_1x1_equals_one_step_on_2x4(base_model, sft_step):
    data = packed_data(np.random.default_rng(1))
    after = []
    for layout in ("fsdp=1,sp=1", "fsdp=2,sp=4"):
        # Adam's first update is lr * g / (|g| + eps): gradients near 0 that differ in rounding between
        # layouts can move by up to 2 lr, so LR is small and eps 1e-6 for a 1e-5 parameter tolerance
        mesh, model, optimizer = setup(base_model, layout)
        with jax.set_mesh(mesh):
            metrics = sft_step(model, optimizer, BatchSource(data, 4, mesh, vocab_size=CONFIG.vocab_size).batch(0))
        after.append((params_of(model), {k: float(v) for k, v in metrics.items()}))
    (p1, m1), (p8, m8) = after
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), p1, params_of(base_model))
    assert max(jax.tree.leaves(moved)) > 1e-4  # the step changed the parameters
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), p1, p8)
    for k in m1:
        np.testing.assert_allclose(m1[k], m8[k], rtol=1e-5, err_msg=k)


def test_optimizer_state_follows_parameter_shardings(base_model, sft_step):
    mesh, model, optimizer = setup(base_model, "fsdp=2,sp=4")

    def key(path):
        return tuple(str(getattr(k, "key", k)) for k in path)

    def check(model, optimizer):
        params = {key(p): x for p, x in jax.tree.flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]}
        assert any(not x.sharding.is_fully_replicated for x in params.values())
        matched = 0
        for path, leaf in jax.tree.flatten_with_path(nnx.to_pure_dict(nnx.state(optimizer)))[0]:
            names = key(path)
            if leaf.ndim == 0:  # step and count
                assert leaf.sharding.is_fully_replicated and leaf.sharding.mesh == mesh
                continue
            owner = max((p for p in params if names[-len(p):] == p), key=len)  # ('norm', 'weight') ends others
            assert names[-len(owner) - 1] in ("mu", "nu"), names
            param = params[owner]
            assert leaf.shape == param.shape and leaf.sharding.is_equivalent_to(param.sharding, leaf.ndim), names
            matched += 1
        assert matched == 2 * len(params)  # mu and nu for every parameter
        return {p: (x.sharding, x.ndim) for p, x in params.items()}

    before = check(model, optimizer)
    with jax.set_mesh(mesh):
        sft_step(model, optimizer, BatchSource(packed_data(np.random.default_rng(2)), 4, mesh,
                                               vocab_size=CONFIG.vocab_size).batch(0))
    after = check(model, optimizer)  # still after an update, and the parameters kept theirs
    assert all(after[p][0].is_equivalent_to(s, ndim) for p, (s, ndim) in before.items())


def test_ppo_on_policy_step_has_ratio_one_and_no_clipping(base_model):
    mesh, model, optimizer = setup(base_model, "fsdp=2,sp=4")
    step = make_train_step(SCHEDULE, objective="ppo", temperature=0.8)
    data = packed_data(np.random.default_rng(3))
    data["old_log_probs"], _ = score_batches(model, data["tokens"], data["segment_ids"], mesh=mesh,
                                             temperature=0.8)
    data["advantages"] = np.random.default_rng(4).standard_normal(data["tokens"].shape).astype(np.float32)
    before = params_of(model)
    with jax.set_mesh(mesh):
        metrics = step(model, optimizer, BatchSource(data, 4, mesh, vocab_size=CONFIG.vocab_size,
                                                     objective="ppo").batch(0))
    np.testing.assert_allclose(float(metrics["ratio_mean"]), 1.0, atol=1e-5)
    assert float(metrics["clip_fraction"]) == 0.0
    assert abs(float(metrics["approx_kl"])) < 1e-6
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    after = params_of(model)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(after))
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), after, before))) > 0


def test_ppo_needs_its_fields():
    mesh = make_mesh("fsdp=2,sp=4")
    with pytest.raises(ValueError, match="needs old_log_probs, advantages"):
        BatchSource(synthetic_data(4, 8, 64), 4, mesh, vocab_size=64, objective="ppo")


def test_batch_not_divisible_by_fsdp_is_one_line_error():
    with pytest.raises(ValueError, match=r"batch size 6 must be a positive multiple of fsdp=4.*4, 8, 12") as err:
        check_batch_size(6, 4)
    assert "\n" not in str(err.value)
    mesh = make_mesh("fsdp=4,sp=2")
    with pytest.raises(ValueError, match="batch size 2 must be a positive multiple of fsdp=4"):
        BatchSource(synthetic_data(8, 8, 64), 2, mesh, vocab_size=64)


def test_token_ids_out_of_range_are_rejected():
    data = synthetic_data(4, 8, 64)
    data["tokens"][1, 3] = 64
    with pytest.raises(ValueError, match=r"token id 64 at \(1, 3\) is outside \[0, 64\)"):
        BatchSource(data, 4, make_mesh("fsdp=2,sp=4"), vocab_size=64)


def run_script(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def test_script_help():
    result = run_script("--help")
    assert result.returncode == 0 and "--objective" in result.stdout and "--synthetic" in result.stdout


def test_script_two_steps_write_a_checkpoint_load_model_reads(tmp_path):
    out = tmp_path / "ckpt"
    result = run_script("--preset", "tiny", "--synthetic", "--steps", "2", "--batch-size", "4",
                        "--seq-len", "16", "--mesh", "fsdp=2,sp=4", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "step 2/2" in result.stdout
    model, config = load_model(str(out))
    assert config == Qwen35Config.preset("tiny")
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_script_bad_batch_size_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "ckpt"
    result = run_script("--preset", "tiny", "--synthetic", "--steps", "1", "--batch-size", "3",
                        "--mesh", "fsdp=2,sp=4", "--out", str(out))
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "batch size 3" in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_npy_dir_is_read_checked_and_padded_to_the_mesh(tmp_path):
    from qwen35_jax.train import load_npy_dir

    rng = np.random.default_rng(5)
    np.save(tmp_path / "tokens.npy", rng.integers(0, 64, size=(4, 13)))
    np.save(tmp_path / "advantages.npy", np.ones((4, 13), np.float32))
    np.save(tmp_path / "old_log_probs.npy", np.full((4, 13), -1.0, np.float32))
    data = load_npy_dir(str(tmp_path))
    assert sorted(data) == ["advantages", "old_log_probs", "tokens"]
    batch = BatchSource(data, 4, make_mesh("fsdp=2,sp=4"), vocab_size=64, objective="ppo").host_batch(1)
    assert batch["tokens"].shape == (4, 16)  # S padded to a multiple of sp, as padding segment 0
    assert (batch["segment_ids"][:, 13:] == 0).all() and (batch["segment_ids"][:, :13] == 1).all()
    np.testing.assert_array_equal(batch["tokens"][:, :13], data["tokens"])  # rows 4..7 wrap to 0..3
    assert (batch["advantages"][:, 13:] == 0).all()

    np.save(tmp_path / "loss_mask.npy", np.ones((4, 12), np.int32))
    with pytest.raises(ValueError, match=r"loss_mask has shape \(4, 12\), tokens have \(4, 13\)"):
        load_npy_dir(str(tmp_path))
    np.save(tmp_path / "loss_mask.npy", np.full((4, 13), 2, np.int32))
    with pytest.raises(ValueError, match="loss_mask must hold only 0 and 1"):
        load_npy_dir(str(tmp_path))
    (tmp_path / "tokens.npy").unlink()
    with pytest.raises(ValueError, match="no tokens.npy"):
        load_npy_dir(str(tmp_path))
