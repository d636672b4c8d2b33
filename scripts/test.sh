#!/usr/bin/env bash
# Runs the test suite on every prepared ComfyUI host at the same time (0.33.0 on two workers, and 0.3.75), each
# in its own environment and base directory (.host/tests-NAME*/: outputs, user data; custom_nodes and models are
# .host/'s):
#   scripts/test.sh [--host NAME] [pytest args...]
# e.g. scripts/test.sh tests/test_host.py -k latent -x;  scripts/test.sh --host 0.3.75
# The first host's output streams; each other host's goes to .host/tests-NAME.log, shown when it ends.
# Side by side: most of a test's time is a ComfyUI server or a tiny model's Python on one core.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
started=$SECONDS
scripts/setup.sh
echo "test.sh: set-up checked in $((SECONDS - started)) s" >&2
source scripts/hosts.sh
# What the suites write: the tiny checkpoints into .host/models (6.5 GiB, once), and the two suites' temporary files
# at their peak (2.8 GiB on a fresh clone).
MODELS_GIB=7 TEMPORARY_GIB=4
models_gib="$(du -s -BG .host/models 2>/dev/null | cut -f1 | tr -d G)"
models_left=$(( MODELS_GIB > ${models_gib:-0} ? MODELS_GIB - ${models_gib:-0} : 0 ))
tmp="${TMPDIR:-/tmp}"
if [[ "$(stat -c %d "$tmp")" == "$(stat -c %d .host)" ]]; then
  require_free_gib $((models_left + TEMPORARY_GIB)) "$tmp" \
    "test.sh: the tiny checkpoints and the suites' temporary files" || exit 1
else
  require_free_gib "$models_left" .host "test.sh: the tiny checkpoints" || exit 1
  require_free_gib "$TEMPORARY_GIB" "$tmp" "test.sh: the suites' temporary files" || exit 1
fi
hosts=()
if [[ "${1:-}" == "--host" ]]; then
  [[ -n "${2:-}" ]] || { echo "test.sh: --host needs a name: $(host_names | paste -sd' ')" >&2; exit 2; }
  hosts=("$2"); shift 2
else
  mapfile -t hosts < <(host_names)
fi

# run_suite NAME NICENESS ARGS...: pytest on host NAME in its own base directory (its tests lay it out, sharing
# .host/'s custom_nodes and models), at that niceness (its servers too); its exit status. The tests marked one_host
# (tests/torch_only/ and those whose subject does not depend on ComfyUI's version) run on the first host only.
run_suite() {
  local name="$1" niceness="$2" base="$repo/.host/tests-$1"
  shift 2
  use_host "$name"
  echo "test.sh: ComfyUI $HOST_NAME ($COMFYUI_PATH), base directory $base" >&2
  local elsewhere=""
  [[ "$name" == "${hosts[0]}" ]] || elsewhere=1
  BLOCK_OFFLOAD_BASE_DIR="$base" BLOCK_OFFLOAD_ONE_HOST_ELSEWHERE="$elsewhere" nice -n "$niceness" \
    "$HOST_PYTHON" -m pytest "$@"
}

# One compute thread per suite (their servers inherit it): two suites of torch's default two threads each on two
# cores spin on each other's cores (OpenMP waits by spinning) and run several times slower than one at a time.
if [[ ${#hosts[@]} -gt 1 && -z "${OMP_NUM_THREADS:-}" ]]; then
  export OMP_NUM_THREADS=1
fi
# A run of named tests, or the whole suite, which ends with its 25 slowest tests and fixtures: where its minutes
# go, in every CI log.
named=0
printf '%s\n' "$@" | grep -q '^tests' && named=1
slowest=()
(( named )) || slowest=(--durations=25)
declare -A pids logs
trap 'kill "${pids[@]}" 2>/dev/null' INT TERM
for host in "${hosts[@]:1}"; do
  logs[$host]="$repo/.host/tests-$host.log"
  run_suite "$host" 0 "${slowest[@]}" "$@" >"${logs[$host]}" 2>&1 &
  pids[$host]=$!
done
declare -A statuses
# The first host's suite, the longest, on two workers file by file (pytest-xdist), beside the other's: three
# processes on two cores, both kept busy to the end. Its workers yield to the other suite (niceness 5): at equal
# shares the other, one process, got a third of the cores and ended 2-3 min after them, one core idle meanwhile;
# yielding, it gets more of a core: 36-94 s apart in three fresh-clone runs. The files are handed out in the order
# tests/conftest.py gives them (the tiny Flux's first), not xdist's own. Not for a run of named tests.
workers=() niceness=0
if [[ ${#hosts[@]} -gt 1 ]] && (( ! named )); then
  workers=(-n 2 --dist loadfile --no-loadscope-reorder) niceness=5
fi
statuses[${hosts[0]}]=0
run_suite "${hosts[0]}" "$niceness" "${workers[@]}" "${slowest[@]}" "$@" || statuses[${hosts[0]}]=$?
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
