"""MFU's FLOP count against an independent one: the dot FLOPs of the train step's jaxpr, each scan
body counted times its length (XLA's cost_analysis counts a loop body once)."""

import jax
import numpy as np
import pytest
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.hf.load import abstract_model
from qwen35_jax.parallel.mesh import make_mesh
from qwen35_jax.train.flops import forward_flops_per_token, jaxpr_dot_flops, peak_tflops, train_flops
from qwen35_jax.train.optim import make_optimizer, make_schedule, opt_state_shardings
from qwen35_jax.train.step import StepOptions, make_train_step

# the proportions of a real layer (hidden 256, head_dim 64, 4 + 8 GDN heads of 32, 3 GDN + 1 attention)
CONFIG = Qwen35Config.preset(
    "tiny", vocab_size=4096, hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
    linear_value_head_dim=32, partial_rotary_factor=0.25, remat=False)


@pytest.mark.parametrize("rows, seq", [(2, 256), (1, 1024)])
def test_train_flops_match_the_jaxpr_dot_count(rows, seq):
    mesh = make_mesh("fsdp=1,sp=1", jax.devices()[:1])
    graphdef, params, _ = abstract_model(CONFIG)
    params = nnx.to_pure_dict(params)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=single), params)
    tx = make_optimizer(make_schedule(1e-3, 10))
    opt_state = jax.eval_shape(tx.init, params)
    shardings = (jax.tree.map(lambda x: x.sharding, params), opt_state_shardings(opt_state, params, mesh))
    step = make_train_step(graphdef, tx, StepOptions(), shardings)
    batch = {name: jax.ShapeDtypeStruct((1, rows, seq), np.int32) for name in ("tokens", "segment_ids", "loss_mask")}
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(step.__wrapped__)(params, opt_state, batch)  # the step's function, unjitted
    counted = jaxpr_dot_flops(jaxpr)
    model = train_flops(CONFIG, rows, seq)
    # the formula is the forward's matmuls x 3; the jaxpr's backward differs from 2x its forward only
    # in the delta rule's small triangular pieces
    assert abs(model - counted) / counted < 0.10, (model, counted, forward_flops_per_token(CONFIG, seq))


def test_peak_table_knows_accelerators_and_not_cpus():
    class Device:
        def __init__(self, kind):
            self.device_kind = kind

    assert peak_tflops(Device("NVIDIA H200")) == 989.0
    assert peak_tflops(Device("TPU v5 lite")) == 197.0 and peak_tflops(Device("TPU v5p")) == 459.0
    assert peak_tflops(jax.devices()[0]) is None
