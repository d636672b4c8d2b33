#!/usr/bin/env bash
# The fast lane: the tests that need only torch (tests/torch_only/: the engine and the repository's rules), with
# no ComfyUI host, in a venv of their own (.venv-fast/: torch, numpy, psutil, pytest), made on the first run:
#   scripts/test_fast.sh [pytest args...]      e.g. scripts/test_fast.sh -k ring -x
# scripts/test.sh runs the same tests with the rest of the suite.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
started=$SECONDS
# shellcheck source=scripts/hosts.sh
source scripts/hosts.sh
venv="$repo/.venv-fast"
packages=("${TORCH_PINS[0]}" numpy psutil "pytest>=8" "pytest-timeout>=2.3")
stamp="$venv/.block-offload-fast-$(printf '%s\n' "${packages[@]}" | sha1sum | cut -c1-12)"
if [[ ! -f "$stamp" ]]; then
  echo "test_fast.sh: making $venv (torch and pytest; the first time takes about a minute)" >&2
  [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv" ||
    { echo "test_fast.sh: python3 -m venv failed; on Debian/Ubuntu install python3-venv, then run again." >&2; exit 1; }
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${packages[@]}"
  touch "$stamp"
fi
echo "test_fast.sh: set-up checked in $((SECONDS - started)) s" >&2
status=0
# This folder's conftest only: the suite's own (tests/conftest.py) starts ComfyUI servers.
"$venv/bin/python" -m pytest tests/torch_only --confcutdir tests/torch_only -p no:cacheprovider "$@" || status=$?
echo "test_fast.sh: $((SECONDS - started)) s in all, set-up included" >&2
exit "$status"
