"""Where an engine adapter hands one request's ``kv_transfer_params`` to the connector: never the engine's failure.

ATOM passes the client's ``kv_transfer_params`` as they came (any JSON value);
vLLM a dict whose values may be anything. The connector parses them once
(:class:`~atom_kv.connector.params.RequestParams`) and refuses bad ones in a
logged line, serving the request without a KV transfer. The adapters read one
flag themselves first (:func:`asks`), and call the connector through
:func:`matched_tokens`, so that an exception there, a connector bug reached by
one request, costs that request its KV transfer (it is prefilled locally; a
producer keeps no KV for it) and leaves the engine's scheduler running. Imports
no engine.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable

__all__ = ["asks", "matched_tokens"]

logger = logging.getLogger(__name__)


def asks(params: Any, key: str) -> bool:
    """True when ``params`` is a mapping whose ``key`` is set (``do_remote_prefill``, ``do_remote_decode``);
    any other value asks for nothing (the connector says why when it reads them)."""
    return isinstance(params, Mapping) and bool(params.get(key))


def matched_tokens(engine: str, request_id: Any, call: Callable[[], tuple[int, bool]],
                   on_error: Callable[[], None] = lambda: None) -> tuple[int, bool]:
    """``call()`` (the connector's ``get_num_new_matched_tokens`` for one request); ``(0, False)`` when it
    raises: logged with its traceback, ``on_error()`` run (to drop what the connector may hold for it)."""
    try:
        return call()
    except Exception:
        logger.exception("%s request %s: the KV connector failed on its kv_transfer_params; serving it without a KV "
                         "transfer", engine, request_id)
        try:
            on_error()
        except Exception:
            logger.exception("%s request %s: could not drop the KV connector's state for it", engine, request_id)
        return 0, False
