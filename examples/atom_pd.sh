#!/usr/bin/env bash
# ATOM prefill + decode behind atom-kv's proxy on one host with AMD GPUs (docs/atom.md).
# Needs ATOM and atom-kv installed in the same environment (python -m atom_kv.integrations.atom hook-status).
#
#   MODEL=/models/Llama-3.1-8B-Instruct examples/atom_pd.sh                          # 1P1D, TP 1 each
#   MODEL=/models/Llama-3.1-70B-Instruct P_TP=4 P_GPUS=0,1,2,3 D_TP=2 D_GPUS=4,5 examples/atom_pd.sh
#
# Ctrl-C stops everything. Logs: ./atom-pd-logs/. Then:
#   curl -s http://$HOST_IP:$PROXY_PORT/v1/completions -H 'Content-Type: application/json' \
#     -d '{"model": "'$MODEL'", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
set -euo pipefail
: "${MODEL:?set MODEL to a model path or name ATOM can load}"
PY=${PY:-python}
# ATOM first: without it nothing below can start (and the hook check would point at the wrong fix)
command -v "$PY" >/dev/null || { echo "error: no Python at PY=$PY: set PY to the Python that has ATOM and atom-kv" >&2; exit 1; }
"$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("atom") is None)' 2>/dev/null || {
  echo "error: ATOM is not installed for $PY (no module named atom): install ATOM into this environment, or set PY to a Python that has it (docs/atom.md)" >&2
  exit 1
}
HOST_IP=${HOST_IP:-$("$PY" -c 'from atom.utils.network import get_ip; print(get_ip())')}
PROXY_PORT=${PROXY_PORT:-10001}
DISCOVERY_PORT=${DISCOVERY_PORT:-36367}
BLOCK_SIZE=${BLOCK_SIZE:-16}
BACKEND=${BACKEND:-auto}                 # moriio for RDMA between nodes
POLICY=${POLICY:-recompute}              # or fail
P_TP=${P_TP:-1}; P_GPUS=${P_GPUS:-0}
D_TP=${D_TP:-1}; D_GPUS=${D_GPUS:-1}
LOGS=${LOGS:-atom-pd-logs}
mkdir -p "$LOGS"
# the cluster secret, in a file only you can read (docs/security.md): the proxy's --registration-token-file
# and every engine's auth_token_file, so no process list shows it. TOKEN_FILE names your own; else
# $LOGS/token is made once and kept.
TOKEN_FILE=${TOKEN_FILE:-$(cd "$LOGS" && pwd)/token}
[ -s "$TOKEN_FILE" ] || (umask 077; openssl rand -hex 32 > "$TOKEN_FILE")

pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  sleep 5
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

"$PY" -m atom_kv.integrations.atom hook-status | grep -q ': installed' || {
  echo "error: atom_kv is not registered with ATOM in this environment; run: $PY -m atom_kv.integrations.atom install-hook" >&2
  exit 1
}

kv_config() {  # role handshake_port http_port
  printf '{"kv_connector": "atom_kv", "kv_role": "%s", "backend": "%s", "handshake_port": %d, "http_port": %d, "proxy_ip": "%s", "proxy_ping_port": %d, "load_failure_policy": "%s", "auth_token_file": "%s"}' \
    "$1" "$BACKEND" "$2" "$3" "$HOST_IP" "$DISCOVERY_PORT" "$POLICY" "$TOKEN_FILE"
}

"$PY" -m atom_kv.proxy --host "$HOST_IP" --port "$PROXY_PORT" --discovery-port "$DISCOVERY_PORT" \
  --registration-token-file "$TOKEN_FILE" \
  >"$LOGS/proxy.log" 2>&1 & pids+=($!)

# ATOM's --port is its internal engine port: distinct per server on one host.
HIP_VISIBLE_DEVICES=$P_GPUS ATOM_HOST_IP=$HOST_IP "$PY" -m atom.entrypoints.openai_server \
  --model "$MODEL" --block-size "$BLOCK_SIZE" -tp "$P_TP" --port 8009 --server-port 8010 \
  --kv-transfer-config "$(kv_config kv_producer 6301 8010)" >"$LOGS/prefill.log" 2>&1 & pids+=($!)
HIP_VISIBLE_DEVICES=$D_GPUS ATOM_HOST_IP=$HOST_IP "$PY" -m atom.entrypoints.openai_server \
  --model "$MODEL" --block-size "$BLOCK_SIZE" -tp "$D_TP" --port 8019 --server-port 8020 \
  --kv-transfer-config "$(kv_config kv_consumer 6401 8020)" >"$LOGS/decode.log" 2>&1 & pids+=($!)

echo "waiting (up to 15 min: model load and graph capture) for the proxy to list both engines ..."
for _ in $(seq 1 900); do
  if curl -sf "http://$HOST_IP:$PROXY_PORT/health" >/dev/null; then
    curl -s "http://$HOST_IP:$PROXY_PORT/health"; echo
    echo "ready: http://$HOST_IP:$PROXY_PORT/v1/completions (Ctrl-C to stop; logs in $LOGS/)"
    wait
    exit 0
  fi
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || { echo "error: a process exited early; see $LOGS/" >&2; exit 1; }
  done
  sleep 1
done
echo "error: the engines did not register within 15 min; see $LOGS/ and docs/atom.md section 6" >&2
exit 1
