#!/usr/bin/env bash
# Runs the test suite on every prepared ComfyUI host (0.33.0, then 0.3.75), each in its own
# environment: scripts/test.sh [--host NAME] [pytest args...]
# e.g. scripts/test.sh tests/test_host.py -k latent -x;  scripts/test.sh --host 0.3.75
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh
source scripts/hosts.sh
hosts=()
if [[ "${1:-}" == "--host" ]]; then
  [[ -n "${2:-}" ]] || { echo "test.sh: --host needs a name: $(host_names | paste -sd' ')" >&2; exit 2; }
  hosts=("$2"); shift 2
else
  mapfile -t hosts < <(host_names)
fi
failed=()
for host in "${hosts[@]}"; do
  use_host "$host"
  echo "test.sh: ComfyUI $HOST_NAME ($COMFYUI_PATH)" >&2
  status=0
  "$HOST_PYTHON" -m pytest "$@" || status=$?
  if [[ $status -eq 5 ]]; then
    echo "test.sh: pytest collected no tests on ComfyUI $HOST_NAME; treating that as a failure." >&2
  fi
  [[ $status -eq 0 ]] || failed+=("$HOST_NAME (exit $status)")
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "test.sh: failed on ComfyUI ${failed[*]}" >&2
  exit 1
fi
echo "test.sh: passed on ComfyUI ${hosts[*]}" >&2
