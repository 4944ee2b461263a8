"""The benches' streaming client: one streamed completion over ``http.client``, timed from the client's side.

Shared by ``bench e2e --breakdown`` (TTFT and time to the second token, the engine's ``Server-Timing``),
``bench vllm`` (TTFT as the first event that carries a choice) and ``bench routing`` (TTFT and the answer's
text), and :func:`in_threads` sends a batch of them.
"""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

from atom_kv.server_timing import parse_server_timing

__all__ = ["StreamedCompletion", "in_threads", "stream_completion"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class StreamedCompletion:
    """When one streamed completion's events came, in seconds from the request's send."""

    first_choice: float = 0.0  # the first event carrying a choice, text or not (0: none did)
    texts: list[tuple[float, int]] = field(default_factory=list)  # (when, characters) of each event with text
    server_timing: dict[str, float] = field(default_factory=dict)  # the answer's Server-Timing spans
    text: str = ""  # the answer's text, every event's joined


def stream_completion(base_url: str, body: dict[str, Any], timeout: float) -> StreamedCompletion:
    """``POST /v1/completions`` with ``body`` plus ``"stream": true``; raises RuntimeError for an answer other
    than 200 or an error event. ``timeout`` bounds the connect and every read."""
    url = urlsplit(base_url)
    if url.hostname is None:
        raise ValueError(f"stream_completion: base_url must be an http://host:port URL, got {base_url!r}")
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    data = json.dumps({**body, "stream": True})
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{base_url} answered {resp.status}: {resp.read()[:300]!r}")
        out = StreamedCompletion(server_timing=parse_server_timing(resp.getheader("Server-Timing") or ""))
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                raise RuntimeError(f"{base_url}: {error.get('message', error) if isinstance(error, dict) else error}")
            choices = event.get("choices")
            if not choices:
                continue
            now = time.perf_counter() - start
            if not out.first_choice:
                out.first_choice = now
            text = "".join(c.get("text") or "" for c in choices)
            if text:
                out.texts.append((now, len(text)))
                out.text += text
        return out
    finally:
        conn.close()


def in_threads(fn: Callable[[T], R], items: list[T], workers: int, name: str) -> list[R]:
    """``fn`` over ``items`` on ``workers`` named threads at once (in this thread when one is enough), in order."""
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
        return list(pool.map(fn, items))
