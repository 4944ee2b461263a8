"""Small HTTP clients for the end-to-end tests (completions/chat, streaming or not)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. ",
    "In a paged KV cache, every block holds the keys and values of sixteen tokens; " * 3,
    "Disaggregated serving splits prefill and decode. " * 9,
]


@dataclass
class Result:
    status: int
    text: str = ""
    error: Optional[str] = None
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None


def generate(base_url: str, prompt: str, *, chat: bool, stream: bool, max_tokens: int = 12,
             timeout: float = 60.0, extra: Optional[dict] = None) -> Result:
    """One request (greedy unless ``extra`` says otherwise); returns the generated text or the error."""
    if chat:
        path = "/v1/chat/completions"
        body: dict = {"model": "atom-kv-tiny", "messages": [{"role": "user", "content": prompt}]}
    else:
        path = "/v1/completions"
        body = {"model": "atom-kv-tiny", "prompt": prompt}
    body.update(max_tokens=max_tokens, temperature=0, stream=stream)
    body.update(extra or {})
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raw = exc.read().decode(errors="replace")
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw
        return Result(exc.code, error=message)
    except OSError as exc:
        return Result(0, error=str(exc))
    with resp:
        if not stream:
            data = json.loads(resp.read())
            choice = data["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            return Result(resp.status, text, finish_reason=choice["finish_reason"], usage=data.get("usage"))
        pieces: list[str] = []
        finish = None
        usage = None
        done = False
        try:
            for raw_line in resp:
                line = raw_line.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    return Result(resp.status, "".join(pieces), error=event["error"].get("message"))
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
                    pieces.append(piece or "")
                    finish = choice.get("finish_reason") or finish
        except OSError as exc:
            return Result(resp.status, "".join(pieces), error=f"stream broken: {exc}")
        if not done:
            return Result(resp.status, "".join(pieces), error="stream ended without [DONE]")
        return Result(resp.status, "".join(pieces), finish_reason=finish, usage=usage)


def kv_read_floor(before: dict, after: dict, chars: int) -> float:
    """The fewest KV bytes a decode engine read, between two scrapes of its ``/metrics``, for
    prompts of ``chars`` characters in all: 4 KiB a token and at least a token a character (the
    byte tokenizer), less the tokens its own prefix cache held (it reads only the blocks it lacks)."""
    key = "atom_kv_prefix_cache_hits_total"
    return (chars - (after.get(key, 0.0) - before.get(key, 0.0))) * 4096


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
