#!/usr/bin/env bash
# Runs an example workflow on a real ComfyUI with tiny random-weight models and
# prints the result: scripts/demo.sh [--host NAME] [workflow-name] [--timeout S] [--gpu]
# (workflow-name: example_workflows/api/<name>.json; see scripts/demo.py --help).
# The host is ComfyUI 0.33.0 unless --host names another (0.3.75).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh
source scripts/hosts.sh
host=""
if [[ "${1:-}" == "--host" ]]; then host="${2:-}"; shift 2; fi
use_host "$host"
exec "$HOST_PYTHON" -m scripts.demo "$@"
