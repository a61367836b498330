"""The online RL demo, `python scripts/train.py --demo grpo`: a tiny Qwen3.5 learns to reverse a string
of digits. A short SFT run teaches it the format from a few worked examples; online GRPO then trains it
on prompts alone, with `qwen35_jax.rewards:reversed_digits` as the reward, and the held-out greedy
accuracy before and after GRPO is printed with a few completions.

Token ids (no tokenizer): 1 starts a prompt, 2 ends it ("="), 3 ends the answer, 10 + d is digit d.
A prompt is [1, d1 .. dn, 2]; the answer is [dn .. d1, 3].
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

START, EQUALS, END, DIGIT0 = 1, 2, 3, 10
LENGTHS = (3, 4, 5)
OUT = os.path.join("runs", "demo-grpo")
SFT_EXAMPLES = 2000
SFT_OPTIONS: dict[str, Any] = dict(  # deliberately short: the answer's format, not yet the skill
    preset="tiny", steps=45, lr=3e-3, warmup_steps=5, final_lr_ratio=0.3, batch_size=16, seq_len=64, save_every=60,
    seed=0)
# Sampling at T = 0.5: at T = 1 the briefly trained model's samples are mostly noise (entropy about 3
# nats a token) and the updates then mostly push failures down; so does a large learning rate.
GRPO_OPTIONS: dict[str, Any] = dict(
    objective="grpo", reward="qwen35_jax.rewards:reversed_digits", group_size=8, batch_size=128, max_new_tokens=8,
    temperature=0.5, lr=3e-4, warmup_steps=0, final_lr_ratio=1.0, steps=60, save_every=20, eval_every=20,
    stop_token_ids=str(END), clip_ratio=0.2, seed=0)
SHOWN = 4


def task_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """n prompts with their answers: {"prompt_ids", "digits", "target", "end_id"} (ids as above)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        digits = [DIGIT0 + int(d) for d in rng.integers(0, 10, size=int(rng.choice(LENGTHS)))]
        rows.append({"prompt_ids": [START, *digits, EQUALS], "digits": digits, "target": digits[::-1] + [END],
                     "end_id": END})
    return rows


def _write(path: str, rows: list[dict[str, Any]]) -> str:
    from qwen35_jax.files import replaced_atomically

    with replaced_atomically(path) as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def write_task(directory: str) -> dict[str, str]:
    """The demo's files: SFT examples (input_ids + loss_mask on the answer), RL prompts, held-out prompts."""
    os.makedirs(directory, exist_ok=True)
    sft = []
    for row in task_rows(SFT_EXAMPLES, seed=1):
        ids = row["prompt_ids"] + row["target"]
        mask = [0] * (len(row["prompt_ids"]) - 1) + [1] * len(row["target"]) + [0]  # entry t trains token t + 1
        sft.append({"input_ids": ids, "loss_mask": mask})
    return {"sft": _write(os.path.join(directory, "sft.jsonl"), sft),
            "prompts": _write(os.path.join(directory, "prompts.jsonl"), task_rows(2000, seed=2)),
            "heldout": _write(os.path.join(directory, "heldout.jsonl"), task_rows(64, seed=3))}


def greedy_accuracy(run_dir: str, heldout: str, mesh: Any) -> tuple[float, list[str]]:
    """(exact-answer rate of greedy completions on the held-out prompts, a few of them as text)."""
    from qwen35_jax.checkpoint import load_model
    from qwen35_jax.generation import generate

    model, _ = load_model(run_dir, mesh=mesh)
    with open(heldout) as f:
        rows = [json.loads(line) for line in f]
    out = generate(model, [r["prompt_ids"] for r in rows], max_new_tokens=GRPO_OPTIONS["max_new_tokens"],
                   temperature=0, stop_token_ids=[END], mesh=mesh)
    right = [c.completion_ids == r["target"] for r, c in zip(rows, out)]

    def text(ids: list[int]) -> str:
        return "".join(str(t - DIGIT0) if t >= DIGIT0 else {END: "$", EQUALS: "="}.get(t, f"<{t}>") for t in ids)

    shown = [f"{text(r['digits'])} -> {text(c.completion_ids)} ({'right' if ok else 'wrong'})"
             for r, c, ok in list(zip(rows, out, right))[:SHOWN]]
    return float(np.mean(right)), shown


def run_demo(stop: Any, out: str = OUT) -> int:
    """SFT, then GRPO; prints the held-out greedy accuracy of each. The process exit code."""
    from qwen35_jax.demos.sft import corpus_dir, simulate_cpu_devices

    simulate_cpu_devices()
    import jax

    from qwen35_jax.objectives import train
    from qwen35_jax.parallel.mesh import make_mesh
    from qwen35_jax.train.options import TrainOptions

    files = write_task(os.path.join(os.path.dirname(corpus_dir()), "digit-reversal"))
    mesh_spec = "fsdp=8" if jax.default_backend() == "cpu" else None
    sft_dir, rl_dir = os.path.join(out, "sft"), os.path.join(out, "grpo")
    print(f"1/2 SFT, {SFT_OPTIONS['steps']} steps: the tiny model learns the answer's format from worked examples",
          flush=True)
    code = train(TrainOptions(**SFT_OPTIONS, data=[files["sft"]], out=sft_dir, mesh=mesh_spec), stop)
    if code or stop.signal_name is not None:
        return code
    mesh = make_mesh(mesh_spec)
    before, shown_before = greedy_accuracy(sft_dir, files["heldout"], mesh)
    print(f"held-out greedy accuracy after SFT: {before:.0%}", flush=True)
    print("2/2 online GRPO on prompts alone, reward qwen35_jax.rewards:reversed_digits", flush=True)
    code = train(TrainOptions(**GRPO_OPTIONS, model=sft_dir, data=[files["prompts"]], eval_data=[files["heldout"]],
                              out=rl_dir, mesh=mesh_spec), stop)
    if code or stop.signal_name is not None:
        return code
    after, shown_after = greedy_accuracy(rl_dir, files["heldout"], mesh)
    print(f"held-out greedy accuracy (exact reversal, {len(LENGTHS)} lengths): after SFT {before:.0%}, "
          f"after GRPO {after:.0%}", flush=True)
    for b, a in zip(shown_before, shown_after):
        print(f"  after SFT: {b:<28} after GRPO: {a}", flush=True)
    return 0
