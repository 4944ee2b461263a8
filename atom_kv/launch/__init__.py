"""A proxy and reference engines as real processes on 127.0.0.1, started and stopped as one (``cluster``),
and what that takes: child processes that are always stopped, free loopback ports, bounded polling, blocking
HTTP calls and Prometheus scrapes, token files. The demo runs on it, so it ships; the tests and benches use it
from a checkout."""
