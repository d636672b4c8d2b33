#!/usr/bin/env bash
# The GPU campaign: one self-contained device call that settles what only a GPU can (docs/records/gpu-campaign.md).
# On the GPU machine, from the checkout, carrying what ../shared/gpu/bundle.sh 0.33.0 wrote:
#
#   scripts/gpu_campaign.sh [CALL] [--out DIR] [--seconds N]      # device tool, carry .gpu/host-0.33.0.tar.xz,
#                                                                 # .gpu/whl-0.33.0, .gpu/env.sh
#   scripts/gpu_campaign.sh [CALL] --dry-run [--out DIR]          # here: the CPU, tiny shapes, every step run
#
#   CALL 1 (222 s on an H100, 2026-11-26): the engine's CUDA tests while ComfyUI 0.33's GPU server
#          tests run (Dynamic VRAM on and off: every node streams, bitwise; parking; every prompt streams) and
#          every tiny DiT streams through each node on the device (fp32, then bf16); then the head-to-head on a
#          Flux 12B-shaped model on a 12 GiB card: ComfyUI 0.33's Dynamic VRAM, its classic async offload,
#          Partial GPU Residency auto on both (about 280 s on an H200).
#   CALL 2 (118 s on an H200): what call 1 of 2026-11-26 could not settle, alone (host timings, tracebacks).
#   CALL 3 (290 s on an H200): a LoRA on a Dynamic VRAM model against ComfyUI's own, beside the Flux head-to-head.
#   CALL 4 (481 s on an H100, 2026-11-26): issue 33's allocation counts on the device and the zoo in bf16, then the head-to-head for a Wan 2.1
#          14B-shaped model on a 16 GiB card (Dynamic VRAM, classic async offload, the node on both).
#   CALL 5: Dynamic VRAM with the LRU cache on a server and the recorder's cost while nobody watches, then
#          seven ways to pin a first load's weights (bench/pinning.py) and the LoRA cost rows
#          (bench/lora_cost.py, Wan 14B- and Flux 12B-shaped blocks).
#   CALL 6: the head-to-head for a Qwen-Image 20B-shaped model on a 24 GiB card, classic rows only (host RAM).
#   CALL 7: the Wan 2.1 14B head-to-head of call 4 again, alone, every row loaded from the checkpoint file the
#          benchmark writes (since 2026-11-27): ComfyUI's Dynamic VRAM reading its own file, and host RAM
#          measured alike for every row; one round of 20 steps, so its table has the first 4- and 20-step prompts.
#   CALL 8 (the default: the first to run on the next GPU): the first prompt (issue 49): the Flux 12B head-to-head
#          on a 12 GiB card from the file, one round of 20 steps (load + 1st step, the first 4- and 20-step prompts, the
#          steady step, with blocks packed in the background while the first steps run), then bench/pinning.py's
#          seven ways of pinning a first load, then the file tier's reads with one thread, with its pool, and from
#          the mapping (bench/file_reads.py).
#   CALL 9: the model switch (issue 49): Wan 2.2's two experts in every prompt, Wan 2.1 14B-shaped, on a 16 GiB card
#          (harness/card.py), through real servers (bench/model_switch.py): ComfyUI alone against the node, under
#          Dynamic VRAM, then under classic loading; the first prompt (both experts loaded) and the warm ones.
#   CALL 10: against ComfyUI's own block prefetch (issue 74): LTX-2.3 22B-shaped fp8 on a 16 GiB card, then MiniMax
#          H3-shaped int8 on a 24 GiB card, each from its file, one round of 8 steps: ComfyUI 0.33 Dynamic VRAM (its
#          prefetch on), ComfyUI classic, and the node on the Dynamic VRAM model (load + 1st step, the first 4- and
#          8-step prompts, the steady step, peak VRAM, host RAM).
# Set BLOCK_OFFLOAD_COMMIT to the commit sent: the device's copy of the checkout may carry an older .git.
#
# Every part runs under a time cap that keeps the whole call within --seconds (default 510), so what ran
# comes back even when a part stalls. It writes DIR/campaign.md (device, driver, torch, date, commit, the
# command, each part's exit status, time and figures) and each part's full log beside it.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

