"""What each SIGINT/SIGTERM does to the reference engine's shutdown (atom_kv.reference.shutdown):
the first stops serving, the second hurries, the third exits at once with status 1, one log line each.
The end-to-end run with real processes is tests/e2e/test_shutdown_signals.py."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest

from atom_kv.reference.shutdown import EXIT_AT_ONCE, ShutdownSignals


def test_first_stops_second_hurries_third_exits(caplog):
    calls: list[str] = []
    signals = ShutdownSignals(shutdown_timeout_s=5, hurry_timeout_s=1,
                              exit_now=lambda code: calls.append(f"exit {code}"))
    signals.bind(on_stop=lambda: calls.append("stop"), on_hurry=lambda: calls.append("hurry"))
    with caplog.at_level(logging.INFO, logger="atom_kv.reference"):
        signals.received(signal.SIGTERM)
        assert calls == ["stop"]
        signals.received(signal.SIGINT)
        assert calls == ["stop", "hurry"]
        signals.received(signal.SIGTERM)
    assert calls == ["stop", "hurry", f"exit {EXIT_AT_ONCE}"] and EXIT_AT_ONCE == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "atom_kv.reference"]
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert lines[0].startswith("SIGTERM: shutting down in order") and "up to 5 s (--shutdown-timeout)" in lines[0]
    assert lines[1].startswith("second SIGINT: hurrying the shutdown") and "cut to 1 s (--hurry-timeout)" in lines[1]
    assert lines[2].startswith("SIGTERM number 3: exiting now with status 1")


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_installed_handlers_keep_the_default_action_away():
    """After the event loop is gone (asyncio gave SIGTERM its default action back), a SIGTERM reaches
    ``received`` instead of killing the process."""
    seen: list[str] = []
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signals = ShutdownSignals(shutdown_timeout_s=5, hurry_timeout_s=1, exit_now=lambda code: seen.append("exit"))
    signals.bind(on_stop=lambda: seen.append("stop"), on_hurry=lambda: seen.append("hurry"))
    try:
        signals.install()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    assert seen == ["stop", "hurry"]
