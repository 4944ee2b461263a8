#!/usr/bin/env bash
# One proxy, two prefill engines and two decode engines on 127.0.0.1, mixed TP
# (P0: TP=2, P1: TP=1, D0: TP=1, D1: TP=2), so every TP pairing gets exercised.
# Ctrl-C stops everything.
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

engine() {  # role http_port tp handshake_port
  local cfg
  cfg=$(printf '{"kv_role": "%s", "proxy_ip": "127.0.0.1", "proxy_ping_port": %d, "handshake_port": %d, "backend": "%s", "ping_interval_s": 1.0, "auth_token_file": "%s"}' \
    "$1" "$DISCOVERY_PORT" "$4" "$BACKEND" "$TOKEN_FILE")
  "$PY" -m atom_kv.reference --host 127.0.0.1 --port "$2" --tp "$3" --num-blocks 512 \
    --kv-transfer-config "$cfg" & pids+=($!)
}

"$PY" -m atom_kv.proxy --host 127.0.0.1 --port "$PROXY_PORT" --discovery-port "$DISCOVERY_PORT" \
  --heartbeat-timeout 5 --registration-token-file "$TOKEN_FILE" & pids+=($!)
engine kv_producer 8100 2 6301
engine kv_producer 8101 1 6311
engine kv_consumer 8200 1 6401
engine kv_consumer 8201 2 6411

echo "waiting for the proxy to see 2 prefill and 2 decode engines ..."
for _ in $(seq 1 180); do
  health=$(curl -s "http://127.0.0.1:$PROXY_PORT/health" || true)
  if echo "$health" | grep -q '"prefill": *2' && echo "$health" | grep -q '"decode": *2'; then
    echo "$health"
    echo "ready: http://127.0.0.1:$PROXY_PORT/v1/completions (Ctrl-C to stop)"
    wait
    exit 0
  fi
  sleep 0.5
done
echo "error: engines did not register within 90 s; last health: $health" >&2
exit 1
