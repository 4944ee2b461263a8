"""Reading a request's JSON body on the reference engine's HTTP port.

Every way a body can be bad is the client's mistake and a :class:`RequestError`
(a 400 naming what is wrong, or a 413), never a 500 or a traceback:

- it is cut short, or its chunked encoding is malformed;
- it is larger than the server's limit (413);
- it is not strict JSON (RFC 8259, as the proxy parses it): not UTF-8, a
  lone surrogate escape (``"\\ud800"``), ``NaN`` or ``Infinity``, a number
  out of range (``1e400``, or an integer of thousands of digits), nesting
  deeper than the decoder's limit.

A client that goes away while sending its body is :class:`ClientGone`: nobody
is left to answer, and the engine logs it at INFO, without a traceback.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.client_exceptions import ClientPayloadError
from aiohttp.http_exceptions import HttpProcessingError

from atom_kv.reference.request import RequestError

__all__ = ["ClientGone", "read_json_body"]

_decoder = msgspec.json.Decoder()


class ClientGone(Exception):
    """The client closed or reset its connection before the request was answered."""


async def read_json_body(request: web.Request) -> Any:
    """The request body as a JSON value; raises :class:`RequestError` or :class:`ClientGone`."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(f"request body is larger than this engine's limit of {request.client_max_size} bytes",
                           status=413) from None
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        raise ClientGone(f"the client went away while sending its body ({type(exc).__name__})") from None
    except (HttpProcessingError, ClientPayloadError) as exc:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ClientGone(f"the client went away while sending its body ({type(exc).__name__})") from None
        raise RequestError("request body could not be read: it was cut short or its chunked encoding is "
                           "malformed") from None
    if not raw:
        raise RequestError("request body is empty; send a JSON object")
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError (a number out of range) included
        raise RequestError(f"request body is not valid JSON (RFC 8259: UTF-8, no NaN or Infinity, no lone "
                           f"surrogates, numbers in range): {exc}") from None
    except UnicodeDecodeError as exc:  # bad UTF-8 in a string: msgspec < 0.23 raises this, 0.23 DecodeError
        raise RequestError(f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    except RecursionError:
        raise RequestError("request body is not valid JSON here: its arrays or objects nest too deeply") from None
