"""One request through a P/D pair: checks, leg rewrites, the pair paths, decode streaming, first token and releases."""
