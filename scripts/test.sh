#!/usr/bin/env bash
# Runs the test suite against a real ComfyUI: scripts/test.sh [pytest args...]
# e.g. scripts/test.sh tests/test_host.py -k latent -x
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [[ $status -eq 5 ]]; then
  echo "test.sh: pytest collected no tests; treating that as a failure." >&2
  exit 1
fi
exit "$status"
