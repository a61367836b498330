"""HF safetensors import/export: bit-exact round trips, transformers compatibility, shardings, scripts."""

from __future__ import annotations

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distributed_testutil import run_processes
from hf_testutil import (all_tensors, edit_tensors, load_script, make_hf, script_cmd, subprocess_env,
                         text_tensors, to_fused)
from qwen35_jax.checkpoint import load_checkpoint, load_model, read_metadata, save_checkpoint
from qwen35_jax.config import Qwen35Config
from qwen35_jax.hf import names as N
from qwen35_jax.hf.export import export_hf
from qwen35_jax.hf.load import inspect_hf, load_hf, param_paths
from qwen35_jax.hf.safetensors_io import TensorToWrite, plan_shards

MTP = {"mtp.fc.weight": (32, 64), "mtp.layers.0.input_layernorm.weight": (32,)}


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny transformers checkpoints: dense, tied MoE (per-expert and fused), ConditionalGeneration (+MTP)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("dense", "moe_tied", "conditional"):
        for dtype in ("float32", "bfloat16"):
            out[f"{kind}-{dtype}"] = make_hf(str(root / f"{kind}-{dtype}"), kind, dtype)
    out["moe_fused-float32"] = make_hf(str(root / "moe_fused"), "moe_tied", "float32", seed=1)
    to_fused(out["moe_fused-float32"])
    rng = np.random.default_rng(0)
    for dtype in ("float32", "bfloat16"):
        edit_tensors(out[f"conditional-{dtype}"], lambda t: {
            **t, **{k: rng.normal(size=s).astype(next(iter(t.values())).dtype) for k, s in MTP.items()}})
    return out


def params_of(model: nnx.Module) -> dict[str, jax.Array]:
    return param_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def roundtrip(src: str, tmp: str, **export_kwargs) -> str:
    """Library path of import_hf.py + export_hf.py: HF -> our checkpoint -> HF."""
    model, config, ckpt = load_hf(src)
    save_checkpoint(os.path.join(tmp, "ours"), model, config, layout=ckpt.layout, hf_config=ckpt.raw_config)
    model2, config2, meta = load_checkpoint(os.path.join(tmp, "ours"))
    out = os.path.join(tmp, "back")
    export_hf(nnx.state(model2, nnx.Param), config2, out, layout=N.Layout.from_dict(meta["layout"]),
              hf_config=meta["hf_config"], **export_kwargs)
    return out


@pytest.mark.parametrize("name", ["dense-float32", "dense-bfloat16", "moe_tied-float32", "moe_tied-bfloat16",
                                  "moe_fused-float32", "conditional-float32", "conditional-bfloat16"])
def test_import_export_bit_exact(hf, name, tmp_path):
    src = hf[name]
    out = roundtrip(src, str(tmp_path))
    want, got = text_tensors(src), all_tensors(out)
    assert sorted(got) == sorted(want)  # same names: no visual/MTP, no lm_head when tied
    for k in want:
        assert got[k] == want[k], k  # dtype, shape and bytes
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(f) == json.load(g)


def test_layouts_detected(hf):
    cases = {"dense-float32": (N.CAUSAL_PREFIX, "none", False, "F32", 0),
             "moe_tied-bfloat16": (N.CAUSAL_PREFIX, "per_expert", True, "BF16", 0),
             "moe_fused-float32": (N.CAUSAL_PREFIX, "fused", True, "F32", 0),
             "conditional-bfloat16": (N.CONDITIONAL_PREFIX, "none", False, "BF16", None)}
    for name, (prefix, experts, tied, dtype, skipped) in cases.items():
        ck = inspect_hf(hf[name])
        assert (ck.layout.prefix, ck.layout.experts, ck.layout.tied, ck.layout.dtype) == (prefix, experts, tied, dtype)
        n_visual = sum(1 for n in all_tensors(hf[name]) if n.startswith("model.visual."))
        assert len(ck.skipped) == (skipped if skipped is not None else n_visual + len(MTP))
    assert inspect_hf(hf["conditional-float32"]).layout.architecture == "Qwen3_5ForConditionalGeneration"


