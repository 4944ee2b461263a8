"""What the proxy tells operators: Prometheus metrics, per-request spans and their OpenTelemetry export."""
