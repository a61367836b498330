"""Each JSONL row kind becomes the right tokens and loss mask; both ways of finding assistant tokens agree."""

import numpy as np
import pytest

from data_testutil import VOCAB, demo_tokenizer, demo_tokenizer_dir
from qwen35_jax.data.chat_masks import (assistant_mask, assistant_mask_by_prefixes, assistant_mask_from_markers,
                                        has_generation_markers)
from qwen35_jax.data.rows import BadRow, PromptEncoder, RowEncoder

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


def _bos_adding_tokenizer():
    """The demo tokenizer made to add a BOS (<|endoftext|>) when asked for special tokens, as Llama's do."""
    import copy

    from tokenizers import processors

    tok = copy.deepcopy(demo_tokenizer())
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.eos_token_id)])
    assert tok.encode("fox")[0] == tok.eos_token_id  # the special token is really added
    return tok


def test_a_prompt_row_gets_the_prompt_ids_of_a_prompt_response_training_row():
    # One tokenization for training rows and prompts (generation, online RL): text as is, no special
    # tokens, so a model trained on prompt/response rows is prompted with the ids it was trained on.
    for tok in (demo_tokenizer(), _bos_adding_tokenizer()):
        prompt_ids = PromptEncoder(tok, VOCAB).encode({"prompt": "Q: fox?"})
        tokens, loss_mask = RowEncoder(demo_tokenizer_dir(), VOCAB, loaded=tok).encode(
            {"prompt": "Q: fox?", "response": " berries"})
        assert prompt_ids == tok("Q: fox?", add_special_tokens=False)["input_ids"]
        assert tokens[:len(prompt_ids)].tolist() == prompt_ids and loss_mask[:len(prompt_ids) - 1].sum() == 0


def test_a_chat_prompt_is_rendered_with_the_template_and_its_generation_prompt():
    tok = demo_tokenizer()
    messages = CHAT[:2]
    ids = PromptEncoder(tok, VOCAB).encode({"messages": messages})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    # the training row of the same conversation plus the answer starts with exactly these ids
    tokens, _ = RowEncoder(demo_tokenizer_dir(), VOCAB, loaded=tok).encode({"messages": CHAT[:3]})
    assert tokens[:len(ids)].tolist() == ids


def test_chat_template_kwargs_reach_the_template():
    import copy

    tok = copy.deepcopy(demo_tokenizer())
    tok.chat_template = THINKING_TEMPLATE.replace(
        "{{ '<|im_start|>assistant\\n' }}", "{{ '<|im_start|>assistant\\n' + ('' if thinking else '<think></think>') }}")
    plain = PromptEncoder(tok, VOCAB).encode({"messages": CHAT[1:2]})
    thinking = PromptEncoder(tok, VOCAB, chat_template_kwargs={"thinking": True}).encode({"messages": CHAT[1:2]})
    assert tok.decode(plain).endswith("<|im_start|>assistant\n<think></think>")
    assert tok.decode(thinking).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("row, reason", [
    ({"text": "x"}, "needs exactly one of prompt_ids, prompt, messages; has none"),
    ({"prompt": "x", "prompt_ids": [1]}, "needs exactly one of"),
    ({"prompt_ids": [1, 2.5]}, "'prompt_ids' must be a list of integers"),
    ({"prompt_ids": []}, "the prompt is empty"),
    ({"prompt_ids": [1, 256]}, "token id 256 is outside the vocabulary [0, 256)"),
    ({"prompt": 7}, "'prompt' must be a string"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "message 0 needs a string 'role' and a string 'content'"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, "the chat template failed on 'messages' (unsupported role"),
])
def test_bad_prompt_rows_say_why(row, reason):
    with pytest.raises(BadRow) as err:
        PromptEncoder(demo_tokenizer(), VOCAB).encode(row)
    assert reason in str(err.value)


def test_prompts_needing_a_tokenizer_or_a_template_without_one_are_bad():
    import copy

    assert PromptEncoder(None, VOCAB).encode({"prompt_ids": [1, 2]}) == [1, 2]
    with pytest.raises(BadRow, match="a 'prompt' row needs a tokenizer"):
        PromptEncoder(None, VOCAB).encode({"prompt": "hello"})
    tok = copy.deepcopy(demo_tokenizer())
    tok.chat_template = None
    for encode in (PromptEncoder(tok, VOCAB, tokenizer_source="DIR").encode,
                   RowEncoder("DIR", VOCAB, loaded=tok).encode):
        with pytest.raises(BadRow, match="'messages' need a chat template; the tokenizer at DIR has none"):
            encode({"messages": CHAT})
