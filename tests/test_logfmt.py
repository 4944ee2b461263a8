"""atom_kv.logfmt: the JSON line format, the context fields (per task, per thread), and what
``configure_logging("json")`` does to warnings and uncaught exceptions (in a real subprocess)."""

from __future__ import annotations

import asyncio
import calendar
import io
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from typing import Iterator

import pytest

from atom_kv.logfmt import ENGINE, INSTANCE, REQUEST_ID, ContextFilter, JsonFormatter, configure_logging, root_format

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d{3})Z$")


class Captured:
    """A logger of its own (not propagating: the test harness's handlers stay out) writing JSON to a buffer."""

    def __init__(self, name: str, fields: dict | None = None) -> None:
        self.buffer = io.StringIO()
        self.handler = logging.StreamHandler(self.buffer)
        self.handler.setFormatter(JsonFormatter(fields))
        self.handler.addFilter(ContextFilter())
        self.logger = logging.getLogger(name)
        self.logger.propagate = False
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self.handler)

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.buffer.getvalue().splitlines()]

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.propagate = True


@pytest.fixture
def captured(request) -> Iterator[Captured]:
    c = Captured(f"test.logfmt.{request.node.name}")
    yield c
    c.close()


def test_a_record_is_one_json_line_with_the_required_keys(captured):
    before = time.time()
    captured.logger.info("two\nlines with \"quotes\" and %s", "an argument")
    (line,) = captured.buffer.getvalue().splitlines()
    record = json.loads(line)
    assert record == {"ts": record["ts"], "level": "INFO", "logger": captured.logger.name,
                      "msg": "two\nlines with \"quotes\" and an argument"}
    match = TS.match(record["ts"])
    assert match, record["ts"]
    assert abs(calendar.timegm(time.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S")) - before) < 2  # UTC


def test_an_exception_is_the_exc_field_on_the_same_line(captured):
    def failing_step() -> None:
        raise KeyError("our own words")

    try:
        failing_step()
    except KeyError:
        captured.logger.exception("the step failed")
    (line,) = captured.buffer.getvalue().splitlines()
    record = json.loads(line)
    assert record["level"] == "ERROR" and record["msg"] == "the step failed"
    assert "failing_step" in record["exc"] and "our own words" in record["exc"] and "\n" in record["exc"]


def test_the_request_id_is_each_tasks_own(captured):
    async def serve(rid: str, go: asyncio.Event) -> None:
        REQUEST_ID.set(rid)
        await go.wait()  # both are set before either logs
        captured.logger.info("serving %s", rid)

    async def main() -> None:
        go = asyncio.Event()
        tasks = [asyncio.create_task(serve(rid, go)) for rid in ("rid-a", "rid-b")]
        await asyncio.sleep(0)
        go.set()
        await asyncio.gather(*tasks)
        captured.logger.info("after both")

    asyncio.run(main())
    records = captured.records()
    assert {(r["msg"], r.get("request_id")) for r in records} == {
        ("serving rid-a", "rid-a"), ("serving rid-b", "rid-b"), ("after both", None)}


def test_the_engine_is_each_threads_own_and_extra_wins(captured):
    def core(engine_id: str) -> None:
        ENGINE.set(engine_id)
        captured.logger.info("core step")

    threads = [threading.Thread(target=core, args=(e,), name=f"test-core-{e}") for e in ("eng-dp0", "eng-dp1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    token = INSTANCE.set("http://from-context")
    try:
        captured.logger.warning("probe", extra={"instance": "http://given"})
        captured.logger.warning("plain")
    finally:
        INSTANCE.reset(token)
    records = captured.records()
    assert sorted(r["engine"] for r in records if r["msg"] == "core step") == ["eng-dp0", "eng-dp1"]
    assert [(r["msg"], r.get("instance")) for r in records if "instance" in r] == [
        ("probe", "http://given"), ("plain", "http://from-context")]


class _Odd:
    def __str__(self) -> str:
        return "odd value"


def test_process_fields_and_odd_values(request):
    c = Captured(f"test.logfmt.{request.node.name}", fields={"engine": "eng-1", "tp_rank": 1})
    try:
        c.logger.info("rank line", extra={"request_id": _Odd()})  # not JSON: logged as its str()
        (record,) = c.records()
    finally:
        c.close()
    assert (record["engine"], record["tp_rank"], record["request_id"]) == ("eng-1", 1, "odd value")


def test_configure_logging_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="must be text or json, got 'xml'"):
        configure_logging("INFO", "xml")
    assert root_format() == "text"  # the test harness's handlers are not JSON


_SCRIPT = textwrap.dedent("""
    import logging, threading, warnings
    from atom_kv.logfmt import configure_logging, root_format
    configure_logging("INFO", "json")
    print(root_format(), flush=True)
    logging.getLogger("atom_kv.test").info("configured")
    warnings.warn("a warning of ours")
    def crash():
        raise RuntimeError("thread trouble of ours")
    t = threading.Thread(target=crash, name="test-crashing-thread")
    t.start()
    t.join()
    raise SystemError("main trouble of ours")
""")


def test_json_mode_logs_warnings_and_uncaught_exceptions_as_json_lines():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and res.stdout == "json\n", (res.returncode, res.stdout, res.stderr)
    records = [json.loads(line) for line in res.stderr.splitlines()]  # every line is JSON
    assert [r["msg"] for r in records][0] == "configured"
    assert any("a warning of ours" in r["msg"] and r["level"] == "WARNING" for r in records), records
    thread = next(r for r in records if "test-crashing-thread" in r["msg"])
    assert thread["level"] == "ERROR" and "thread trouble of ours" in thread["exc"]
    main = next(r for r in records if r["level"] == "CRITICAL")
    assert "main trouble of ours" in main["exc"]
