"""A small but real paged-KV inference engine that uses ``atom_kv.engine_hooks``.

Run it with ``python -m atom_kv.reference --host H --port P``. It owns a tiny
Llama-style model with deterministic random weights, a byte-level tokenizer,
a paged KV cache, a continuous-batching scheduler, tensor-parallel worker
processes and an OpenAI-compatible HTTP server. It needs torch:
``pip install 'atom-kv[reference]'``.
"""

import sys

from atom_kv.extras import MissingExtraError, require

try:
    require("torch", extra="reference", feature="the reference engine")
except MissingExtraError as _exc:
    if sys.argv[:1] == ["-m"]:  # `python -m atom_kv.reference` is being located: one line, no traceback
        raise SystemExit(f"error: {_exc}") from None
    raise
