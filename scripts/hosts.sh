# Sourced by the scripts: the ComfyUI hosts scripts/setup.sh prepared (.host/hosts.tsv, default first).
#   host_names                 the prepared hosts' names, one a line
#   use_host NAME              sets HOST_NAME, HOST_PYTHON and COMFYUI_PATH for that host ("" = the default)
#   exec_on_host "MODULE [ARG]" [--host NAME] ARGS...
#                              runs python -m MODULE [ARG] ARGS in that host's environment
#   require_free_gib GIB FOLDER WHAT
#                              fails, saying so, unless FOLDER's disk has GIB GiB free for WHAT
#   TORCH_PINS                 the torch every venv installs: the hosts' and the fast lane's (scripts/test_fast.sh)
TORCH_PINS=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0)
hosts_file="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.host/hosts.tsv"

host_names() { cut -f1 "$hosts_file"; }

use_host() {
  local wanted="$1" name venv dir
  while IFS=$'\t' read -r name venv dir; do
    if [[ -z "$wanted" || "$wanted" == "$name" ]]; then
      HOST_NAME="$name"; HOST_PYTHON="$venv/bin/python"; export COMFYUI_PATH="$dir"
      return 0
    fi
  done < "$hosts_file"
  echo "no ComfyUI host named '$wanted'; prepared: $(host_names | paste -sd' ')" >&2
  return 1
}

exec_on_host() {
  local module="$1" host=""
  shift
  if [[ "${1:-}" == "--host" ]]; then host="${2:-}"; shift 2; fi
  use_host "$host"
  # shellcheck disable=SC2086  # "MODULE ARG" splits into the module and its first argument
  exec "$HOST_PYTHON" -m $module "$@"
}

# A disk that fills up halfway through fails hundreds of tests with "No space left on device"; this says it first,
# with what is needed.
require_free_gib() {
  local need="$1" folder="$2" what="$3" free
  free="$(df --output=avail -B1G "$folder" | tail -n1 | tr -d ' ')"
  (( free >= need )) && return 0
  echo "$what needs about $need GiB free on the disk of $folder, and $free GiB are free there. Free some space" \
    "(an old clone's .venv*/ and .host/, leftover folders in ${TMPDIR:-/tmp}), then run again." >&2
  return 1
}
