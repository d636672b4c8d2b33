#!/usr/bin/env bash
# Runs an example workflow on a real ComfyUI with tiny random-weight models and prints
# what the pack did: scripts/demo.sh [--host NAME] [workflow-name] [--timeout S] [--gpu] [--json]
# (workflow-name: example_workflows/api/<name>.json; see scripts/demo.py --help).
# The host is ComfyUI 0.33.0 unless --host names another (0.3.75).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
source scripts/hosts.sh
exec_on_host scripts.demo "$@"
