"""``--tokenizer PATH``: the proxy's own tokenizer, a Hugging Face ``tokenizer.json`` read with the
``tokenizers`` library (imported only when the flag is given; ``pip install tokenizers``).

PATH is a ``tokenizer.json`` file or a model folder holding one. A folder's chat template
(``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``) is applied to chat
``messages`` the way engines apply it (a sandboxed Jinja2 render with ``add_generation_prompt``, then
encoded without special tokens); without a template a chat prompt is not tokenized here (the engine's
``/tokenize`` is asked instead). Completion prompts are encoded with the special tokens, as vLLM does.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

__all__ = ["HfTokenizer", "TokenizerError"]


class TokenizerError(ValueError):
    """``--tokenizer`` cannot be used (the message names the flag and what to do)."""


def _token_text(value: Any) -> Optional[str]:
    """A special token from tokenizer_config.json: a string or an AddedToken map."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(folder: str, config: dict) -> Optional[str]:
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    found = config.get("chat_template")
    if isinstance(found, str):
        return found
    if isinstance(found, list):  # named templates: the default one
        for entry in found:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"]
    return None


class HfTokenizer:
    """Owns one loaded ``tokenizers.Tokenizer`` and the folder's chat template (compiled once)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError("--tokenizer needs the `tokenizers` package: pip install tokenizers "
                                 "(or leave --tokenizer out: the proxy then asks the engines' /tokenize)") from None
        folder, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else (
            os.path.dirname(path) or ".", path)
        if not os.path.isfile(file):
            raise TokenizerError(f"--tokenizer: no tokenizer.json at {file!r} (give a tokenizer.json file or a "
                                 "model folder that holds one)")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as exc:  # the library's own error types vary by version
            raise TokenizerError(f"--tokenizer: {file!r} is not a readable Hugging Face tokenizer.json "
                                 f"({type(exc).__name__})") from None
        config: dict = {}
        config_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    loaded = json.load(f)
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"--tokenizer: {config_path!r} is not valid JSON ({exc})") from None
            config = loaded if isinstance(loaded, dict) else {}
        self._specials = {name: _token_text(config.get(name)) or "" for name in ("bos_token", "eos_token")}
        template = _chat_template(folder, config)
        self._template = None
        if template is not None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(template)
            except TemplateError as exc:
                raise TokenizerError(f"--tokenizer: the chat template in {folder!r} does not compile ({exc})") \
                    from None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids (with the tokenizer's special tokens, e.g. BOS)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_chat(self, messages: list[Any]) -> Optional[list[int]]:
        """A chat's ids through the chat template (None: no template, or it refused these messages)."""
        if self._template is None:
            return None
        from jinja2.exceptions import TemplateError

        try:
            text = self._template.render(messages=messages, add_generation_prompt=True, **self._specials)
        except (TemplateError, TypeError, ValueError):
            return None
        return self._tok.encode(text, add_special_tokens=False).ids


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)
