"""The embedded demo: `python scripts/train.py` with no model or data trains the `tiny` preset from
random init on the generated demo corpus (qwen35_jax.data.demo) with its byte-level BPE tokenizer,
on an fsdp=2 x sp=4 mesh of simulated CPU devices when the machine has only a CPU, and ends by showing
what the model learned: held-out loss and the log-probs of right and wrong continuations, before and
after training, and both models' greedy continuations of held-out text.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

DEMO_OUT = os.path.join("runs", "demo")
CPU_DEVICES = 8
# The schedule belongs to the run, so `--steps 40` follows the first 40 steps of this same curve.
DEMO_OPTIONS: dict[str, Any] = dict(
    preset="tiny", out=DEMO_OUT, steps=300, schedule_steps=300, lr=3e-3, warmup_steps=10, final_lr_ratio=0.1,
    weight_decay=0.01, batch_size=8, seq_len=256, save_every=100, eval_every=50, eval_batches=2, seed=0)
RUN_DEFINING_INPUTS = ("model", "preset", "data", "synthetic")


def is_demo(given: dict[str, Any]) -> bool:
    """Whether options given on the command line (or a config file) leave model and data unset."""
    return not any(given.get(name) for name in RUN_DEFINING_INPUTS)


def corpus_dir() -> str:
    """Where the demo corpus and tokenizer are written (the same files every time, so reruns resume)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "qwen35-jax", "demo-corpus")


def simulate_cpu_devices() -> None:
    """CPU_DEVICES simulated devices on the CPU platform, unless XLA_FLAGS already says how many
    (no effect on a GPU or TPU). Before jax is imported: the device count is read once."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={CPU_DEVICES}".strip()


def demo_defaults() -> dict[str, Any]:
    """The demo's options, its corpus materialised (deterministic) and on 8 simulated CPU devices
    unless an accelerator is present. Call before jax is imported (the device count is read once)."""
    from qwen35_jax.data.demo import demo_corpus

    train_files, heldout_files, tokenizer = demo_corpus(corpus_dir())
    simulate_cpu_devices()
    import jax
    mesh = "fsdp=2,sp=4" if jax.default_backend() == "cpu" else None
    return {**DEMO_OPTIONS, "data": train_files, "eval_data": heldout_files, "tokenizer": tokenizer, "mesh": mesh}


def _probe_scores(params: Any, graphdef: Any, mesh: Any, tokenizer: Any,
                  texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per-text (sum of log-probs of every token after the first, token counts)."""
    from flax import nnx

    from qwen35_jax.scoring import score_batches

    ids = [tokenizer.encode(t).ids for t in texts]
    width = max(len(i) for i in ids)
    tokens = np.zeros((len(ids), width), np.int32)
    segments = np.zeros((len(ids), width), np.int32)
    for row, seq in enumerate(ids):
        tokens[row, :len(seq)], segments[row, :len(seq)] = seq, 1
    log_probs, _ = score_batches(nnx.merge(graphdef, params), tokens, segments, mesh=mesh)
    return log_probs.sum(axis=1), np.maximum(segments.sum(axis=1) - 1, 1)


CONTINUATIONS = 3  # held-out texts whose opening both models continue
OPENING_WORDS = 8
NEW_TOKENS = 24


def held_out_openings(eval_files: list[str]) -> list[str]:
    """The first words of the first few held-out texts (the prompts of the demo's continuations)."""
    import json

    texts: list[str] = []
    for path in eval_files:
        with open(path) as f:
            texts += [json.loads(line)["text"] for line in f if line.strip()][:CONTINUATIONS - len(texts)]
    return [" ".join(t.split()[:OPENING_WORDS]) for t in texts]


def _continuations(models: dict[str, Any], tokenizer: Any, openings: list[str], mesh: Any) -> list[str]:
    """Greedy continuations of each opening by each model, as printable lines."""
    from qwen35_jax.generation import generate

    eos = tokenizer.token_to_id("<|endoftext|>")
    prompts = [tokenizer.encode(t).ids for t in openings]
    outs = {name: generate(model, prompts, max_new_tokens=NEW_TOKENS, temperature=0, mesh=mesh,
                           stop_token_ids=None if eos is None else [eos])
            for name, model in models.items()}
    lines = [f"continuations of held-out text (greedy, up to {NEW_TOKENS} tokens):"]
    for i, opening in enumerate(openings):
        lines.append(f"  '{opening}'")
        for name, out in outs.items():
            lines.append(f"    {name:>11}: ...{tokenizer.decode(out[i].completion_ids)!r}")
    return lines


def show_what_it_learned(run_dir: str, tokenizer_dir: str, mesh: Any, eval_files: list[str] | None = None
                         ) -> list[str]:
    """Lines comparing the random init with the trained model on the demo's probes:
    per-token log-prob of held-out text and, per prompt, the right vs the wrong continuation; then
    both models' greedy continuations of the openings of a few held-out texts (`eval_files`)."""
    import jax
    from flax import nnx
    from tokenizers import Tokenizer

    from qwen35_jax.checkpoint import load_checkpoint
    from qwen35_jax.data.demo import probes
    from qwen35_jax.model import Qwen35ForCausalLM
    from qwen35_jax.parallel.mesh import create_sharded

    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    trained, config, _ = load_checkpoint(run_dir, mesh=mesh)
    init = create_sharded(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(DEMO_OPTIONS["seed"])), mesh)
    pairs = probes()
    texts = [p + r for p, r, _ in pairs] + [p + w for p, _, w in pairs]
    lines = []
    with jax.set_mesh(mesh):
        results = {}
        for name, model in (("random init", init), ("trained", trained)):
            total, count = _probe_scores(nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.graphdef(model), mesh,
                                         tokenizer, texts)
            right, wrong = total[:len(pairs)], total[len(pairs):]
            results[name] = (float((right > wrong).mean()), float((total / count).mean()))
    for name, (accuracy, per_token) in results.items():
        lines.append(f"  {name:>11}: right continuation preferred in {accuracy:.0%} of {len(pairs)} probes "
                     f"('{pairs[0][0]}{pairs[0][1]}' vs '{pairs[0][2].strip()}'), mean log-prob per token {per_token:.3f}")
    if eval_files:
        lines += _continuations({"random init": init, "trained": trained}, tokenizer, held_out_openings(eval_files),
                                mesh)
    return lines


def report(options: Any) -> None:
    """Print what the demo run learned (after a completed `train(options)`)."""
    from qwen35_jax.parallel.mesh import make_mesh

    print("what the model learned (generated held-out probes, random init vs trained):", flush=True)
    for line in show_what_it_learned(options.out, options.tokenizer, make_mesh(options.mesh), options.eval_data):
        print(line, flush=True)
