"""DNS discovery against a real resolver: dnsmasq (Debian's ``dnsmasq-base``) on 127.0.0.1 and a port of its
own serves a hosts file the test rewrites (then SIGHUP); the proxy asks it over UDP (``--dns-server``), never
/etc/resolv.conf. Real reference engines listen at the addresses the records name: the decode engines share
one port on 127.0.0.2 and 127.0.0.3, as pods behind a headless service do.

The proxy starts knowing only the names. It routes to what they resolve to once a probe reaches each address;
when the decode record moves from 127.0.0.2 to 127.0.0.3 while a stream runs on .2, .2 is drained (the stream
finishes, new requests go to .3) and then removed; an address nothing serves stays pending and gets no
request; with the resolver gone, the last answer stands."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import threading

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_port
from atom_kv.testing.processes import ManagedProcess
from atom_kv.testing.web import http_json
from tests.e2e.helpers import generate
from tests.proxy.procs import ProxyProcess

DNSMASQ = shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if os.path.exists("/usr/sbin/dnsmasq") else None)
pytestmark = pytest.mark.skipif(DNSMASQ is None, reason="dnsmasq is not installed (apt-get install dnsmasq-base)")

TOKEN = "dns-discovery-cluster-secret"
DECODE_HOSTS = ("127.0.0.2", "127.0.0.3")


class Dnsmasq:
    """dnsmasq answering from ``hosts`` only (no upstream, no /etc/hosts), on 127.0.0.1:``port``."""

    def __init__(self, log_dir: str) -> None:
        self.hosts = os.path.join(log_dir, "dns.hosts")
        self.port = free_port()
        self.log_dir = log_dir
        self.proc: ManagedProcess | None = None

    def write(self, records: dict[str, list[str]]) -> None:
        lines = [f"{address} {name}\n" for name, addresses in records.items() for address in addresses]
        tmp = self.hosts + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(lines)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.hosts)
        if self.proc is not None:
            self.proc.proc.send_signal(signal.SIGHUP)  # dnsmasq reads --addn-hosts again

    def start(self) -> None:
        self.proc = ManagedProcess("dnsmasq", [
            DNSMASQ, "--keep-in-foreground", "--no-resolv", "--no-hosts", "--no-negcache", "--conf-file=/dev/null",
            f"--addn-hosts={self.hosts}", "--listen-address=127.0.0.1", "--bind-interfaces", f"--port={self.port}",
            "--pid-file=", f"--user={pwd.getpwuid(os.getuid()).pw_name}", "--log-facility=-"], self.log_dir)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@pytest.fixture
def fleet(tmp_path):
    decode_port = free_port()
    for sub in ("p", *DECODE_HOSTS):
        (tmp_path / sub).mkdir()
    clusters = [Cluster([EngineSpec("P", num_blocks=256, register=False)], with_proxy=False, token=TOKEN,
                        log_dir=str(tmp_path / "p"))]
    for host in DECODE_HOSTS:
        clusters.append(Cluster([EngineSpec("D", register=False, extra_args=["--port", str(decode_port)])],
                                with_proxy=False, token=TOKEN, engine_host=host, log_dir=str(tmp_path / host)))
    dns = Dnsmasq(str(tmp_path))
    try:
        for c in clusters:
            c.start()
        yield clusters, dns
    finally:
        dns.stop()
        for c in clusters:
            c.close()


def _workers(proxy: ProxyProcess) -> dict[str, dict]:
    status, body = http_json("GET", proxy.url + "/workers", timeout=10)
    assert status == 200, body
    return {w["url"]: w for w in body["workers"]}


def test_dns_records_changing_under_a_real_resolver(fleet):
    clusters, dns = fleet
    p_url = clusters[0].engine_url(0)
    d_old, d_new = (c.engine_url(0) for c in clusters[1:])
    decode_port = clusters[1].ports[0]
    assert d_old.endswith(f":{decode_port}") and d_new.endswith(f":{decode_port}")
    dns.write({"prefill.atom-kv.test": ["127.0.0.1"], "decode.atom-kv.test": ["127.0.0.2"]})
    dns.start()
    proxy = ProxyProcess("--no-discovery", "--prefill-dns", f"prefill.atom-kv.test:{clusters[0].ports[0]}",
                         "--decode-dns", f"decode.atom-kv.test:{decode_port}", "--dns-server", f"127.0.0.1:{dns.port}",
                         "--dns-interval", "0.3", "--dns-timeout", "1", "--probe-interval", "0.2", timeout=30)
    try:
        wait_until(lambda: {u: w["state"] for u, w in _workers(proxy).items()} == {p_url: "active", d_old: "active"},
                   30, what="the engines DNS names to be probed up")
        assert {w["source"] for w in _workers(proxy).values()} == {"dns"}
        res = generate(proxy.url, "found by name", chat=False, stream=False, max_tokens=3, timeout=60)
        assert res.status == 200 and res.error is None, res

        result: dict = {}
        stream = threading.Thread(target=lambda: result.update(res=generate(
            proxy.url, "the record moves while I stream", chat=False, stream=True, max_tokens=1500, timeout=300)),
            name="long-stream")
        stream.start()
        try:
            wait_until(lambda: _workers(proxy)[d_old]["inflight"] > 0, 60, interval=0.05, what="the stream's leg")
            # the record moves to .3, and names .4 too, where nothing serves
            dns.write({"prefill.atom-kv.test": ["127.0.0.1"], "decode.atom-kv.test": ["127.0.0.3", "127.0.0.4"]})
            dead = f"http://127.0.0.4:{decode_port}"
            wait_until(lambda: _workers(proxy)[d_old]["state"] == "draining", 10, interval=0.05,
                       what="the vanished address to be drained")
            wait_until(lambda: _workers(proxy).get(d_new, {}).get("state") == "active", 30,
                       what="the new address to be probed up")
            assert _workers(proxy)[d_old]["inflight"] == 1  # still streaming
            for n in range(3):
                res = generate(proxy.url, f"after the move {n}", chat=False, stream=n == 1, max_tokens=3, timeout=60)
                assert res.status == 200 and res.error is None, res
            listed = _workers(proxy)
            assert listed[dead]["state"] in ("pending", "down") and listed[dead]["inflight"] == 0, listed[dead]
        finally:
            stream.join(300)
        res = result["res"]
        assert res.status == 200 and res.error is None and res.finish_reason == "length", res
        wait_until(lambda: d_old not in _workers(proxy), 10, what="the drained address to be removed once idle")
        assert _workers(proxy)[d_new]["source"] == "dns"

        dns.stop()  # the resolver is gone: resolutions time out, the last answer stands
        wait_until(lambda: any("DNS discovery of decode engines at decode.atom-kv.test" in line
                               and "keeping the 2 engine(s) it had" in line for line in proxy.lines), 20,
                   what="a failed resolution to be logged")
        res = generate(proxy.url, "with the resolver gone", chat=False, stream=False, max_tokens=3, timeout=60)
        assert res.status == 200 and res.error is None, res
        assert set(_workers(proxy)) == {p_url, d_new, dead}
    finally:
        proxy.kill()
