#!/usr/bin/env bash
# Starts ComfyUI with this pack (and the tiny models) for you to open in a browser:
# scripts/ui.sh [--host NAME] [--port 8188] [--cpu] [-- more ComfyUI flags]. Ctrl-C stops it.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh
source scripts/hosts.sh
host=""
if [[ "${1:-}" == "--host" ]]; then host="${2:-}"; shift 2; fi
use_host "$host"
exec "$HOST_PYTHON" -m harness.comfy_host ui "$@"
