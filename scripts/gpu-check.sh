#!/usr/bin/env bash
# Check this GPU machine offline, in minutes: scripts/gpu-check.sh OUTDIR [--kit DIR] [--budget-s S]
# [--only tests,bench,e2e] (docs/gpu.md, "An air-gapped GPU machine"). Installs the kit from `make gpu-kit`
# with --no-index into a scratch venv on top of this machine's own torch, runs the `gpu` tests, the GPU bench
# and the engines end to end (or only the groups --only names), and writes OUTDIR/summary.txt and .json.
#   GPU_CHECK_PYTHON  the Python whose packages (torch) the venv builds on (default: python3)
#   GPU_KIT           the kit folder (default: gpu-kit/ in this checkout; --kit overrides)
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${GPU_CHECK_PYTHON:-python3}
if ! command -v "$py" >/dev/null 2>&1; then
    echo "gpu-check: no Python '$py' here; name one with GPU_CHECK_PYTHON=/path/to/python3" >&2
    exit 2
fi
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: scripts/gpu-check.sh OUTDIR [--kit DIR] [--budget-s S] [--only tests,bench,e2e] [--keep-venv]" >&2
    exit 2
fi
exec "$py" "$root/scripts/gpu_check.py" "$@"
