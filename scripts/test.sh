#!/usr/bin/env bash
# Runs the test suite on every prepared ComfyUI host (0.33.0 and 0.3.75) at the same time, each in its own
# environment and its own base directory (.host/tests-NAME/: models, outputs, user data; custom_nodes shared):
#   scripts/test.sh [--host NAME] [pytest args...]
# e.g. scripts/test.sh tests/test_host.py -k latent -x;  scripts/test.sh --host 0.3.75
# The first host's output streams; each other host's goes to .host/tests-NAME.log, shown when it ends.
# Two at once: most of a test's time is a ComfyUI server or a tiny model's Python on one core.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
started=$SECONDS
scripts/setup.sh
echo "test.sh: set-up checked in $((SECONDS - started)) s" >&2
source scripts/hosts.sh
hosts=()
if [[ "${1:-}" == "--host" ]]; then
  [[ -n "${2:-}" ]] || { echo "test.sh: --host needs a name: $(host_names | paste -sd' ')" >&2; exit 2; }
  hosts=("$2"); shift 2
else
  mapfile -t hosts < <(host_names)
fi

# run_suite NAME ARGS...: pytest on host NAME in its own base directory; its exit status.
run_suite() {
  local name="$1" base="$repo/.host/tests-$1"
  shift
  use_host "$name"
  mkdir -p "$base"
  ln -sfn ../custom_nodes "$base/custom_nodes"
  echo "test.sh: ComfyUI $HOST_NAME ($COMFYUI_PATH), base directory $base" >&2
  BLOCK_OFFLOAD_BASE_DIR="$base" "$HOST_PYTHON" -m pytest "$@"
}

declare -A pids logs
trap 'kill "${pids[@]}" 2>/dev/null' INT TERM
for host in "${hosts[@]:1}"; do
  logs[$host]="$repo/.host/tests-$host.log"
  run_suite "$host" "$@" >"${logs[$host]}" 2>&1 &
  pids[$host]=$!
done
declare -A statuses
statuses[${hosts[0]}]=0
run_suite "${hosts[0]}" "$@" || statuses[${hosts[0]}]=$?
for host in "${hosts[@]:1}"; do
  statuses[$host]=0
  wait "${pids[$host]}" || statuses[$host]=$?
  echo "test.sh: ComfyUI $host's run (${logs[$host]}):" >&2
  cat "${logs[$host]}"
done

failed=()
for host in "${hosts[@]}"; do
  status=${statuses[$host]}
  if [[ $status -eq 5 ]]; then
    echo "test.sh: pytest collected no tests on ComfyUI $host; treating that as a failure." >&2
  fi
  [[ $status -eq 0 ]] || failed+=("$host (exit $status)")
done
echo "test.sh: $((SECONDS - started)) s in all, set-up included" >&2
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "test.sh: failed on ComfyUI ${failed[*]}" >&2
  exit 1
fi
echo "test.sh: passed on ComfyUI ${hosts[*]}" >&2
