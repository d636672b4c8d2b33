#!/usr/bin/env bash
# Starts ComfyUI with this pack (and the tiny models) for you to open in a browser:
# scripts/ui.sh [--host NAME] [--port 8188] [--cpu] [-- more ComfyUI flags]. Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
source scripts/hosts.sh
exec_on_host "harness.comfy_host ui" "$@"
