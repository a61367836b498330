"""The static kernel census of a compiled program (`bench/hlo_census.py`), on programs XLA:CPU compiles
here; the same reading of an XLA:GPU program is checked in test_gpu_compile.py."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from qwen35_bench.hlo_census import (DEVICE_PEAKS, Kernel, by_category, by_part, by_source, census, parse_module,
                                         part_of, roofline_seconds)
from qwen35_jax.layers.norms import rms_norm


def compiled_text(f, *args, **jit_kwargs) -> str:
    return jax.jit(f, **jit_kwargs).lower(*args).compile().as_text()


def test_loop_runs_dot_flops_and_in_place_updates():
    # five iterations of: y = tanh(y @ w) (a [64, 128] x [128, 128] dot), then 8 rows of y written into
    # a donated buffer in place
    def f(x, w, buf):
        def body(i, carry):
            y, buf = carry
            y = jnp.tanh(y @ w)
            return y, lax.dynamic_update_slice(buf, y[:8], (i * 8, 0))
        return lax.fori_loop(0, 5, body, (x, buf))

    args = (jnp.ones((64, 128)), jnp.ones((128, 128)), jnp.zeros((40, 128)))
    kernels = census(compiled_text(f, *args, donate_argnums=2))
    matmul, = [k for k in kernels if k.category == "matmul"]
    assert matmul.runs == 5 and matmul.flops == 5 * 2 * 64 * 128 * 128
    assert matmul.dot == "f32-highest"  # the suite runs at jax_default_matmul_precision "highest" (conftest)
    assert matmul.bytes == 5 * 4 * (64 * 128 + 128 * 128 + 64 * 128)  # x and w read, y written
    # the tanh (a fusion, or a bare op under some XLA:CPU flags): y read and written
    tanh, = [k for k in kernels if "tanh" in k.name]
    assert tanh.runs == 5 and tanh.bytes == 5 * 4 * 2 * 64 * 128
    # the buffer's update: 8 rows read from y and written (+ the loop index), not the whole [40, 128]
    update, = [k for k in kernels if "dynamic-update-slice" in k.name]
    assert 5 * 2 * 8 * 128 * 4 <= update.bytes <= 5 * (2 * 8 * 128 * 4 + 16)


def test_a_slice_after_a_convert_reads_only_the_slice():
    # one layer of a stacked float32 parameter taken in bfloat16 (what a model's blocks do with their
    # weights): XLA fuses convert -> slice, and the fusion reads the [256, 512] slice, not all six
    stacked = jnp.ones((6, 256, 512))
    kernels = census(compiled_text(
        lambda a: jnp.concatenate([a.astype(jnp.bfloat16)[2], a.astype(jnp.bfloat16)[4]], axis=1), stacked))
    assert len([k for k in kernels if k.bytes == 256 * 512 * (4 + 2)]) == 2, kernels


def test_a_conditional_counts_its_larger_branch():
    def f(pred, x):
        return lax.cond(pred, lambda x: jnp.sin(jnp.cos(x) @ x), lambda x: x, x)

    kernels = census(compiled_text(f, jnp.array(True), jnp.ones((64, 64))))
    assert sum(k.flops for k in kernels) == 2 * 64 ** 3  # the dot of the true branch, counted once


def test_project_source_lines_and_direction():
    x, w = jnp.ones((32, 256)), jnp.ones((256,))
    loss = lambda x, w: jnp.sum(rms_norm(x, w, 1e-6) ** 2)
    kernels = census(compiled_text(jax.grad(loss, argnums=(0, 1)), x, w))
    sources = {s for k in kernels for s in k.source}
    assert any(s.startswith("norms.py:rms_norm:") for s in sources), sources
    assert any(k.backward for k in kernels) and any(not k.backward for k in kernels)
    rows = by_source(kernels, DEVICE_PEAKS["h200"], categories=("fusion", "matmul", "copy", "other"))
    assert any(r["name"].startswith("norms.py:rms_norm:") for r in rows)
    assert sum(r["gb"] for r in rows) == pytest.approx(sum(k.bytes for k in kernels) / 1e9)
    assert {part_of(k) for k in kernels if k.source} == {"RMS norms"}
    assert {r["name"] for r in by_part(kernels, DEVICE_PEAKS["h100"])} <= {"RMS norms", "other"}


def test_roofline_takes_the_slower_of_bytes_and_flops_at_the_dots_precision():
    h200 = DEVICE_PEAKS["h200"]
    memory_bound = Kernel("a", "fusion", 1, int(4.8e9), 0, "", False, ())
    assert roofline_seconds(memory_bound, h200) == pytest.approx(1e-3)
    bf16 = Kernel("b", "matmul", 1, 1000, int(989e9), "bf16", False, ())
    assert roofline_seconds(bf16, h200) == pytest.approx(1e-3)
    # the same FLOPs as float32 dots: TF32 at half the rate; at HIGHEST on the CUDA cores
    assert roofline_seconds(bf16.__class__(**{**bf16.__dict__, "dot": "f32"}), h200) == pytest.approx(2e-3)
    highest = Kernel("c", "matmul", 1, 1000, int(67e9), "bf16+f32-highest", False, ())
    assert roofline_seconds(highest, h200) == pytest.approx(1e-3)
    rows = by_category([memory_bound, bf16, highest], h200)
    assert [r["name"] for r in rows] == ["matmul", "fusion"] and rows[0]["roofline_ms"] == pytest.approx(2.0)


# the lines XLA:GPU prints for a Pallas/Triton call and a cuDNN attention call, cut to what is read
KERNEL_CALLS = """HloModule step

