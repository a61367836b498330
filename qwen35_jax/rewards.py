"""Built-in reward functions for `scripts/train.py --objective grpo --reward qwen35_jax.rewards:NAME`.

Each takes one sample dict (see `qwen35_jax.rl.reward_fn`) and returns a float.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER_NOISE = re.compile(r"[,\s$]")


def final_answer(text: str) -> str | None:
    """The answer a completion ends on: the text after its last "####" (GSM8K's marker), else the
    contents of its last \\boxed{...}, else None."""
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else ""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def _normalise(answer: str) -> str:
    answer = _NUMBER_NOISE.sub("", answer).rstrip(".")
    try:
        number = float(answer)
    except ValueError:
        return answer
    return str(int(number)) if number.is_integer() else str(number)


def exact_answer(sample: dict[str, Any]) -> float:
    """1.0 when the completion's final answer (after "####" or in the last \\boxed{}) equals the row's
    `answer` (itself possibly in GSM8K's "reasoning #### 42" form), compared after removing commas,
    spaces and "$" and reading numbers as numbers (so "1,000" = "1000.0"); else 0.0."""
    if "completion" not in sample:
        raise ValueError("exact_answer needs the completion text: give the run a tokenizer")
    if "answer" not in sample:
        raise ValueError("exact_answer needs an 'answer' field in the data row")
    got = final_answer(sample["completion"])
    want = str(sample["answer"])
    if "####" in want:
        want = final_answer(want) or ""
    return float(got is not None and _normalise(got) == _normalise(want))


def reversed_digits(sample: dict[str, Any]) -> float:
    """The RL demo's task (`qwen35_jax.demos.grpo`): the completion should be the prompt's digits reversed,
    then the end token. The row's `target` holds the answer's ids and `end_id` the end token's. 1.0 for
    the exact answer; otherwise, with the completion read up to its end token, half the share of digits
    in their right place, counted against the longer of the answer and the completion (extra digits
    cost as much as missing ones)."""
    end = sample["end_id"]
    want = [t for t in sample["target"] if t != end]
    got = list(sample["completion_ids"])
    got = got[:got.index(end)] if end in got else got
    if got == want and end in sample["completion_ids"]:
        return 1.0
    right = sum(a == b for a, b in zip(got, want))
    return 0.5 * right / max(len(got), len(want))


def answer_words(sample: dict[str, Any]) -> float:
    """A short answer's words: the share of the row's `answer` words that the completion text has in
    their place, counted against the longer of the two (extra words cost as much as missing ones), so
    1.0 exactly when the completion's words are the answer's. The vision demo's reward
    (`qwen35_jax.demos.vision`: "blue triangle" scores 0.5 for "blue square" or "blue triangle again")."""
    if "completion" not in sample:
        raise ValueError("answer_words needs the completion text: give the run a tokenizer")
    if "answer" not in sample:
        raise ValueError("answer_words needs an 'answer' field in the data row")
    got, want = sample["completion"].split(), str(sample["answer"]).split()
    if not got and not want:
        return 1.0
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))
