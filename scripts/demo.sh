#!/usr/bin/env bash
# Runs an example workflow on a real ComfyUI with tiny random-weight models and
# prints the result: scripts/demo.sh [workflow-name] [--timeout S] [--gpu]
# (workflow-name: example_workflows/<name>_api.json; see scripts/demo.py --help)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
