"""The demo's tokenizer: byte-level BPE trained on the demo corpus, small enough for the `tiny` preset.

A byte-level alphabet has 256 symbols, which alone would fill the tiny model's 256-entry vocabulary, so
the alphabet is printable ASCII plus tab and newline; any other byte becomes `<unk>`. The rest of the
vocabulary is special tokens and BPE merges learned from the corpus.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qwen35_jax.files import write_text_atomically

VOCAB_SIZE = 256
EOS, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, UNK]
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]  # a VLM's image placeholder tokens

# ChatML, as Qwen renders it, with `{% generation %}` around what the assistant writes so transformers
# can return the assistant-token mask directly. Roles other than system/user/assistant are refused.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- generation -%}{{ message['content'] + '<|im_end|>\\n' }}{%- endgeneration -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# The same template for a VLM: a non-assistant message's content may be a list of parts, rendered as
# Qwen's templates render them: an image part as <|vision_start|><|image_pad|><|vision_end|>, a text
# part as its text.
_PARTS = ("{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
          "{%- for part in message['content'] -%}{%- if part['type'] == 'image' -%}"
          "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- else -%}{{ part['text'] }}{%- endif -%}"
          "{%- endfor -%}{%- endif -%}")
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("'\\n' + message['content'] + '<|im_end|>\\n' }}",
                                             "'\\n' }}" + _PARTS + "{{ '<|im_end|>\\n' }}")
assert VISION_CHAT_TEMPLATE != CHAT_TEMPLATE


def _alphabet() -> list[str]:
    """The ByteLevel stand-ins of printable ASCII, tab, newline and space (bytes 0-32 map to 256 + b)."""
    return [chr(b) for b in range(33, 127)] + [chr(256 + b) for b in (9, 10, 32)]


def build_demo_tokenizer(out_dir: str, texts: Iterable[str], vocab_size: int = VOCAB_SIZE, *,
                         vision: bool = False) -> str:
    """Train the byte-level BPE on `texts` and write tokenizer.json + tokenizer_config.json to `out_dir`.
    `vision`: the VISION_TOKENS are special tokens too (ids 4-6) and the template is VISION_CHAT_TEMPLATE.

    Deterministic: the same texts give the same files. Returns `out_dir`.
    """
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    special = SPECIAL_TOKENS + (VISION_TOKENS if vision else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=_alphabet(), limit_alphabet=len(_alphabet()),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    write_text_atomically(os.path.join(out_dir, "tokenizer.json"), tokenizer.to_str(pretty=True))  # as .save
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": UNK,
        "model_max_length": 1 << 20,
        "chat_template": VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE,
    }
    write_text_atomically(os.path.join(out_dir, "tokenizer_config.json"), json.dumps(config, indent=1))
    return out_dir
