"""The prefill's first token, carried with the KV handoff so the decode engine never recomputes it.

A prefill engine passes the token it sampled to its connector
(``request_finished(first_token_ids=...)``), which adds it to the
``kv_transfer_params`` it answers with (``first_token_ids``) and to the
rendezvous answer. A decode engine that gets them with a full remote prefill
appends that token once the KV is in: it computes nothing for the last prompt
position again, and its first step produces the second token. A decode leg
sent before its prefill finished (``first_token_pending``) gets the token
with the blocks, and appends and streams it at once, while the KV still
loads. ``first_token_sent`` (set by the proxy) means the client already has
the token's text, so a streamed answer leaves it out.

Sampling is per position (see :class:`~atom_kv.reference.sampling.Sampler`),
so with a seed every position is sampled exactly once, on whichever engine
computes it, and the stream equals a colocated engine's.
"""

from __future__ import annotations

from typing import Optional

from atom_kv.reference.request import Request
from atom_kv.reference.tokenizer import IncrementalDetokenizer
from atom_kv.wire import KV_FEATURE_FIRST_TOKEN

__all__ = ["FEATURE", "prefilled_token", "first_token_sent", "with_first_token_text"]

#: what a decode engine announces (``/health`` ``kv_features``) when it continues from the prefill's token
FEATURE = KV_FEATURE_FIRST_TOKEN


def prefilled_token(req: Request, vocab_size: int) -> Optional[int]:
    """The prefill's first token for a consumer request whose whole prompt is here (loaded, or
    cached locally and loaded), else None (absent or malformed: the engine then computes the
    first token itself, as before)."""
    params = req.kv_transfer_params
    whole = req.num_cached_tokens + req.num_external_tokens >= req.num_prompt
    if not isinstance(params, dict) or not whole or req.output_ids:
        return None
    ids = params.get("first_token_ids")
    if not isinstance(ids, list) or len(ids) != 1:
        return None
    token = ids[0]
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
        return None
    return token


def with_first_token_text(params: Optional[dict]) -> Optional[dict]:
    """A prefill's answer params plus ``first_token_text``: what a stream shows for its first token
    alone (a byte of a longer UTF-8 character shows nothing yet), which is exactly the text a
    decode engine told ``first_token_sent`` leaves out, so a proxy may forward it as it is."""
    ids = params.get("first_token_ids") if isinstance(params, dict) else None
    if params is None or not isinstance(ids, list) or len(ids) != 1 or not isinstance(ids[0], int):
        return params
    return {**params, "first_token_text": IncrementalDetokenizer().push(ids[0])}


def first_token_sent(params: object) -> bool:
    """True when the proxy already streamed the first token's text to the client."""
    return isinstance(params, dict) and params.get("first_token_sent") is True
