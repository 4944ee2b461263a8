"""HTTP/1.1 only, no P/D: the server the clients talk to, the pooled client for the engines, SSE framing, the ASGI bridge."""