# No call named: the one a lent GPU runs first (docs/records/gpu-campaign.md, "The order still to run"), which the
# suite dry-runs (tests/test_bench.py); change both as the order moves on.
call=8
out="$repo/gpu-campaign"
dry=0
seconds=510
while [[ $# -gt 0 ]]; do
  case "$1" in
    1|2|3|4|5|6|7|8|9|10) call="$1"; shift ;;
    --out) out="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) echo "gpu_campaign: unknown argument '$1'; use 1 to 10, --out DIR, --seconds N, --dry-run" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"
start=$SECONDS

if [[ $dry == 1 ]]; then
  python="${PYTHON:-$repo/.venv-0.33.0/bin/python}"
  export COMFYUI_PATH="${COMFYUI_PATH:-$repo/.comfyui-0.33.0}"
  [[ -x "$python" && -f "$COMFYUI_PATH/main.py" ]] || { echo "gpu_campaign: run scripts/setup.sh first" >&2; exit 2; }
  bench_size=(--smoke)
  # The head-to-head's code is the same for any number of rounds and steps: the fewest that give every column.
  flux_runs=(--rounds 1 --steps 2)
  # Calls 8 and 10 time one round as a whole prompt, beside the distilled model's 4 steps: here the fewest steps that
  # keep the two apart (each CPU step of the tiny 2 GB Flux takes seconds).
  round_steps=5
  # Dynamic VRAM's rows need CUDA: on the CPU the node on the classic model runs the node's code in their stead.
  prefetch_rows=("Partial GPU Residency, auto")
else
  [[ -f .gpu/env.sh ]] || { echo "gpu_campaign: no .gpu/env.sh; run ../shared/gpu/bundle.sh 0.33.0 here and carry .gpu/" >&2; exit 2; }
  # A warm machine keeps the folder unpacked by an earlier call, but not its files: unpack it again.
  rm -rf .gpu/host-0.33.0
  # shellcheck disable=SC1091
  source .gpu/env.sh 0.33.0 || { echo "gpu_campaign: .gpu/env.sh failed" >&2; exit 2; }
  python=python3
  export BLOCK_OFFLOAD_SERVER_ARGS="--front-end-root $repo/.gpu/fe"
  bench_size=()
  flux_runs=(--rounds 2 --steps 6)
  round_steps=""
  prefetch_rows=()
fi
export PYTHONUNBUFFERED=1

