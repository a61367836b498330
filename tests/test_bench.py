"""qwen35_bench: the paired-round arithmetic and tables of scripts/bench/bench_train.py, and one tiny
train step of each stack timed through it."""

from __future__ import annotations

import json

import pytest

from qwen35_bench.report import breakdown_table, merge_rounds, table
from qwen35_bench.train_step import SMALL, build_config, planned_runs, time_train_step


def _row(theirs: float, ours: float, **extra) -> dict:
    return {"config": "small", "batch": 4, "seq": 512, "remat": "auto -> none",
            "transformers": {"median_s": theirs, "min_s": theirs, "max_s": theirs},
            "ours": {"median_s": ours, "min_s": ours, "max_s": ours, **extra}}


def test_merge_rounds_pairs_each_rounds_ratio_and_takes_medians():
    # a machine that slows down 2x between rounds: the paired ratios stay 2, the unpaired would not
    rounds = [_row(1.0, 0.5), _row(2.0, 1.0), _row(4.0, 2.0)]
    row = merge_rounds(rounds)
    assert row["ours"]["round_ratios"] == [2.0, 2.0, 2.0] and row["ours"]["ratio"] == 2.0
    assert row["ours"]["median_s"] == 1.0 and row["ours"]["min_s"] == 0.5 and row["ours"]["max_s"] == 2.0
    assert row["transformers"]["median_s"] == 2.0
    assert rounds[0]["ours"]["median_s"] == 0.5  # the rounds themselves are left alone
    assert merge_rounds(rounds[:1]) is rounds[0]


def test_table_reports_tokens_per_second_mfu_and_ratio():
    lines = table([_row(1.0, 0.5, mfu=0.123)]).splitlines()
    assert lines[2] == "| small, remat auto -> none | 4 x 512 | 1.000 | 0.500 | 4,096 (MFU 12.3%) | 2.00x |"
    theirs_only = {"config": "long", "batch": 1, "seq": 4096, "transformers": {"median_s": 2.0}}
    assert table([theirs_only]).splitlines()[2] == "| long | 1 x 4096 | 2.000 | - | - | - |"
    merged = merge_rounds([_row(1.0, 0.5), _row(3.0, 1.0)])
    assert table([merged]).splitlines()[2].endswith("| 2.50x (rounds: 2.00, 3.00) |")
    assert breakdown_table([{"piece": "  mlp", "fwd_s": 0.1, "fwd_bwd_s": 0.3}]).splitlines()[2] == \
        "| mlp | 0.100 | 0.300 | 2.00 |"


def test_planned_runs_apply_overrides_to_the_first_config_only():
    runs = planned_runs(["small", "large"], overrides={"layers": 2}, batch=1, seq=128, remat="full")
    (name, small, b, s), (_, large, lb, ls) = runs
    assert (name, small.num_hidden_layers, b, s, small.remat) == ("small", 2, 1, 128, "full")
    assert (large.num_hidden_layers, lb, ls, large.hidden_size) == (4, 1, 2048, 1024)
    (name, preset, b, s), = planned_runs([], preset="tiny", dtype="bfloat16")
    assert (name, b, s, preset.dtype) == ("tiny", 1, 8192, "bfloat16")


@pytest.mark.slow
def test_both_stacks_train_the_same_tiny_step():
    config = build_config(dict(SMALL, hidden=64, intermediate=128, layers=4, heads=2, kv_heads=1, head_dim=32,
                               gdn_key_heads=2, gdn_value_heads=2, gdn_head_dim=16, vocab=256), None)
    row = time_train_step("tiny", config, 2, 32, steps=2, peak_tflops=1.0)
    for stack in ("ours", "transformers"):
        assert 0 < row[stack]["min_s"] <= row[stack]["median_s"] <= row[stack]["max_s"]
    assert row["remat"] == "auto -> none" and row["model_tflops_per_step"] > 0
    assert row["ours"]["mfu"] == pytest.approx(row["model_tflops_per_step"] / row["ours"]["median_s"])


def test_bench_vision_times_both_stacks_on_a_tiny_tower(tmp_path):
    import bench_vision

    out = tmp_path / "vision.json"
    assert bench_vision.main(["--depth", "1", "--hidden", "32", "--heads", "2", "--intermediate", "64", "--patch", "4",
                              "--out", "32", "--positions", "64", "--grid", "1x4x4", "--grid", "1x2x6",
                              "--steps", "1", "--anchor-check", "off", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for stack in ("ours", "transformers"):
        assert result[stack]["median_s"] > 0
    assert result["ratio"] == pytest.approx(result["transformers"]["median_s"] / result["ours"]["median_s"])
    assert result["patches"] == 28 and result["loss_rel_diff"] < 1e-4  # the same weights, the same step
