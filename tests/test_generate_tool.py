"""scripts/generate.py end to end: every prompt form, output rows, stop tokens, and bad input."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from data_testutil import demo_tokenizer, demo_tokenizer_dir, write_jsonl
from qwen35_jax.config import Qwen35Config
from qwen35_jax.generation import generate
from qwen35_jax.generation.tool import main
from qwen35_jax.hf.export import export_hf
from qwen35_jax.model import Qwen35ForCausalLM

CONFIG = Qwen35Config.preset("tiny", num_attention_heads=8, linear_num_value_heads=8)  # vocab 256 = the tokenizer's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Qwen35ForCausalLM]:
    """An HF checkpoint with the demo tokenizer (chat template, eos) and a generation_config.json."""
    model = Qwen35ForCausalLM(CONFIG, rngs=nnx.Rngs(7))
    path = tmp_path_factory.mktemp("ckpt") / "hf"
    export_hf(nnx.state(model, nnx.Param), CONFIG, str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(demo_tokenizer_dir()) / name, path / name)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5]}))
    return path, model


def _run(tmp_path, checkpoint, rows, *args, name="out.jsonl"):
    prompts = write_jsonl(str(tmp_path / "in.jsonl"), rows)
    out = tmp_path / name
    code = main(["--model", str(checkpoint[0]), "--prompts", prompts, "--out", str(out), *args])
    return code, out


def test_every_prompt_form_keeps_its_fields_and_matches_the_library(tmp_path, checkpoint):
    path, model = checkpoint
    tok = demo_tokenizer()
    messages = [{"role": "user", "content": "Tell me a story"}]
    rows = [{"prompt_ids": [10, 20, 30], "id": "a"}, {"prompt": "Once upon a time", "answer": 4},
            {"messages": messages}]
    code, out = _run(tmp_path, checkpoint, rows, "--max-new-tokens", "5", "--temperature", "0.8", "--top-k", "50",
                     "--seed", "3", "--num-samples", "2", "--stop-token-ids", "")
    assert code == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(g.get("id"), g.get("answer"), g["sample"]) for g in got] == [("a", None, 0), ("a", None, 1),
                                                                          (None, 4, 0), (None, 4, 1),
                                                                          (None, None, 0), (None, None, 1)]
    chat = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)
    want = generate(model, [[10, 20, 30], tok.encode("Once upon a time"), chat], max_new_tokens=5, temperature=0.8,
                    top_k=50, seed=3, num_samples=2)
    for g, w in zip(got, want):
        assert g["completion_ids"] == w.completion_ids and g["finish_reason"] == "length" == w.finish_reason
        np.testing.assert_allclose(g["log_probs"], w.log_probs, atol=1e-5)
        assert g["completion"] == tok.decode(w.completion_ids, skip_special_tokens=True)
    assert got[4]["messages"] == messages


def test_the_checkpoints_eos_ids_stop_rows(tmp_path, checkpoint):
    path, model = checkpoint
    free = generate(model, [[1, 2, 3, 4]], max_new_tokens=12, temperature=0)[0].completion_ids
    stop = free[2]  # greedy: rerun with it as an eos id in generation_config.json
    (tmp_path / "ckpt").mkdir()
    for f in path.iterdir():
        shutil.copy(f, tmp_path / "ckpt" / f.name)
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    code, out = _run(tmp_path, (tmp_path / "ckpt", model), [{"prompt_ids": [1, 2, 3, 4]}], "--max-new-tokens", "12",
                     "--temperature", "0")
    row = json.loads(out.read_text())
    assert code == 0 and row["finish_reason"] == "stop"
    assert row["completion_ids"] == free[:free.index(stop) + 1]


@pytest.mark.parametrize("rows,args,message", [
    ([{"prompt_ids": [1]}, {"prompt_ids": []}], [], "row 2: the prompt is empty"),
    ([{"prompt_ids": [1, 256]}], [], "row 1: token id 256 is outside the vocabulary [0, 256)"),
    ([{"prompt_ids": [1] * 20}], ["--max-length", "24"], "row 1: its 20 prompt tokens + --max-new-tokens 8 exceed "
                                                          "--max-length 24"),
    ([{"text": "x"}], [], "row 1: needs exactly one of prompt_ids, prompt, messages; has none"),
    ([{"prompt_ids": [1]}], ["--top-p", "0"], "top_p must be in (0, 1]"),
    ([{"prompt_ids": [1]}], ["--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object"),
])
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, checkpoint, capsys, rows, args, message):
    code, out = _run(tmp_path, checkpoint, rows, "--max-new-tokens", "8", *args)
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_text_without_a_tokenizer_and_chats_without_a_template(tmp_path, checkpoint, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in checkpoint[0].iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, bare / f.name)
    code, out = _run(tmp_path, (bare, None), [{"prompt_ids": [1]}, {"prompt": "hi"}])
    assert code == 2 and not out.exists()
    assert "row 2: a 'prompt' row needs a tokenizer (--tokenizer)" in capsys.readouterr().err
    no_template = tmp_path / "tok"
    no_template.mkdir()
    shutil.copy(Path(demo_tokenizer_dir()) / "tokenizer.json", no_template / "tokenizer.json")
    config = json.loads((Path(demo_tokenizer_dir()) / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    code, out = _run(tmp_path, (bare, None), [{"messages": [{"role": "user", "content": "hi"}]}],
                     "--tokenizer", str(no_template))
    assert code == 2 and not out.exists()
    assert "row 1: 'messages' need a chat template" in capsys.readouterr().err
