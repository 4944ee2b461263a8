"""A Hugging Face tokenizer directory that maps text to the reference engine's token ids.

The reference engine is byte-level (:class:`atom_kv.reference.tokenizer.ByteTokenizer`): one id per UTF-8
byte (0..255). An outside client that counts tokens with a Hugging Face tokenizer (aiperf's ``--tokenizer
PATH``) gets the same ids from :func:`write`'s directory: a ``tokenizer.json`` (byte-level BPE with no
merges, GPT-2's byte-to-character table, byte ``b`` as id ``b``) and a ``tokenizer_config.json`` naming
``PreTrainedTokenizerFast``. It has no special tokens: an added token would be matched inside the text,
where the engine sees plain bytes (the engine's BOS is its own, outside the prompt's text). It is plain
JSON, so writing it needs no library; nothing is downloaded.
"""

from __future__ import annotations

import json
import os


__all__ = ["byte_to_char", "write"]


def byte_to_char() -> dict[int, str]:
    """GPT-2's table (what the ``ByteLevel`` pre-tokenizer uses): each byte as one printable character."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _tokenizer_json() -> dict:
    vocab = {ch: b for b, ch in byte_to_char().items()}
    assert len(vocab) == 256  # every byte its own character, so its own id
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def write(folder: str) -> str:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder`` (made if missing); returns it."""
    os.makedirs(folder, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
              "clean_up_tokenization_spaces": False}
    for name, doc in (("tokenizer.json", _tokenizer_json()), ("tokenizer_config.json", config)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)
    return folder
