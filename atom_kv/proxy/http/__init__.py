"""HTTP/1.1 only, no P/D: the server clients talk to, the pooled client to the engines, SSE framing, the ASGI bridge."""
