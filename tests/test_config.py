"""Qwen35Config: reading the four HF model types, validation, to_hf_dict round trips, presets."""

import json

import pytest
import transformers

from qwen35_jax.config import Qwen35Config, hybrid_layer_types

TINY_VISION = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 64}
PRESETS = ["tiny", "tiny-moe", "0.8B", "4B", "9B", "27B", "35B-A3B", "397B-A17B"]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_round_trips_through_transformers(name):
    cfg = Qwen35Config.preset(name)
    d = cfg.to_hf_dict()
    model_type = d.pop("model_type")
    hf = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in d.items() if k != "architectures"})
    assert hf.model_type == cfg.hf_model_type
    assert Qwen35Config.from_hf(hf) == cfg
    assert Qwen35Config.from_hf(cfg.to_hf_dict()) == cfg
    text = hf.get_text_config()
    assert text.num_hidden_layers == cfg.num_hidden_layers and list(text.layer_types) == list(cfg.layer_types)


@pytest.mark.parametrize("name", ["0.8B", "4B", "9B", "27B", "35B-A3B", "397B-A17B"])
def test_published_presets_share_vocab_and_head_dim(name):
    cfg = Qwen35Config.preset(name)
    assert (cfg.vocab_size, cfg.head_dim, cfg.rotary_dim, cfg.block_period) == (248320, 256, 64, 4)
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)


def test_from_hf_reads_path_directory_and_dict(tmp_path):
    d = Qwen35Config.preset("tiny").to_hf_dict()
    (tmp_path / "config.json").write_text(json.dumps(d))
    a = Qwen35Config.from_hf(tmp_path)
    b = Qwen35Config.from_hf(str(tmp_path / "config.json"))
    assert a == b == Qwen35Config.preset("tiny")


def test_conditional_generation_ties_by_the_top_level_flag_like_transformers():
    base = Qwen35Config.preset("tiny").replace(hf_model_type="qwen3_5", tie_word_embeddings=False)
    d = base.to_hf_dict()
    assert d["model_type"] == "qwen3_5" and d["text_config"]["model_type"] == "qwen3_5_text"
    for top in (None, True, False):
        for inner in (True, False):
            text = dict(d["text_config"], tie_word_embeddings=inner)
            kw = {} if top is None else {"tie_word_embeddings": top}
            hf_config = transformers.Qwen3_5Config(text_config=text, vision_config=TINY_VISION, **kw)
            hf_model = transformers.Qwen3_5ForConditionalGeneration(hf_config)
            hf_tied = hf_model.lm_head.weight is hf_model.model.language_model.embed_tokens.weight
            raw = {"model_type": "qwen3_5", "text_config": text, **kw}
            assert Qwen35Config.from_hf(raw).tie_word_embeddings is hf_tied, (top, inner)


def test_moe_conditional_generation():
    cfg = Qwen35Config.preset("tiny-moe").replace(hf_model_type="qwen3_5_moe")
    hf = transformers.Qwen3_5MoeConfig(text_config=cfg.to_hf_dict()["text_config"])
    got = Qwen35Config.from_hf(hf)
    assert got.num_experts == 8 and got.hf_model_type == "qwen3_5_moe" and got.intermediate_size == 0


def test_full_attention_interval_when_no_layer_types():
    d = Qwen35Config.preset("tiny").to_hf_dict()
    d.pop("layer_types")
    d["num_hidden_layers"] = 6
    d["full_attention_interval"] = 3
    cfg = Qwen35Config.from_hf(d)
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2
    assert cfg.block_period == 3 and cfg.num_blocks == 2


def test_rope_parameters_are_read():
    d = Qwen35Config.preset("tiny").to_hf_dict()
    d["head_dim"] = 32
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    cfg = Qwen35Config.from_hf(d)
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.mrope_section, cfg.rotary_dim) == (1234.0, 0.5, (3, 3, 2), 16)


def test_missing_mrope_section_is_the_transformers_default_at_any_rotary_dim():
    d = Qwen35Config.preset("tiny").to_hf_dict()
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}
    cfg = Qwen35Config.from_hf(d)
    assert (cfg.rotary_dim, cfg.mrope_section) == (16, (11, 11, 10))
    assert Qwen35Config.from_hf(cfg.to_hf_dict()) == cfg


def _transformers_runs_with_mrope_section(section) -> bool:
    import torch

    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0, "mrope_section": section}
    hf = transformers.Qwen3_5TextConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        layer_types=["full_attention"], rope_parameters=rope)
    try:
        with torch.no_grad():
            transformers.Qwen3_5ForCausalLM(hf)(torch.arange(4)[None])
    except (IndexError, TypeError):
        return False
    return True


