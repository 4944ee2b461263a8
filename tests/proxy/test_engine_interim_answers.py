"""Interim (1xx) and upgrade answers from an engine, through a real proxy process (issue 38, F3 and F4).

Raw-socket engines (:class:`~atom_kv.testing.raw_engine.RawEngine`) behind ``python -m atom_kv.proxy``:

* F3: an engine that sends ``100 Continue`` or ``103 Early Hints`` (or both) before its answer, on either
  leg. Before the fix client A got the 1xx as its answer and the connection went back to the pool with
  A's real answer unread, so client B's request read A's answer (B's decode leg carried A's prefill
  answer, or B got A's decode answer). Each client must get its own answer;
* F4: an engine that answers 101 (bare, or a websocket upgrade followed by frames): the leg fails with a
  502 (not a 504: at once, not at its timeout), the proxy closes the connection, and its log holds no
  traceback. Before: the client waited past the leg's timeout and the proxy logged a fatal transport
  error. Health probes and ``/v1/models`` go through the same client and are checked too.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from atom_kv.testing.polling import wait_until
from atom_kv.testing.raw_engine import RawEngine, RawRequest, Then, json_answer
from atom_kv.testing.web import http_json as http
from tests.proxy.procs import ProxyProcess

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nlink: </kv>; rel=preload\r\n\r\n"
INTERIMS = {"100": [CONTINUE], "103": [EARLY_HINTS], "100-then-103": [CONTINUE, EARLY_HINTS]}
UPGRADES = {
    "101": b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
    "upgrade": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
               b"sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n\x81\x05hello",
}
LEG_TIMEOUT = 3.0  # --prefill-timeout and --decode-timeout: an answer that came by the timeout is a 504


def _prefill_answer(req: RawRequest) -> bytes:
    """A prefill's answer naming whose prompt it answers (the decode leg carries it on)."""
    body = req.json()
    kv = {"remote_engine_id": "raw-prefill", "remote_block_ids": [1, 2], "answered": body["prompt"],
          "transfer_id": body["kv_transfer_params"]["transfer_id"]}
    return json_answer({"id": "p", "object": "text_completion", "kv_transfer_params": kv,
                        "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def _decode_answer(req: RawRequest) -> bytes:
    """A decode's answer: the prompt of the prefill answer its leg carried, and its own."""
    body = req.json()
    text = f"{body['kv_transfer_params'].get('answered')}/{body['prompt']}"
    return json_answer({"id": "d", "object": "text_completion",
                        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})


def _post(port: int, path: str, body: dict[str, Any] | None, timeout: float = 10.0) -> tuple[int, Any]:
    """One request on its own connection; the first answer's status and JSON body, as sent (a 1xx too)."""
    data = json.dumps(body).encode() if body is not None else b""
    method = "POST" if body is not None else "GET"
    head = (f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + data)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed after {got!r}")
            got += chunk
        answer_head, _, rest = got.partition(b"\r\n\r\n")
        lines = answer_head.decode("latin-1").split("\r\n")
        length = next((int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")), 0)
        while len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed after {got + rest!r}")
            rest += chunk
    return int(lines[0].split(" ")[1]), json.loads(rest[:length]) if length else None


def _text(answer: tuple[int, Any]) -> tuple[int, Any]:
    status, body = answer
    return status, body["choices"][0]["text"] if status == 200 and isinstance(body, dict) else body


class _Pair:
    """A raw prefill and a raw decode engine behind a proxy process (static engines, no discovery),
    shared by the module's tests: :meth:`reset` gives each test the engines' default answers and the
    proxy's log from that point on."""

    def __init__(self) -> None:
        self.prefill = RawEngine("prefill", self._prefill).start()
        self.decode = RawEngine("decode", self._decode).start()
        self._scripts = (self.prefill.script, self.decode.script)
        self.prefill_interims: list[bytes] = []
        self.decode_interims: list[bytes] = []
        self.proxy = ProxyProcess("--no-discovery", "--no-release", "--probe-interval", "0.2",
                                  "--prefill", self.prefill.url, "--decode", self.decode.url,
                                  "--prefill-timeout", str(LEG_TIMEOUT), "--decode-timeout", str(LEG_TIMEOUT))
        self._log_from = 0
        self.wait_up()

    def reset(self) -> None:
        """The engines' default answers, both probed up, and the log counted from here."""
        self.prefill.script, self.decode.script = self._scripts
        self.prefill_interims, self.decode_interims = [], []
        self.wait_up()
        self._log_from = len(self.proxy.lines)

    def wait_up(self) -> None:
        want = (200, {"status": "ok", "prefill": 1, "decode": 1})
        wait_until(lambda: http("GET", self.proxy.url + "/health", timeout=5) == want, 15, interval=0.05,
                   what="both raw engines probed up")

    def _prefill(self, req: RawRequest):
        return self._answer(self.prefill_interims, _prefill_answer, req)

    def _decode(self, req: RawRequest):
        return self._answer(self.decode_interims, _decode_answer, req)

    @staticmethod
    def _answer(interims: list[bytes], answer, req: RawRequest):
        """A completion: the interim answers at once, then a while at work, then the answer (None: the
        engine's default answers to health probes and /v1/models)."""
        if req.method != "POST":
            return None
        return [*interims, 0.3, answer(req)] if interims else [answer(req)]

    def test_log(self) -> str:
        """What the proxy logged since :meth:`reset` (the whole log is checked once it exited, at the
        module's end)."""
        return "".join(self.proxy.lines[self._log_from:])

    def log(self) -> str:
        """The proxy's whole log, once it exited."""
        self.proxy.terminate()
        return self.proxy.stderr_rest()

    def close(self) -> None:
        self.proxy.kill()
        self.prefill.close()
        self.decode.close()


@pytest.fixture(scope="module")
def _shared_pair():
    p = _Pair()
    try:
        yield p
        _assert_no_traceback(p.log())
    finally:
        p.close()


@pytest.fixture
def pair(_shared_pair):
    _shared_pair.reset()
    return _shared_pair


def _assert_no_traceback(log: str) -> None:
    assert "Traceback" not in log and "Fatal error" not in log, log[-3000:]


@pytest.mark.parametrize("name", list(INTERIMS))
@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_each_client_gets_its_own_answer_past_an_engines_interim_answers(pair, leg, name):
    setattr(pair, f"{leg}_interims", INTERIMS[name])
    first = _text(_post(pair.proxy.port, "/v1/completions", {"prompt": "A", "max_tokens": 2}))
    second = _text(_post(pair.proxy.port, "/v1/completions", {"prompt": "B", "max_tokens": 2}))
    # "A/B" would be B's decode leg carrying A's prefill answer; "A/A", B getting A's decode answer
    assert (first, second) == ((200, "A/A"), (200, "B/B"))
    _assert_no_traceback(pair.test_log())


@pytest.mark.parametrize("name", list(UPGRADES))
@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_an_upgrade_from_an_engine_is_a_502_at_once_and_its_connection_is_closed(pair, leg, name):
    engine = getattr(pair, leg)
    default = engine.script
    engine.script = lambda req: [UPGRADES[name], Then.HOLD] if req.method == "POST" else default(req)
    closed_before = engine.closed_by_client(0, 0)
    status, body = _post(pair.proxy.port, "/v1/completions", {"prompt": "A", "max_tokens": 2})
    assert status == 502, body  # a 504 would be the leg's timeout: the upgrade was not seen as a failure
    assert engine.closed_by_client(closed_before + 1, LEG_TIMEOUT) > closed_before  # closed by the proxy
    engine.script = default  # the engine behaves again: served again once probed up
    pair.wait_up()
    assert _text(_post(pair.proxy.port, "/v1/completions", {"prompt": "B", "max_tokens": 2})) == (200, "B/B")
    _assert_no_traceback(pair.test_log())


@pytest.mark.parametrize("name", list(UPGRADES))
def test_a_health_probe_answered_with_an_upgrade_fails_and_the_engine_is_probed_again(name):
    """Before: the probe waited forever on its 101 (and no other probe of that engine ever ran)."""
    upgraded = []

    def prefill(req: RawRequest):
        if req.path == "/health" and len(upgraded) < 3:
            upgraded.append(req)
            return [UPGRADES[name], Then.HOLD]
        return [_prefill_answer(req)] if req.method == "POST" else None

    engine = RawEngine("prefill", prefill).start()
    decode = RawEngine("decode", lambda req: [_decode_answer(req)] if req.method == "POST" else None).start()
    proxy = ProxyProcess("--no-discovery", "--no-release", "--probe-interval", "0.2", "--probe-timeout", "2",
                         "--prefill", engine.url, "--decode", decode.url)
    try:
        want = (200, {"status": "ok", "prefill": 1, "decode": 1})
        wait_until(lambda: http("GET", proxy.url + "/health", timeout=5) == want, 15, interval=0.05,
                   what="the prefill engine probed up after its upgrades")
        assert len(upgraded) == 3 and engine.closed_by_client(3, 5) >= 3  # each probe's connection closed
        assert _text(_post(proxy.port, "/v1/completions", {"prompt": "A", "max_tokens": 2})) == (200, "A/A")
        proxy.terminate()
        _assert_no_traceback(proxy.stderr_rest())
    finally:
        proxy.kill()
        engine.close()
        decode.close()


def test_v1_models_is_the_final_answer_and_an_upgrade_there_a_502(pair):
    models = {"object": "list", "data": [{"id": "raw-model", "max_model_len": 32768}]}
    default = pair.decode.script
    pair.decode.script = lambda req: ([CONTINUE, EARLY_HINTS, 0.2, json_answer(models)]
                                      if req.path == "/v1/models" else default(req))
    assert _post(pair.proxy.port, "/v1/models", None) == (200, models)
    pair.decode.script = lambda req: ([UPGRADES["upgrade"], Then.HOLD]
                                      if req.path == "/v1/models" else default(req))
    assert _post(pair.proxy.port, "/v1/models", None)[0] == 502
    _assert_no_traceback(pair.test_log())