ENTRY %main (q: bf16[2,1024,8,128], k: bf16[2,1024,8,128], h: bf16[512,256], w: bf16[256,4096]) -> f32[512,1] {
  %q = bf16[2,1024,8,128]{3,2,1,0} parameter(0)
  %k = bf16[2,1024,8,128]{3,2,1,0} parameter(1)
  %h = bf16[512,256]{1,0} parameter(2)
  %w = bf16[256,4096]{1,0} parameter(3)
  %pallas_call.1 = (bf16[2,1024,8,128]{3,2,1,0}, f32[2,8,1024]{2,1,0}) custom-call(%q, %k, %k), \
custom_call_target="__gpu$xla.gpu.triton", backend_config={debug = false, grid_x = 8 : i32, ir = "...", \
name = "mha_forward", num_stages = 2 : i32, num_warps = 4 : i32}
  %pallas_call.2 = (bf16[2,1024,8,128]{3,2,1,0}, bf16[2,1024,8,128]{3,2,1,0}, bf16[2,1024,8,128]{3,2,1,0}) \
custom-call(%q, %k, %k, %q), custom_call_target="__gpu$xla.gpu.triton", backend_config={name = "mha_backward"}
  %cudnn.1 = (bf16[2,8,1024,128]{3,1,2,0}, f32[2,8,1024]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %k), \
custom_call_target="__cudnn$fmhaSoftmax"
  %pallas_call.3 = f32[512,1]{1,0} custom-call(%h, %w), custom_call_target="__gpu$xla.gpu.triton", \
backend_config={name = "logprob_forward"}
  %pallas_call.4 = (f32[512,256]{1,0}, f32[256,4096]{1,0}) custom-call(%h, %w), \
custom_call_target="__gpu$xla.gpu.triton", backend_config={name = "logprob_backward"}
  ROOT %pallas_call.5 = f32[512,1]{1,0} custom-call(%h, %w), custom_call_target="__gpu$xla.gpu.triton", \
backend_config={name = "gdn_chunk_states"}
}
""".replace("\\\n", "")


def test_attention_and_logit_kernels_count_their_flops():
    """The arithmetic of the kernels in KERNEL_FLOPS, from their shapes: causal attention with q of
    [B, S, H, D] = [2, 1024, 8, 128] (cuDNN's output [B, H, S, D]) is 2 (forward) or 5 (backward)
    products of 2 S^2 D FLOPs per head, half of them under the diagonal; the logits 2 T D V (a
    backward three times: the logits again, dh, dW). Other Pallas kernels count no FLOPs."""
    kernels = {k.name: k for k in census(KERNEL_CALLS)}
    one_product = 2 * 2 * 8 * 1024 * 1024 * 128 // 2
    assert kernels["pallas_call.1"].flops == 2 * one_product
    assert kernels["pallas_call.2"].flops == 5 * one_product
    assert kernels["cudnn.1"].flops == 2 * one_product
    assert kernels["pallas_call.3"].flops == 2 * 512 * 256 * 4096
    assert kernels["pallas_call.4"].flops == 3 * 2 * 512 * 256 * 4096  # the logits again, dh, dW
    assert kernels["pallas_call.5"].flops == 0
    assert {k.category for k in kernels.values()} == {"custom"} and kernels["pallas_call.1"].dot == "bf16"
    h200 = DEVICE_PEAKS["h200"]
    assert roofline_seconds(kernels["pallas_call.2"], h200) == pytest.approx(5 * one_product / h200.bf16_flops)


def test_parse_errors_name_the_problem():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        parse_module("HloModule m\n")
