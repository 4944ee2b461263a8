"""The proxy's per-request spans: proxy marks plus what each engine's Server-Timing says."""

import pytest

from atom_kv.proxy.observability.metrics import ProxyMetrics
from atom_kv.proxy.observability.spans import RequestSpans


def test_spans_are_observed_once_per_request_from_engine_headers():
    metrics = ProxyMetrics()
    spans = RequestSpans(metrics)
    spans.prefill_sent()
    spans.prefill_answered("queue;dur=2, compute;dur=30, bogus;dur=5")
    spans.decode_sent(after_prefill=True)
    spans.decode_answered("admission;dur=1, kv_wait;dur=4, first_step;dur=3")
    spans.first_write()
    spans.first_write()

    def count(span):
        return metrics.registry.get_sample_value("atom_kv_proxy_span_seconds_count", {"span": span})

    def total(span):
        return metrics.registry.get_sample_value("atom_kv_proxy_span_seconds_sum", {"span": span})

    for span in ("proxy_admission", "prefill_queue", "prefill_compute", "prefill_response", "proxy_between",
                 "decode_admission", "kv_wait", "decode_first_step", "decode_response", "proxy_write"):
        assert count(span) == 1, span
    assert total("prefill_compute") == pytest.approx(0.030) and total("kv_wait") == pytest.approx(0.004)
    assert count("bogus") is None
