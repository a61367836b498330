"""A transformers user's training loop and nothing else: the reference bench_train checks its own
transformers timing against (`anchor.py`).

    python plain_transformers.py CONFIG_JSON --batch 4 --seq 512 --steps 5 [--json out.json]

CONFIG_JSON is a config.json (what `Qwen35Config.to_hf_dict` writes). Written the way someone who
trains with transformers writes it: only torch and transformers are imported (no jax, no numpy, no
code of this repository), the model comes from `AutoModelForCausalLM.from_config`, the tokens from
`torch.randint`, and the loop is `loss.backward()`, `clip_grad_norm_`, `AdamW.step()` with
torch's defaults (threads, allocator, floating-point mode) untouched. One warm-up step, then the
median, min and max of --steps timed steps, as bench_train times each stack.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import transformers


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="config.json of the model (random weights)")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the timing to this file")
    args = p.parse_args()

    with open(args.config) as f:
        config = transformers.AutoConfig.for_model(**json.load(f))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))

    def train_step():
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    train_step()  # warm-up
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - start)
    result = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "transformers": transformers.__version__, "numpy_loaded": "numpy" in sys.modules,
              "jax_loaded": "jax" in sys.modules}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
