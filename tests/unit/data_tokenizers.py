"""Small hand-built tokenizers whose ids can be written out by hand in tests.

* the demo character tokenizer (``build_demo_tokenizer``): id = 6 + index of the character in
  ``"\\t\\n"`` + printable ASCII, i.e. ``ord(c) - 24`` for printable ASCII, 7 for ``"\\n"``; specials
  ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, ``<think>`` 4, ``</think>`` 5;
* :func:`chatml_bpe`: a byte-level BPE (GPT-2 pre-tokenizer) whose id of every byte is the byte value
  (so ``"a"`` is 97, ``"\\n"`` is 10, ``" "`` is 32), one merge ``h + i -> hi`` (256), specials
  ``<|endoftext|>`` 257, ``<|im_start|>`` 258, ``<|im_end|>`` 259; ``<think>`` is NOT a token, so the
  reasoning markers are token sequences. Its chat template is ChatML that does not read
  ``reasoning_content`` (the tokenizer folds reasoning into the content).
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

#: A template in the style of reasoning models that drop the reasoning of every assistant turn before
#: the last user message: not prefix-stable for multi-turn rows.
DROPS_EARLIER_REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and loop.index0 > ns.last_user "
    "and message['reasoning_content'] is defined -%}"
    "{{- '<think>' + message['reasoning_content'] + '</think>' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def chatml_bpe(chat_template: str | None = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """The byte-level BPE described in the module docstring."""
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    vocab["hi"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "i")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )
