#!/usr/bin/env python3
"""Sample completions of JSONL prompts from a Qwen3.5 checkpoint (logic: `qwen35_jax.generation.tool`).

    python scripts/generate.py --model DIR --prompts IN.jsonl --out OUT.jsonl \
        [--max-new-tokens 256] [--temperature 1.0] [--top-k K] [--top-p P] [--seed S] [--num-samples N] \
        [--stop-token-ids 1,2] [--mesh fsdp=F,sp=S] [--batch-size R] [--tokenizer DIR] \
        [--chat-template-kwargs '{"enable_thinking": false}'] [--max-length L] [--dtype bfloat16] \
        [--min-pixels N] [--max-pixels N]

'messages' rows may hold image parts ({"type": "image", "image": "rel/path.png"}, relative to the
JSONL's folder) for a checkpoint with a vision tower.

See docs/generation.md.
"""

import sys

from qwen35_jax.generation.tool import main

if __name__ == "__main__":
    from qwen35_jax.host_memory import restart_with_huge_pages

    restart_with_huge_pages()  # as scripts/train.py: huge-page malloc for XLA:CPU's scratch buffers
    sys.exit(main())
