#!/usr/bin/env bash
# Every GPU check in one command, for a CUDA machine (docs/records/gpu-campaign.md):
#
#   scripts/gpu_check.sh [engine|comfy|files|lora|all] [--out DIR]
#
#   engine  (default; about 3-5 min on an H100, estimated): every engine CUDA test (tests/torch_only/test_engine_cuda.py:
#           equality, peak bound, overlap, the fresh-slot race, released events under heavy compute, exact
#           pinning, pageable overlap, one copy stream, per-step peak; the CUDA cases of
#           test_reliability_engine.py and test_parking.py), bench/engine_microbench.py and
#           bench/recorder_overhead.py. Needs torch, pytest, pytest-timeout and websocket-client.
#   files   bench/file_tier.py: a 16-block stack of Wan 14B-sized blocks (10 GB in bf16) streamed from its own
#           safetensors file, host buffers for 0/25/50/100 % of it, warm and cold page cache, against the limit
#           max(resident, H2D bytes / pinned bandwidth, file bytes / read bandwidth) (issue 26).
#   comfy   the CUDA tests that run ComfyUI (Dynamic VRAM on/off, panel, reliability): needs a
#           prepared host (COMFYUI_PATH and ComfyUI's requirements); run it as a second device call.
#   lora    bench/lora_cost.py on Wan 14B- and Flux 12B-shaped blocks (8 and 4+4 blocks at the real widths, bf16,
#           rank-64 LoRA, 480p 81 frames and 1024x1024): the per-step cost of patches applied on the device
#           beside the unpatched rows, the planner's patch cost, and a strength change's queue-to-first-step
#           (issue 25). Needs a prepared host, as comfy.
#
# It writes DIR/gpu-check.md (default: the repo root): device, driver, torch, date, commit, the command and
# every figure; paste it into docs/records/log.md. Wheels the machine lacks are installed from .whl/ if
# present (pip download them there beforehand; the device tool carries ignored paths named in `carry`).
# Without a CUDA device it runs nothing and exits 2.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

part="engine"
out="$repo"
while [[ $# -gt 0 ]]; do
  case "$1" in
    engine|comfy|files|lora|all) part="$1"; shift ;;
    --out) out="$2"; shift 2 ;;
    *) echo "gpu_check: unknown argument '$1'; use engine, comfy, files, lora or all, and --out DIR" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-python3}"
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && python=.venv/bin/python

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: $python sees no CUDA device (or no torch); nothing was run. Run this on the GPU machine." >&2
  exit 2
fi
if ! "$python" -c 'import pytest, pytest_timeout, websocket' 2>/dev/null; then
  [[ -d .whl ]] || { echo "gpu_check: pytest, pytest-timeout or websocket-client is missing and there is no .whl/ to install them from" >&2; exit 2; }
  "$python" -m pip install --quiet --no-index --find-links .whl pytest pytest-timeout websocket-client
fi

mkdir -p "$out"
report="$out/gpu-check.md"
commit="$(git rev-parse --short HEAD 2>/dev/null || echo "${GPU_CHECK_COMMIT:-unknown}")"
{
  echo "### GPU check, $(date -u +%Y-%m-%d) ($part)"
  echo
  echo "- device: $("$python" -c 'import torch; print(torch.cuda.get_device_name())'), driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null || echo unknown), torch $("$python" -c 'import torch; print(torch.__version__)')"
  echo "- commit: $commit"
  echo "- command: \`scripts/gpu_check.sh $part\`"
  echo
} > "$report"

status=0
step() {  # step TITLE COMMAND...: runs it, keeps its output (the figures) in the report
  local title="$1"; shift
  echo "gpu_check: $title" >&2
  local log rc=0
  log="$(mktemp)"
  "$@" 2>&1 | tee "$log" >&2 || rc=${PIPESTATUS[0]}
  { echo "#### $title (exit $rc)"; echo; echo '```'; grep -v '^\s*$' "$log" | tail -n 60; echo '```'; echo; } >> "$report"
  rm -f "$log"
  [[ $rc -eq 0 ]] || status=1
}

pytest=("$python" -m pytest -p no:cacheprovider -rA -s -v)
if [[ "$part" == engine || "$part" == all ]]; then
  step "engine CUDA tests" "${pytest[@]}" tests/torch_only/test_engine_cuda.py tests/torch_only/test_reliability_engine.py tests/torch_only/test_file_tier.py \
    "tests/torch_only/test_parking.py::test_pinned_buffers_are_adopted_without_a_second_reservation"
  step "engine micro-benchmark" "$python" -m bench.engine_microbench
  step "recorder overhead" "$python" -m bench.recorder_overhead
fi
if [[ "$part" == files || "$part" == all ]]; then
  step "file tier against its limit" "$python" -m bench.file_tier --cold --folder "${GPU_CHECK_FILES:-/tmp}"
fi
if [[ "$part" == comfy || "$part" == all ]]; then
  step "ComfyUI CUDA tests" "${pytest[@]}" tests/test_dynamic_vram.py tests/test_reliability.py tests/test_panel.py \
    tests/test_every_prompt_streams.py -k "gpu or cuda"
fi
if [[ "$part" == lora || "$part" == all ]]; then
  lora=("$python" -m bench.lora_cost --device cuda --real --rank 64 --dtype bfloat16 --steps 3 --rounds 3)
  step "LoRA cost, Wan 14B-shaped" "${lora[@]}" --arch wan --blocks 8 --latent 21 60 104
  step "LoRA cost, Flux 12B-shaped" "${lora[@]}" --arch flux --blocks 4 --latent 128 128
fi
echo "gpu_check: figures in $report" >&2
exit "$status"
