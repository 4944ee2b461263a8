"""Connector test hygiene: every test engine's scheduler is closed after the test."""

from __future__ import annotations

import pytest

from tests.connector.engines import Engine


@pytest.fixture(autouse=True)
def _close_engine_schedulers():
    yield
    made, Engine.made = Engine.made, []
    for engine in made:
        engine.sched.close()
