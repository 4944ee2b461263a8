"""Session-wide colocated reference engine: greedy outputs computed once per prompt."""

from __future__ import annotations

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from tests.e2e.helpers import Result, generate


class ColocatedReference:
    """A colocated engine plus a memo of its greedy outputs."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.url = cluster.engine_url(0)
        self._memo: dict[tuple, str] = {}
        self._usage: dict[tuple, dict] = {}

    def text(self, prompt: str, *, chat: bool, max_tokens: int = 12) -> str:
        key = (prompt, chat, max_tokens)
        if key not in self._memo:
            res: Result = generate(self.url, prompt, chat=chat, stream=False, max_tokens=max_tokens)
            assert res.status == 200 and res.error is None, res
            self._memo[key] = res.text
            self._usage[key] = res.usage or {}
        return self._memo[key]

    def usage(self, prompt: str, *, chat: bool, max_tokens: int = 12) -> dict:
        self.text(prompt, chat=chat, max_tokens=max_tokens)
        return self._usage[(prompt, chat, max_tokens)]


@pytest.fixture(scope="session")
def colocated(tmp_path_factory):
    cluster = Cluster([EngineSpec("colocated", num_blocks=256)], with_proxy=False,
                      log_dir=str(tmp_path_factory.mktemp("colocated")))
    cluster.start()
    try:
        yield ColocatedReference(cluster)
    finally:
        cluster.close()