def test_conditional_tied_at_top_level(hf, tmp_path):
    """transformers ties a ConditionalGeneration model by its top-level flag, whatever text_config says."""
    import shutil

    from hf_testutil import edit_config

    src = shutil.copytree(hf["conditional-float32"], str(tmp_path / "tied"))
    edit_tensors(src, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    edit_config(src, tie_word_embeddings=True)
    with open(os.path.join(src, "config.json")) as f:
        assert json.load(f)["text_config"]["tie_word_embeddings"] is False
    ck = inspect_hf(src)
    assert ck.layout.tied and ck.config.tie_word_embeddings
    assert all_tensors(roundtrip(src, str(tmp_path))) == text_tensors(src)


def test_coverage_check_names_the_parameter():
    from qwen35_jax.hf.load import check_coverage

    config = Qwen35Config.preset("tiny")
    table = N.build_table(config, N.Layout.default(config))
    abstract = {}
    for e in table:
        node = abstract
        *parents, leaf = e.path.split(".")
        for p in parents:
            node = node.setdefault(int(p) if p.isdigit() else p, {})
        node[leaf] = jax.ShapeDtypeStruct(e.shape, jnp.float32)
    check_coverage(table, abstract)
    abstract["blocks"]["layers"][0]["extra_scale"] = jax.ShapeDtypeStruct((1, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"blocks\.layers\.0\.extra_scale .* no Hugging Face tensor"):
        check_coverage(table, abstract)
    del abstract["blocks"]["layers"][0]["extra_scale"]
    del abstract["norm"]
    with pytest.raises(ValueError, match=r"model\.norm\.weight maps to norm\.weight, which the model does not have"):
        check_coverage(table, abstract)


@pytest.mark.parametrize("name", ["dense-float32", "moe_fused-float32"])
def test_logits_match_transformers(hf, name):
    """The name table puts every tensor where the model reads it (8 layers = 2 scanned blocks)."""
    import torch
    import transformers as tf

    from float64_reference import float64_copy, torch_float64

    ref_model = float64_copy(tf.AutoModelForCausalLM.from_pretrained(hf[name], dtype=torch.float32))
    tokens = np.random.default_rng(1).integers(0, 128, (2, 11))
    ids = torch.tensor(tokens)
    with torch.no_grad(), torch_float64():
        ref = ref_model(input_ids=ids).logits.numpy()
    model, _ = load_model(hf[name])
    got = np.asarray(model.logits(model(jnp.asarray(tokens, jnp.int32))))
    # Our float32 logits vs the float64 truth: these weights (std 0.3) amplify float32 rounding through 8
    # layers; measured max 7.6e-5 dense and 3.4e-5 MoE (logits up to 6.2) on AMD EPYC. 5e-4 leaves 6x headroom,
    # while rms_norm_eps 1e-5 instead of 1e-6 is off by 3.9 and doubling rope_theta by 0.14.
    np.testing.assert_allclose(got, ref, atol=5e-4, rtol=0)


@pytest.mark.parametrize("name", ["dense-bfloat16", "moe_tied-float32", "moe_fused-float32"])
def test_transformers_loads_export(hf, name, tmp_path):
    import torch
    import transformers as tf

    out = roundtrip(hf[name], str(tmp_path))
    a = tf.AutoModelForCausalLM.from_pretrained(hf[name]).state_dict()
    loaded, info = tf.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    b = loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_scripts_sharded_roundtrip_with_extras(hf, tmp_path):
    """import_hf.py / export_hf.py as users run them; small shards; the vision tower imported and written
    back, MTP copied back."""
    src, ours, back = hf["conditional-bfloat16"], str(tmp_path / "ours"), str(tmp_path / "back")
    env = subprocess_env()
    r = subprocess.run(script_cmd("import_hf", src, ours), capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    # the script imports a VLM's vision tower unless --text-only: only the MTP tensors are skipped
    assert f"skipped {len(inspect_hf(src, text_only=False).skipped)} vision/MTP tensors" in r.stdout
    r = subprocess.run(script_cmd("export_hf", ours, back, "--max-shard-size", "40KB", "--extra-from", src),
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    shards = sorted(f for f in os.listdir(back) if f.endswith(".safetensors"))
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(back)
    with open(os.path.join(back, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert sorted(index["weight_map"]) == sorted(all_tensors(src))
    for s in shards:  # a shard is over the limit only when it holds a single larger tensor
        with open(os.path.join(back, s), "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        data = os.path.getsize(os.path.join(back, s)) - 8 - header_len
        assert data <= 40_000 or sum(1 for v in index["weight_map"].values() if v == s) == 1
    assert all_tensors(back) == all_tensors(src)  # every tensor, text and not, bit for bit
    assert inspect_hf(back).layout == inspect_hf(src).layout  # the sharded output imports again


def test_transformers_loads_conditional_export(hf, tmp_path):
    import torch
    import transformers as tf

    src = hf["conditional-float32"]
    out = roundtrip(src, str(tmp_path))
    a = tf.Qwen3_5ForConditionalGeneration.from_pretrained(src).state_dict()
    b = tf.Qwen3_5ForConditionalGeneration.from_pretrained(out).state_dict()
    text = [k for k in a if not k.startswith("model.visual.")]
    assert text and all(torch.equal(a[k], b[k]) for k in text)


def test_mixed_dtype_checkpoint_round_trips(hf, tmp_path):
    """A bf16 checkpoint that keeps A_log in float32 loads as float32 and exports each dtype back."""
    src = str(tmp_path / "mixed")
    make_hf(src, "dense", "bfloat16", num_layers=4)
    edit_tensors(src, lambda t: {k: (v.astype(np.float32) if k.endswith("A_log") else v) for k, v in t.items()})
    ck = inspect_hf(src)
    assert ck.default_param_dtype == "float32" and ck.layout.dtype == "BF16"
    assert set(ck.layout.dtype_overrides) == {"model.layers.0.linear_attn.A_log", "model.layers.1.linear_attn.A_log",
                                              "model.layers.2.linear_attn.A_log"}
    out = roundtrip(src, str(tmp_path))
    assert all_tensors(out) == all_tensors(src)


def test_dtype_and_load_model_sources(hf, tmp_path):
    src = hf["moe_tied-float32"]
    model, config = load_model(src, dtype="bfloat16")
    assert config.param_dtype == "bfloat16"
    assert {x.dtype for x in params_of(model).values()} == {jnp.dtype(jnp.bfloat16)}
    save_checkpoint(str(tmp_path / "ours"), model, config)
    assert read_metadata(str(tmp_path / "ours"))["layout"] is None
    again, config2 = load_model(str(tmp_path / "ours"))
    assert config2 == config
    a, b = params_of(model), params_of(again)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    wide, _ = load_model(str(tmp_path / "ours"), dtype="float32")
    assert all(v.dtype == jnp.float32 for v in params_of(wide).values())


def test_mesh_load_is_sharded_and_equal(hf, tmp_path):
    """Each tensor lands in its ZeRO-3 sharding (small-weight threshold off so tiny weights shard too)."""
    from qwen35_jax.parallel.mesh import make_mesh, param_spec

    mesh = make_mesh("fsdp=2,sp=4")
    src = hf["moe_fused-float32"]
    single = params_of(load_model(src)[0])

    def shardings_for(pure):
        return jax.tree_util.tree_map_with_path(lambda path, x: jax.sharding.NamedSharding(
            mesh, param_spec(x.shape, 8, skip_dims=int(path[0].key == "blocks"), min_size=1)), pure)

    abstract = nnx.to_pure_dict(nnx.state(load_model(src)[0], nnx.Param))
    want = param_paths(shardings_for(abstract))
    assert sum(not s.is_fully_replicated for s in want.values()) > 10
    model, config, _ = load_hf(src, shardings=shardings_for(abstract))
    save_checkpoint(str(tmp_path / "ours"), model, config)
    restored, _, _ = load_checkpoint(str(tmp_path / "ours"), shardings=shardings_for(abstract))
    for m in (model, restored):
        for k, x in params_of(m).items():
            assert x.sharding.is_equivalent_to(want[k], x.ndim), k
            np.testing.assert_array_equal(np.asarray(x), np.asarray(single[k]))
    default = params_of(load_model(src, mesh=mesh)[0])  # the mesh module's own rule (tiny: replicated)
    assert all(x.sharding.mesh == mesh for x in default.values())


def test_export_of_model_made_from_scratch(tmp_path):
    """No source layout: transformers' own layout (per-expert, tied) that transformers and we read back."""
    import torch
    import transformers as tf
    from qwen35_jax.model import Qwen35ForCausalLM

    config = Qwen35Config.preset("tiny-moe")
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(3))
    out = str(tmp_path / "hf")
    export_hf(nnx.state(model, nnx.Param), config, out)
    ours = params_of(model)
    back = params_of(load_hf(out)[0])
    assert ours.keys() == back.keys() and all(np.array_equal(ours[k], back[k]) for k in ours)
    ref, info = tf.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    sd = ref.state_dict()
    emb = np.asarray(ours["embed_tokens.embedding"])
    np.testing.assert_array_equal(sd["model.embed_tokens.weight"].numpy(), emb)
    np.testing.assert_array_equal(sd["lm_head.weight"].numpy(), emb)  # tied
    gate_up = np.asarray(ours["blocks.layers.3.mlp.experts.gate_up_proj"])[0]  # layer 3, [E, D, 2I]
    np.testing.assert_array_equal(sd["model.layers.3.mlp.experts.gate_up_proj"].numpy(),
                                  np.swapaxes(gate_up, 1, 2))
    assert torch.is_floating_point(sd["model.norm.weight"])


@pytest.mark.parametrize("kind,shape", [(N.Kind.COPY, (5,)), (N.Kind.LINEAR, (3, 7)), (N.Kind.CONV, (4, 9)),
                                        (N.Kind.EXPERTS_FUSED, (3, 5, 8)), (N.Kind.EXPERTS_GATE_UP, (3, 5, 8)),
                                        (N.Kind.EXPERTS_DOWN, (3, 4, 5))])
def test_kind_transforms_are_inverse(kind, shape):
    ours = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    hf = N.to_hf(kind, ours)
    assert [t.shape for t in hf] == N.hf_shapes(kind, shape)
    np.testing.assert_array_equal(N.to_ours(kind, [np.ascontiguousarray(t) for t in hf]), ours)
    by_name = {f"t{i}": np.ascontiguousarray(t) for i, t in enumerate(hf)}
    streamed = N.read_ours(kind, list(by_name), by_name.__getitem__, shape, np.dtype(np.float32))
    assert streamed.flags.c_contiguous
    np.testing.assert_array_equal(streamed, ours)


def test_per_expert_gate_up_order():
    """Our gate_up_proj [E, D, 2I] is gate then up on the last axis, like HF's fused [E, 2I, D]."""
    gate = [np.full((2, 3), 10.0 * e) for e in range(2)]
    up = [np.full((2, 3), 10.0 * e + 1) for e in range(2)]
    ours = N.to_ours(N.Kind.EXPERTS_GATE_UP, gate + up)
    fused = np.stack([np.concatenate([gate[e], up[e]]) for e in range(2)])
    np.testing.assert_array_equal(ours, N.to_ours(N.Kind.EXPERTS_FUSED, [fused]))
    assert ours[1, 0, :2].tolist() == [10.0, 10.0] and ours[1, 0, 2:].tolist() == [11.0, 11.0]


def test_plan_shards_respects_limit():
    ts = [TensorToWrite(f"t{i}", "F32", (n,), lambda: None) for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    shards = plan_shards(ts, max_shard_bytes=80)
    assert [[t.name for t in s] for s in shards] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert [t.name for s in plan_shards(ts, 10**9) for t in s] == [t.name for t in ts]


def test_script_main_in_process(hf, tmp_path, capsys):
    imp, exp = load_script("import_hf"), load_script("export_hf")
    assert imp.main([hf["moe_tied-bfloat16"], str(tmp_path / "c"), "--dtype", "float32"]) == 0
    assert read_metadata(str(tmp_path / "c"))["config"]["param_dtype"] == "float32"
    assert exp.main([str(tmp_path / "c"), str(tmp_path / "h")]) == 0
    assert all_tensors(str(tmp_path / "h")) == all_tensors(hf["moe_tied-bfloat16"])  # bf16 -> f32 -> bf16 exact


def test_script_mesh_and_export_dtype(hf, tmp_path):
    """--mesh loads onto an fsdp x sp mesh; export --dtype bfloat16 rounds like torch and says so."""
    import torch
    import transformers as tf

    imp, exp = load_script("import_hf"), load_script("export_hf")
    src = hf["dense-float32"]
    assert imp.main([src, str(tmp_path / "c"), "--mesh", "fsdp=2,sp=4"]) == 0
    assert exp.main([str(tmp_path / "c"), str(tmp_path / "h"), "--dtype", "bfloat16"]) == 0
    got = all_tensors(str(tmp_path / "h"))
    assert {v[0] for v in got.values()} == {"BF16"}
    with open(tmp_path / "h" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    want = {k: v.to(torch.bfloat16) for k, v in tf.AutoModelForCausalLM.from_pretrained(src).state_dict().items()}
    back = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "h")).state_dict()
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)


@pytest.mark.slow
def test_two_process_import_export(hf, tmp_path):
    """import_hf.py and export_hf.py as 2 processes x 4 devices under jax.distributed: bit-exact."""
    src, ours, back = hf["moe_fused-float32"], str(tmp_path / "ours"), str(tmp_path / "back")
    run_processes(script_cmd("import_hf", src, ours, "--mesh", "fsdp=2,sp=4"), timeout=300)
    run_processes(script_cmd("export_hf", ours, back, "--max-shard-size", "60KB"), timeout=300)
    assert all_tensors(back) == all_tensors(src)
    assert not [f for f in os.listdir(tmp_path) if ".partial-" in f]


def test_checkpoint_from_host_arrays(tmp_path):
    """save_checkpoint takes a plain numpy tree (e.g. built on the host) and restores it exactly."""
    from qwen35_jax.hf.load import abstract_model

    config = Qwen35Config.preset("tiny")
    rng = np.random.default_rng(0)
    pure = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(a.dtype),
                        nnx.to_pure_dict(abstract_model(config)[1]))
    save_checkpoint(str(tmp_path / "c"), pure, config, extra={"step": 7})
    model, config2, meta = load_checkpoint(str(tmp_path / "c"))
    assert config2 == config and meta["step"] == 7
    got, want = params_of(model), param_paths(pure)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
