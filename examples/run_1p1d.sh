#!/usr/bin/env bash
# One proxy, one prefill engine (TP=2) and one decode engine (TP=1) on 127.0.0.1.
# Ctrl-C stops all three. Then, from another terminal:
#   python examples/stream_client.py --url http://127.0.0.1:10001 "Hello there"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PROXY_PORT=${PROXY_PORT:-10001}
DISCOVERY_PORT=${DISCOVERY_PORT:-36367}
BACKEND=${BACKEND:-auto}
# the cluster secret, in a file only you can read (docs/security.md): the proxy's --registration-token-file
# and every engine's auth_token_file, so no process list shows it. TOKEN_FILE names your own; else one is
# made for this run (and removed after it).
if [ -z "${TOKEN_FILE:-}" ]; then
  TOKEN_FILE=$(mktemp "${TMPDIR:-/tmp}/atom-kv-token.XXXXXX")  # mode 0600
  (umask 077; openssl rand -hex 32 > "$TOKEN_FILE")
  MADE_TOKEN_FILE=1
fi

pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  sleep 2
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  if [ -n "${MADE_TOKEN_FILE:-}" ]; then rm -f "$TOKEN_FILE"; fi
}
trap cleanup EXIT INT TERM

engine_config() {  # role handshake_port
  printf '{"kv_role": "%s", "proxy_ip": "127.0.0.1", "proxy_ping_port": %d, "handshake_port": %d, "backend": "%s", "ping_interval_s": 1.0, "auth_token_file": "%s"}' \
    "$1" "$DISCOVERY_PORT" "$2" "$BACKEND" "$TOKEN_FILE"
}

"$PY" -m atom_kv.proxy --host 127.0.0.1 --port "$PROXY_PORT" --discovery-port "$DISCOVERY_PORT" \
  --heartbeat-timeout 5 --registration-token-file "$TOKEN_FILE" & pids+=($!)
"$PY" -m atom_kv.reference --host 127.0.0.1 --port 8100 --tp 2 \
  --kv-transfer-config "$(engine_config kv_producer 6301)" & pids+=($!)
"$PY" -m atom_kv.reference --host 127.0.0.1 --port 8200 --tp 1 \
  --kv-transfer-config "$(engine_config kv_consumer 6401)" & pids+=($!)

echo "waiting for the proxy to see 1 prefill and 1 decode engine ..."
for _ in $(seq 1 120); do
  if curl -sf "http://127.0.0.1:$PROXY_PORT/health" >/dev/null; then
    curl -s "http://127.0.0.1:$PROXY_PORT/health"; echo
    echo "ready: http://127.0.0.1:$PROXY_PORT/v1/completions (Ctrl-C to stop)"
    wait
    exit 0
  fi
  sleep 0.5
done
echo "error: engines did not register within 60 s" >&2
exit 1