@pytest.mark.parametrize("section,transformers_runs", [
    ([2, 2], False), ([1, 1.5, 1], False), ("abc", False),  # transformers' rotary fails on these too
    ([1, -1, 1], True), ([1, 1, 1, 1], True),  # transformers slices these to something no (t, h, w) section means
])
def test_malformed_mrope_section_is_a_one_line_error(section, transformers_runs):
    assert _transformers_runs_with_mrope_section(section) is transformers_runs
    d = Qwen35Config.preset("tiny").to_hf_dict()
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": section}
    with pytest.raises(ValueError, match="mrope_section must be 3 non-negative integers") as err:
        Qwen35Config.from_hf(d)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("layer_types,period", [
    (("full_attention",) * 4, 1),
    (("linear_attention",) * 3 + ("full_attention",), 4),
    (("linear_attention", "full_attention") * 3, 2),
    (("linear_attention", "full_attention", "full_attention"), 3),
    (("linear_attention", "full_attention", "full_attention", "full_attention", "linear_attention"), 5),
])
def test_block_period(layer_types, period):
    cfg = Qwen35Config.preset("tiny", num_hidden_layers=len(layer_types), layer_types=layer_types)
    assert cfg.block_period == period
    assert cfg.num_blocks * period == len(layer_types)


def _tiny_dict(**changes):
    d = Qwen35Config.preset("tiny").to_hf_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "qwen3_next"}, "model_type"),
    ({"model_type": "llama"}, "model_type"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [1, 1, 0],
                         "mrope_interleaved": False}}, "mrope_interleaved"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"num_key_value_heads": 3}, "divisible"),
    ({"linear_num_key_heads": 3}, "divisible"),
])
def test_unsupported_settings_are_clear_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        Qwen35Config.from_hf(_tiny_dict(**changes))


def test_moe_norm_topk_false_is_rejected():
    d = Qwen35Config.preset("tiny-moe").to_hf_dict()
    d["norm_topk_prob"] = False
    with pytest.raises(ValueError, match="norm_topk_prob"):
        Qwen35Config.from_hf(d)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        Qwen35Config.preset("tiny-moe", norm_topk_prob=False)


def test_bad_sources_and_presets(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        Qwen35Config.from_hf(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Qwen35Config.from_hf(tmp_path)
    with pytest.raises(ValueError, match="unknown preset"):
        Qwen35Config.preset("7B")
    with pytest.raises(ValueError, match="dtype"):
        Qwen35Config.preset("tiny", dtype="float64")


def test_hybrid_layer_types():
    assert hybrid_layer_types(8, 4) == (("linear_attention",) * 3 + ("full_attention",)) * 2
    with pytest.raises(ValueError):
        hybrid_layer_types(4, 0)


def test_scan_layers_setting_and_its_runtime_choice():
    from qwen35_jax.model import scans_layers
    from qwen35_jax.train.loop import _runtime_config
    from qwen35_jax.train.options import TrainOptions

    cfg = Qwen35Config.preset("tiny")
    assert cfg.scan_layers == "auto" and scans_layers(cfg)  # "auto" scans off a GPU
    assert not scans_layers(cfg.replace(scan_layers=False))
    # on GPU the blocks run one after another only when the backward recomputes nothing
    assert not scans_layers(cfg.replace(remat="none"), backend="gpu")
    for remat in ("auto", "full", "nested", "layer", "dots", "offload"):
        assert scans_layers(cfg.replace(remat=remat), backend="gpu"), remat
    assert not scans_layers(cfg.replace(remat="full", scan_layers=False), backend="gpu")
    with pytest.raises(ValueError, match="scan_layers must be True, False or 'auto', got 'yes'"):
        cfg.replace(scan_layers="yes")
    for flag, want in (("auto", "auto"), ("true", True), ("false", False)):
        options = TrainOptions(scan_layers=flag, compute_dtype="float32")
        assert _runtime_config(cfg, options).scan_layers == want


def test_gdn_chunk_size_auto_by_backend_and_head_dim():
    cfg = Qwen35Config.preset("tiny")
    assert cfg.gdn_chunk_size == "auto"
    small, large = cfg.replace(linear_key_head_dim=64, linear_value_head_dim=64), Qwen35Config.preset("0.8B")
    assert small.gdn_chunk("cpu") == 32 and small.gdn_chunk("gpu") == 64 and small.gdn_chunk("tpu") == 64
    assert large.linear_key_head_dim == 128 and large.gdn_chunk("cpu") == 64
    assert cfg.replace(linear_value_head_dim=128).gdn_chunk("cpu") == 64  # either head dim above 64
    assert cfg.replace(gdn_chunk_size=16).gdn_chunk("gpu") == 16
    for bad in (0, -4, "32", True):
        with pytest.raises(ValueError, match="gdn_chunk_size must be >= 1 or 'auto'"):
            cfg.replace(gdn_chunk_size=bad)
