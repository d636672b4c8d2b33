#!/usr/bin/env bash
# Writes docs/models.md's table of the models the tests stream (tests/test_every_dit.py, harness/tiny_dit.py), each
# built by ComfyUI 0.33.0 from its own classes: scripts/supported_models.sh. The tests fail while it is stale.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh
source scripts/hosts.sh
use_host 0.33.0
PYTHONPATH="$COMFYUI_PATH:$repo" "$HOST_PYTHON" -m harness.tiny_dit --readme docs/models.md
