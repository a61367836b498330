"""Online RL's pure parts: group advantages against hand-computed groups, the reward contract and its
errors, the built-in rewards, the prompt stream's order and state."""

import math

import numpy as np
import pytest

from qwen35_jax.rewards import answer_words, exact_answer, final_answer, reversed_digits
from qwen35_jax.rl.advantages import group_advantages, zero_std_fraction
from qwen35_jax.rl.prompt_stream import PromptStream
from qwen35_jax.rl.reward_fn import RewardError, call_reward, load_reward


def test_advantages_by_hand():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 0.0, 0.0]])
    std0 = math.sqrt((4 * 0.25) / 3)  # group 0: mean 0.5, Bessel-corrected std
    std2 = math.sqrt((3 * 0.75**2 + 2.25**2) / 3)  # group 2: mean 0.75
    np.testing.assert_allclose(group_advantages(rewards, "grpo"), [
        [0.5 / std0, -0.5 / std0, -0.5 / std0, 0.5 / std0], [0, 0, 0, 0],
        [-0.75 / std2, 2.25 / std2, -0.75 / std2, -0.75 / std2]], rtol=1e-5)  # eps 1e-6 in the denominator
    np.testing.assert_allclose(group_advantages(rewards, "drgrpo"), [
        [0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [-0.75, 2.25, -0.75, -0.75]])
    # rloo: reward minus the mean of the other three
    np.testing.assert_allclose(group_advantages(rewards, "rloo"), [
        [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3], [0, 0, 0, 0], [0 - 1, 3 - 0, 0 - 1, 0 - 1]])
    for method in ("grpo", "drgrpo", "rloo"):  # equal rewards: zero, never NaN
        assert np.all(group_advantages(np.full((2, 3), 0.7), method) == 0)
    assert np.all(group_advantages(np.array([[5.0], [1.0]]), "grpo") == 0)  # groups of one
    with pytest.raises(ValueError, match="rloo needs a group size of at least 2"):
        group_advantages(np.ones((2, 1)), "rloo")
    with pytest.raises(ValueError, match="advantage must be one of"):
        group_advantages(rewards, "ppo")
    assert zero_std_fraction(rewards) == 1 / 3  # the all-2.0 group
    assert zero_std_fraction(np.array([[5.0], [1.0]])) == 1.0  # a group of one has nothing to compare


def test_reward_contract_errors_name_function_row_and_problem(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def good(s):\n    return len(s['completion_ids'])\n"
                    "def raises(s):\n    raise KeyError('answer')\n"
                    "def text(s):\n    return 'high'\n"
                    "def nan(s):\n    return float('nan')\n")
    fn, name = load_reward(f"{path}:good")
    assert call_reward(fn, name, {"completion_ids": [1, 2]}, "p.jsonl row 3") == 2.0
    for function, message in (("raises", "failed on p.jsonl row 3: KeyError: 'answer'"),
                              ("text", "returned str 'high' on p.jsonl row 3, not a number"),
                              ("nan", "returned nan on p.jsonl row 3, not a finite number")):
        fn, name = load_reward(f"{path}:{function}")
        with pytest.raises(RewardError, match=f"^reward {path}:{function} ") as err:
            call_reward(fn, name, {"completion_ids": [1]}, "p.jsonl row 3")
        assert message in str(err.value) and "\n" not in str(err.value)
    assert load_reward("qwen35_jax.rewards:exact_answer")[0] is exact_answer
    for spec, message in (("nofunction", "expected FILE.py:FUNCTION"), (f"{tmp_path}/missing.py:f", "not found"),
                          ("qwen35_jax.rewards:nothing", "has no function 'nothing'"),
                          ("no_such_module_xyz:f", "cannot import no_such_module_xyz")):
        with pytest.raises(ValueError, match=message):
            load_reward(spec)


def test_exact_answer_reads_gsm8k_markers_and_boxes():
    assert final_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert final_answer("the answer is \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert final_answer("no marker") is None
    assert exact_answer({"completion": "... #### 1,000", "answer": "1000"}) == 1.0
    assert exact_answer({"completion": "... #### 1,000.0", "answer": "Janet has 1000 #### 1000"}) == 1.0
    assert exact_answer({"completion": "\\boxed{42}", "answer": 42}) == 1.0
    assert exact_answer({"completion": "#### 41", "answer": "42"}) == 0.0
    assert exact_answer({"completion": "42", "answer": "42"}) == 0.0  # no final-answer marker
    with pytest.raises(ValueError, match="needs an 'answer' field"):
        exact_answer({"completion": "#### 1"})


def test_reversed_digits_reward():
    row = {"target": [13, 12, 11, 3], "end_id": 3}
    assert reversed_digits({**row, "completion_ids": [13, 12, 11, 3]}) == 1.0
    # otherwise half the share of digits in place, over the longer of answer and completion
    assert reversed_digits({**row, "completion_ids": [13, 12, 10, 3]}) == 0.5 * 2 / 3  # one digit wrong
    assert reversed_digits({**row, "completion_ids": [13, 12, 11, 11, 3]}) == 0.5 * 3 / 4  # one digit too many
    assert reversed_digits({**row, "completion_ids": [13, 12]}) == 0.5 * 2 / 3  # cut before the last digit
    assert reversed_digits({**row, "completion_ids": [13, 12, 11]}) == 0.5  # right digits, no end token
    assert reversed_digits({**row, "completion_ids": [3]}) == 0.0


def test_answer_words_reward():
    row = {"answer": "blue triangle"}
    assert answer_words({**row, "completion": " blue  triangle\n"}) == 1.0  # whitespace is not a word
    assert answer_words({**row, "completion": "blue square"}) == 0.5
    assert answer_words({**row, "completion": "blue triangle again"}) == 2 / 3  # over the longer of the two
    assert answer_words({**row, "completion": "triangle"}) == 0.0  # a word counts in its place only
    assert answer_words({**row, "completion": ""}) == 0.0
    with pytest.raises(ValueError, match="'answer' field"):
        answer_words({"completion": "blue"})


def test_prompt_stream_order_and_resume():
    a = PromptStream(5, 3, seed=7)
    first = [a.next_prompts() for _ in range(4)]  # 12 prompts: two epochs and a bit
    assert sorted(first[0] + first[1][:2]) == [0, 1, 2, 3, 4]  # each epoch a permutation
    b = PromptStream(5, 3, seed=7)
    b.next_prompts()
    state = b.get_state()
    c = PromptStream(5, 3, seed=7)
    c.set_state(state)
    assert [c.next_prompts() for _ in range(3)] == first[1:]


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_mask_truncated_drops_cut_completions_from_the_loss_only(monkeypatch, mask_truncated):
    """--mask-truncated: a completion cut at --max-new-tokens ("length") has no loss tokens; its reward
    still counts in its group's advantages, and its tokens stay in the row."""
    from qwen35_jax.generation.api import Completion
    from qwen35_jax.generation.prompts import PromptEncoder
    from qwen35_jax.rl import rollout as rollout_module
    from qwen35_jax.rl.rollout import RolloutOptions, row_length, sample_rollouts

    rows, prompts = [{"prompt_ids": [1, 2], "_source": "row 1"}], [[1, 2]]
    sampled = [([5, 3], "stop"), ([6, 6, 6], "length"), ([7, 3], "stop")]
    monkeypatch.setattr(rollout_module, "generate", lambda model, chosen, **kw: [
        Completion(0, s, ids, [-0.5] * len(ids), why) for s, (ids, why) in enumerate(sampled)])
    options = RolloutOptions(group_size=3, max_new_tokens=3, temperature=1.0, advantage="grpo", stop_token_ids=(3,),
                             mask_truncated=mask_truncated)
    rollout = sample_rollouts(None, rows, prompts, [0], options=options, seed=0, mesh=None,
                              reward=(lambda s: float(s["completion_ids"][0]), "r"), encoder=PromptEncoder(None, 16),
                              seq_len=row_length(prompts, 3))
    mask = rollout.batch["loss_mask"].sum(axis=1)
    assert mask.tolist() == ([2, 0, 2] if mask_truncated else [2, 3, 2])
    assert rollout.batch["tokens"][1, 2:5].tolist() == [6, 6, 6] and rollout.truncated.tolist() == [False, True, False]
    np.testing.assert_allclose(rollout.batch["advantages"], [-1, 0, 1], atol=1e-5)  # rewards 5, 6, 7: std 1
