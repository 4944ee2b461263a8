"""Stream one greedy completion (or chat) through the proxy with the openai client.

    python examples/stream_client.py --url http://127.0.0.1:10001 "Tell me a story"
    python examples/stream_client.py --chat --max-tokens 64 "What is disaggregated serving?"
"""

from __future__ import annotations

import argparse
import sys
import time

from openai import OpenAI


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--url", default="http://127.0.0.1:10001", help="proxy (or engine) base URL")
    p.add_argument("--model", default="atom-kv-tiny")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    args = p.parse_args()
    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=120)
    start = time.perf_counter()
    first = None
    n = 0
    if args.chat:
        stream = client.chat.completions.create(
            model=args.model, messages=[{"role": "user", "content": args.prompt}],
            max_tokens=args.max_tokens, temperature=0, stream=True)
        pieces = (c.choices[0].delta.content for c in stream if c.choices)
    else:
        stream = client.completions.create(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                                           temperature=0, stream=True)
        pieces = (c.choices[0].text for c in stream if c.choices)
    for piece in pieces:
        if not piece:
            continue
        if first is None:
            first = time.perf_counter() - start
        n += len(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    total = time.perf_counter() - start
    print(f"\n\n{n} tokens, time to first token {1e3 * (first or 0):.0f} ms, total {total:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
