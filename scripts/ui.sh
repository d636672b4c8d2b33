#!/usr/bin/env bash
# Starts ComfyUI with this pack (and the tiny models) for you to open in a browser:
# scripts/ui.sh [--port 8188] [--cpu] [-- more ComfyUI flags]. Ctrl-C stops it.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh
exec .venv/bin/python scripts/comfy_host.py ui "$@"
