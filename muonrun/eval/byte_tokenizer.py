"""muonrun's byte tokenizer (UTF-8 bytes are the tokens 0-255, EOS is 256) as a transformers tokenizer,
for tools that take one: lm-evaluation-harness scores an exported byte-level model through it.

Built from the `tokenizers` library's parts: the byte-level pre-tokenizer maps each byte to one
character, a BPE model without merges maps each character to its byte's id, and EOS is an added
special token. `encode(text)` is `list(text.encode("utf-8"))`, with nothing added around it.
"""

from __future__ import annotations

EOS = "<|muonrun_eos|>"


def byte_alphabet() -> list[str]:
    """The character the byte-level pre-tokenizer writes for each byte 0..255 (GPT-2's table: printable
    bytes stand for themselves, the others are shifted past 255)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shift)
            shift += 1
    return [chars[b] for b in range(256)]


def byte_tokenizer():
    """A `PreTrainedTokenizerFast` equal to muonrun's byte tokenizer (EOS 256, no BOS, no padding token
    of its own: EOS pads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in enumerate(byte_alphabet())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=EOS)
    assert tok.eos_token_id == 256, tok.eos_token_id
    return tok
