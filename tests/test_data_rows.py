"""Each JSONL row kind becomes the right tokens and loss mask; both ways of finding assistant tokens agree."""

import numpy as np
import pytest

from data_testutil import VOCAB, demo_tokenizer, demo_tokenizer_dir
from qwen35_jax.data.chat_masks import (assistant_mask, assistant_mask_by_prefixes, assistant_mask_from_markers,
                                        has_generation_markers)
from qwen35_jax.data.rows import BadRow, RowEncoder

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does the fox eat?"},
        {"role": "assistant", "content": "The fox eats berries."},
        {"role": "user", "content": "And the owl?"},
        {"role": "assistant", "content": "Mice."}]


@pytest.fixture(scope="module")
def encoder():
    return RowEncoder(demo_tokenizer_dir(), VOCAB)


def test_text_row_ends_in_eos_and_trains_every_prediction(encoder):
    tok = demo_tokenizer()
    tokens, loss_mask = encoder.encode({"text": "The fox eats berries."})
    expected = tok("The fox eats berries.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tokens.tolist() == expected
    assert loss_mask.tolist() == [1] * (len(expected) - 1) + [0]


def test_input_ids_rows_with_and_without_mask(encoder):
    tokens, loss_mask = encoder.encode({"input_ids": [5, 6, 7, 8]})
    assert tokens.tolist() == [5, 6, 7, 8] and loss_mask.tolist() == [1, 1, 1, 0]
    tokens, loss_mask = encoder.encode({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 0]})
    assert loss_mask.tolist() == [0, 1, 1, 0]


def test_prompt_response_trains_only_the_response_and_eos(encoder):
    tok = demo_tokenizer()
    prompt = tok("Q: fox?", add_special_tokens=False)["input_ids"]
    response = tok(" berries", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    tokens, loss_mask = encoder.encode({"prompt": "Q: fox?", "response": " berries"})
    assert tokens.tolist() == prompt + response
    # entry t trains token t + 1: the last prompt token predicts the first response token
    assert loss_mask.tolist() == [0] * (len(prompt) - 1) + [1] * len(response) + [0]


def test_messages_train_only_what_the_assistant_wrote(encoder):
    tok = demo_tokenizer()
    tokens, loss_mask = encoder.encode({"messages": CHAT})
    trained = tokens[1:][loss_mask[:-1] == 1]  # the tokens whose prediction has loss
    assert tok.decode(trained) == "The fox eats berries.<|im_end|>\nMice.<|im_end|>\n"


def test_markers_and_prefix_rendering_agree():
    tok = demo_tokenizer()
    assert has_generation_markers(tok)
    for messages in (CHAT, CHAT[1:3], CHAT[1:]):
        ids_m, mask_m = assistant_mask_from_markers(tok, messages)
        ids_p, mask_p = assistant_mask_by_prefixes(tok, messages)
        assert ids_m.tolist() == ids_p.tolist()
        assert mask_m.tolist() == mask_p.tolist() and mask_m.sum() > 0


def test_template_without_markers_uses_prefix_rendering():
    import copy

    tok = copy.deepcopy(demo_tokenizer())
    with_markers = assistant_mask(tok, CHAT)
    tok.chat_template = tok.chat_template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    assert not has_generation_markers(tok)
    without = assistant_mask(tok, CHAT)
    assert with_markers[0].tolist() == without[0].tolist() and with_markers[1].tolist() == without[1].tolist()


# Like Qwen3's templates: the assistant turns after the last user message open with an empty thinking
# block, earlier ones do not, so a prefix of the conversation is not always the start of the whole.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=0) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_user -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_prefix_rendering_follows_a_template_that_rewrites_earlier_turns():
    import copy

    tok = copy.deepcopy(demo_tokenizer())
    tok.chat_template = THINKING_TEMPLATE
    ids, mask = assistant_mask(tok, CHAT)
    trained = tok.decode(ids[mask == 1])
    assert trained == "The fox eats berries.<|im_end|>\n<think>\n\n</think>\n\nMice.<|im_end|>\n"


@pytest.mark.parametrize("line, reason", [
    (b'{"text": "unterminated', "invalid JSON"),
    (b'[1, 2]', "expected a JSON object"),
    (b'{"txt": "typo"}', "no 'text', 'input_ids', 'messages'"),
    (b'{"prompt": "only a prompt"}', "'response' is missing"),
    (b'{"messages": []}', "'messages' must be a non-empty list"),
    (b'{"messages": [{"role": "user"}]}', "message 0 needs a string 'role' and a string 'content'"),
    (b'{"messages": [{"role": "robot", "content": "beep"}]}', "unsupported role: robot"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "nothing to train on"),
    (b'{"input_ids": [1, 2, 256]}', "token id 256 is outside the vocabulary [0, 256)"),
    (b'{"input_ids": [1, -3]}', "token id -3 is outside"),
    (b'{"input_ids": [1, 2.5]}', "must hold only integers"),
    (b'{"input_ids": [1, 2], "loss_mask": [1]}', "loss_mask has 1 entries"),
    (b'{"input_ids": [1, 2], "loss_mask": [0, 1]}', "loss_mask ends in 1"),
    (b'{"text": 7}', "'text' must be a string"),
])
def test_bad_rows_say_why(encoder, line, reason):
    with pytest.raises(BadRow) as err:
        encoder.encode_line(line)
    assert reason in str(err.value)


def test_rows_needing_a_tokenizer_without_one_are_bad():
    with pytest.raises(BadRow, match="need a tokenizer"):
        RowEncoder(None, VOCAB).encode({"text": "hello"})
    tokens, _ = RowEncoder(None, VOCAB).encode({"input_ids": [1, 2, 3]})
    assert tokens.dtype == np.int32