report="$out/campaign.md"
# The device machine's copy of the checkout may carry an older .git: name the commit sent with it.
commit="${BLOCK_OFFLOAD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
{
  echo "### GPU campaign call $call, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "- device: $("$python" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (dry run)")'), driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null || echo none), torch $("$python" -c 'import torch; print(torch.__version__)')"
  echo "- commit: $commit; ComfyUI $(cat "$COMFYUI_PATH/comfyui_version.py" 2>/dev/null | sed -n 's/^__version__ = "\(.*\)"/\1/p')"
  echo "- command: \`scripts/gpu_campaign.sh $call$([[ $dry == 1 ]] && echo ' --dry-run')\`"
  echo
} > "$report"

status=0
part() {  # part NAME CAP_SECONDS COMMAND...: runs it under the smaller of its cap and the time left
  local name="$1" cap="$2"; shift 2
  local left=$(( seconds - (SECONDS - start) ))
  # A part's cap guards the device call's time; on this CPU the parts share two cores with whatever else runs,
  # so a dry run lets each take what the call has left.
  (( cap > left || dry == 1 )) && cap=$left
  if (( cap < 20 )); then
    echo "#### $name: not run (${left} s left of the call)" >> "$report"
    status=1
    return
  fi
  local t0=$SECONDS rc=0
  echo "gpu_campaign: $name (up to ${cap} s)" >&2
  timeout --kill-after=10 "$cap" "$@" > "$out/$name.log" 2>&1 || rc=$?
  {
    echo "#### $name: exit $rc in $(( SECONDS - t0 )) s$([[ $rc == 124 ]] && echo ' (its time cap)')"
    echo
    echo '```'
    grep -E "passed|failed|skipped|PASSED|FAILED|ERROR|Error|error:|GB/s|^\| |holds|misses|noisy| s  |^device|s/step|ms$|architecture|recorder:|refused by the driver" "$out/$name.log" | tail -n 80
    echo '```'
    echo
  } >> "$report"
  (( rc == 0 )) || status=1
  return "$rc"
}

pytest=("$python" -m pytest -p no:cacheprovider -rA -v --timeout 300)
if [[ $dry == 1 ]]; then
  # The same commands on the CPU: the CUDA tests are collected and skip, the CPU twins of the server tests run.
  engine_tests=(tests/torch_only/test_engine_cuda.py tests/torch_only/test_file_tier.py -k "cuda or bf16")
  dynamic_tests=(tests/test_dynamic_vram.py -k "async-bf16-bf16")
  prompt_tests=(tests/test_every_prompt_streams.py -k "cpu and default and async")
  zoo=("$python" -m harness.zoo_on_device --cpu "Wan 2.1 T2V" "Flux" "MiniMax H3")
else
  engine_tests=(tests/torch_only/test_engine_cuda.py tests/torch_only/test_reliability_engine.py tests/torch_only/test_file_tier.py
    tests/torch_only/test_parking.py -k cuda)
  dynamic_tests=(tests/test_dynamic_vram.py -k cuda)
  prompt_tests=(tests/test_every_prompt_streams.py -k "cuda and default")
  zoo=("$python" -m harness.zoo_on_device)
fi
if [[ $dry == 1 ]]; then
  lru_tests=(tests/test_every_prompt_streams.py -k "cpu and lru and plain_then")
  lora_cost=("$python" -m bench.lora_cost --device cpu --steps 2 --rounds 1)
  pinning=("$python" -m bench.pinning --dry-run --gib 0.25 --block-mib 32 --rounds 1)
  file_reads=("$python" -m bench.file_reads --gib 0.125 --rounds 1)
  # The CPU has neither a card nor Dynamic VRAM: classic loading only, tiny experts.
  model_switch=("$python" -m bench.model_switch --dim 256 --ffn 512 --layers 4 --rounds 1 --prompts 2 --steps 2
    --modes classic --linked-experts --out "$out/switch")
else
  lru_tests=(tests/test_every_prompt_streams.py -k "cuda and dynamic and lru")
  lora_cost=("$python" -m bench.lora_cost --device cuda --real --rank 64 --dtype bfloat16 --steps 3 --rounds 3)
  pinning=("$python" -m bench.pinning --gib 4 --rounds 3)
  file_reads=("$python" -m bench.file_reads --gib 4 --rounds 3)
  # Two 28.6 GB experts as one file (hard-linked): two would fill most of the machine's 64 GiB disk. Dynamic VRAM
  # first, ComfyUI's default and the case that counts most.
  model_switch=("$python" -m bench.model_switch --dim 5120 --ffn 13824 --layers 40 --cuda --card 16 --rounds 1
    --prompts 3 --steps 4 --modes dynamic classic --linked-experts --out "$out/switch")
fi
# Stored as float32, then bfloat16: both run, and the part fails if either does.
zoo_both=(bash -c '"$@"; fp32=$?; "$@" --dtype bfloat16; exit $(( fp32 | $? ))' zoo "${zoo[@]}")

flux_bench=("$python" -m bench.comfy_bench "${bench_size[@]}" --models flux12b --budgets --cards 12 "${flux_runs[@]}"
  --out "$out/bench" --rows "fully resident" "ComfyUI, Dynamic" "ComfyUI, async offload on"
  "Partial GPU Residency, auto")
if [[ $call == 1 ]]; then
  # The server tests spend their time starting ComfyUI and on tiny models, as the zoo does; the engine's timing
  # tests compare rows measured under the same load. All at once keep the call within its limit.
  part comfyui-0.33-dynamic-vram-tests 200 "${pytest[@]}" "${dynamic_tests[@]}" & pids=($!)
  part comfyui-0.33-every-prompt-streams 200 "${pytest[@]}" "${prompt_tests[@]}" & pids+=($!)
  part every-dit-on-the-device 200 "${zoo_both[@]}" & pids+=($!)
  part engine-cuda-tests 200 "${pytest[@]}" "${engine_tests[@]}" || status=1
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  part flux12b-12gib "$(( seconds - (SECONDS - start) ))" "${flux_bench[@]}"
elif [[ $call == 2 ]]; then
  # What call 1 could not settle: the host-side timings on a quiet machine, the failures' tracebacks, and the
  # head-to-head alone on the device.
  part comfyui-0.33-every-prompt-streams-dynamic 150 "${pytest[@]}" --tb=long -x "${prompt_tests[@]}" \
    -k "cuda and dynamic and default and async" & pids=($!)
  part engine-quiet 100 "${pytest[@]}" tests/torch_only/test_engine_cuda.py tests/torch_only/test_file_tier.py -k "recorder or cuda" || status=1
  part comfyui-0.33-dynamic-vram-classic 100 "${pytest[@]}" "${dynamic_tests[@]}" -k "cuda and classic and every_node" || status=1
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  part flux12b-12gib "$(( seconds - (SECONDS - start) ))" "${flux_bench[@]}"
elif [[ $call == 3 ]]; then
  # The LoRA on a Dynamic VRAM model against ComfyUI's own Dynamic VRAM, beside the head-to-head (a tiny model's
  # server test: a few CPU cores, little of the GPU).
  part comfyui-0.33-lora-on-dynamic-vram 200 "${pytest[@]}" --tb=short "${prompt_tests[@]}" \
    -k "cuda and dynamic and default and async" & pids=($!)
  part flux12b-12gib "$(( seconds - (SECONDS - start) ))" "${flux_bench[@]}"
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
elif [[ $call == 6 ]]; then
  # Qwen-Image 20B-shaped (40.9 GB) on a 24 GiB card against ComfyUI's classic offload: without the Dynamic VRAM
  # rows, which would not fit the call's minutes beside the 41 GB file's writing. The file goes into memory where
  # /dev/shm has room, so a slow disk does not cost the call its minutes (the classic rows read it once, into the
  # model; Dynamic VRAM's reader, which would read it at every step, is not run on /dev/shm).
  files=()
  (( $(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 || echo 0) >= 48 )) && files=(--files /dev/shm)
  part qwen20b-24gib "$(( seconds - (SECONDS - start) ))" "$python" -m bench.comfy_bench "${bench_size[@]}" \
    "${files[@]}" --models qwen20b --budgets --cards 24 --rounds 2 --steps 6 --out "$out/bench" --no-dynamic-vram \
    --rows "fully resident" "ComfyUI, async offload on" "Partial GPU Residency, auto"
elif [[ $call == 5 ]]; then
  # What call 4 (H100, 2026-11-26, c40be75) left: Dynamic VRAM with the LRU cache (the cached node's twin kept
  # loaded across a plain prompt, then streaming again) beside the recorder's cost while nobody watches; then
  # how a first load's weights are best pinned (what its packing costs, against ComfyUI's registration in place),
  # and the per-step cost of LoRA patches applied on the device, Wan 14B- and Flux 12B-shaped blocks.
  part comfyui-0.33-dynamic-vram-lru 220 "${pytest[@]}" --tb=short "${lru_tests[@]}" & pids=($!)
  part engine-recorder 100 "${pytest[@]}" tests/torch_only/test_engine_cuda.py -k recorder || status=1
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  part pinning 60 "${pinning[@]}"
  part lora-cost-wan 150 "${lora_cost[@]}" --arch wan --blocks 8 $([[ $dry == 1 ]] || echo --latent 21 60 104)
  part lora-cost-flux "$(( seconds - (SECONDS - start) ))" "${lora_cost[@]}" --arch flux --blocks 4 \
    $([[ $dry == 1 ]] || echo --latent 128 128)
elif [[ $call == 7 ]]; then
  # The decisive comparison as users meet it: ComfyUI 0.33's default (Dynamic VRAM, reading the file it maps) and
  # its classic offload against the node on each, every model loaded from the checkpoint file. One round of 20
  # steps, as call 8: two would not fit the call beside the 28.6 GB file's writing.
  part wan14b-16gib-from-file "$(( seconds - (SECONDS - start) ))" "$python" -m bench.comfy_bench "${bench_size[@]}" \
    --models wan14b --budgets --cards 16 --rounds 1 --steps 20 --out "$out/bench" \
    --rows "fully resident" "ComfyUI, Dynamic" "ComfyUI, async offload on" "Partial GPU Residency, auto"
elif [[ $call == 8 ]]; then
  # What a user who presses Run waits for: a first prompt from the file, the node's blocks packed in the
  # background while its first steps run, against ComfyUI's classic offload and Dynamic VRAM; then what pinning a
  # first load costs each way (the packing thread's way among them: copy first, then register). One round of 20
  # steps: the H100 ran its 8 rows in 258 s (2026-11-28); two rounds with Dynamic VRAM's row, about 470 s, would
  # pass the part's cap, which loses the table (each round's line stays in the log).
  part flux12b-12gib-first-prompt 400 "$python" -m bench.comfy_bench "${bench_size[@]}" --models flux12b --budgets \
    --cards 12 --rounds 1 --steps "${round_steps:-20}" --out "$out/bench" \
    --rows "fully resident" "ComfyUI, Dynamic" "ComfyUI, async offload on" "Partial GPU Residency, auto"
  part pinning "$(( seconds - (SECONDS - start) - 60 ))" "${pinning[@]}"
  # The file tier's reads on this machine's disk: one thread against the pool, and the mapping copied as a Dynamic
  # VRAM model's blocks are packed, warm and cold (about 40 s: 27 reads of 4 GiB and its writing; the table is
  # printed only at the end, so the cap leaves room for a slow cold mapping copy).
  part file-reads 60 "${file_reads[@]}"
elif [[ $call == 10 ]]; then
  # Where ComfyUI streams the blocks itself (LTX-2 and MiniMax H3 under Dynamic VRAM): its prefetch against the node
  # on the same Dynamic VRAM model and against its classic offload, each model on a card it does not fit, from its
  # file. One round of 8 steps (a distilled model's 4-step prompt and an 8-step one): each row loads the model once
  # (call 8's Flux took 4-7 s a load, 38 s to write and load its 23.8 GB); about 110 s for LTX-2.3's 20.9 GB and
  # 200 s for MiniMax H3's 34.0 GB, the file written on the device.
  prefetch_bench=("$python" -m bench.comfy_bench "${bench_size[@]}" --budgets --rounds 1 --steps "${round_steps:-8}"
    --out "$out/bench"
    --rows "fully resident" "ComfyUI, Dynamic" "ComfyUI, async offload on" "Partial GPU Residency, auto on a Dynamic"
    "${prefetch_rows[@]}")
  if [[ $dry == 1 ]]; then
    # Both tiny models in one process: on this CPU most of a part's time is importing ComfyUI.
    part ltx23-and-minimax-h3 "$(( seconds - (SECONDS - start) ))" "${prefetch_bench[@]}" \
      --models ltx23_22b_fp8 minimax_h3_int8 --cards 16
  else
    part ltx23-22b-fp8-16gib 200 "${prefetch_bench[@]}" --models ltx23_22b_fp8 --cards 16
    part minimax-h3-int8-24gib "$(( seconds - (SECONDS - start) ))" "${prefetch_bench[@]}" --models minimax_h3_int8 \
      --cards 24
  fi
elif [[ $call == 9 ]]; then
  # Wan 2.2's switch as users meet it on a 16 GiB card: every prompt runs the high-noise expert, then the
  # low-noise one, each server on its own, the card carved out of the GPU (checked first by its test).
  part card 60 "${pytest[@]}" tests/test_bench.py -k "card_leaves" || status=1
  part wan14b-16gib-model-switch "$(( seconds - (SECONDS - start) ))" "${model_switch[@]}"
else
  # Issue 33's allocation counts (one process's own, so the zoo beside it cannot change them) and the zoo in
  # bf16, then the Wan head-to-head alone on the device, the node on a Dynamic VRAM model among its rows.
  part engine-allocates 100 "${pytest[@]}" tests/torch_only/test_engine_cuda.py -k allocates & pids=($!)
  part every-dit-on-the-device-bf16 120 "${zoo[@]}" --dtype bfloat16 || status=1
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  part wan14b-16gib "$(( seconds - (SECONDS - start) ))" "$python" -m bench.comfy_bench "${bench_size[@]}" \
    --models wan14b --budgets --cards 16 --rounds 2 --steps 6 --out "$out/bench" \
    --rows "fully resident" "ComfyUI, Dynamic" "ComfyUI, async offload on" "Partial GPU Residency, auto"
fi
echo "- whole call: $(( SECONDS - start )) s" >> "$report"
echo "gpu_campaign: figures in $report" >&2
exit "$status"
