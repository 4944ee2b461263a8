"""Old import path of :mod:`atom_kv.launch.web` (the tests and benches import it here), kept working:
that module ships in the wheel, since the demo runs on it; ``atom_kv.testing`` does not."""

from atom_kv.launch.web import http_json, scrape_metrics

__all__ = ["http_json", "scrape_metrics"]
