"""A transformers user's vision-tower training step and nothing else: the reference bench_vision.py
checks its own transformers timing against (as `plain_transformers.py` is for bench_train.py).

    python -P plain_vision.py CONFIG_JSON INPUTS_PT --steps 5 [--json out.json]

CONFIG_JSON is a Qwen3.5 `vision_config` dict (what `VisionConfig.to_hf_dict` writes); INPUTS_PT a
`torch.save`d dict with the tower's weights ("state"), the patches [P, patch_dim] ("patches"), the
images' grid_thw [N, 3] ("grid_thw") and the fixed output weights [P / merge_unit, out] ("weights"),
the same ones bench_vision.py gives both of its stacks. Written the way someone who trains the tower
with transformers writes it: only torch and transformers are imported (no jax, no numpy, no code of
this repository), the model is `Qwen3_5VisionModel` on the sdpa attention its users get by default,
and the step is `zero_grad()`, forward, `(pooler_output * weights).sum().backward()` with torch's
defaults (threads, allocator, floating-point mode) untouched. One warm-up step, then the median,
min and max of --steps timed steps, as bench_vision times each stack.
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
    p.add_argument("config", help="the vision_config dict, as JSON")
    p.add_argument("inputs", help="weights and inputs, torch.save'd by bench_vision.py")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the timing to this file")
    args = p.parse_args()

    with open(args.config) as f:
        raw = json.load(f)
    raw.pop("model_type", None)
    config = transformers.Qwen3_5VisionConfig(**raw, attn_implementation="sdpa")
    model = transformers.Qwen3_5VisionModel(config)
    data = torch.load(args.inputs, weights_only=True)
    model.load_state_dict(data["state"])
    model.train()
    patches, grid_thw, weights = data["patches"], data["grid_thw"], data["weights"]

    def train_step():
        model.zero_grad()
        out = model(patches, grid_thw=grid_thw).pooler_output
        (out * weights).sum().backward()

    train_step()  # warm-up
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - start)
    result = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "transformers": transformers.__version__, "attn_implementation": model.config._attn_implementation,
              "numpy_loaded": "numpy" in sys.modules, "jax_loaded": "jax" in sys.modules}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
