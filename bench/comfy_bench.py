"""This pack against ComfyUI's own offloading, side by side in one process, on real-shaped models.

    .venv/bin/python -m bench.comfy_bench [--models wan14b flux12b qwen20b] [--budgets 0.25 0.5 0.75]
                                         [--cards 8 12 16 24] [--rounds 2] [--steps 20] [--out docs/results]

Each model is a checkpoint file, loaded as users load theirs: ``bench/checkpoints.py`` gives every key and shape
of the real file (Wan 2.1 T2V 14B, Flux.1-dev 12B, Qwen-Image 20B), the benchmark writes a safetensors file of
that layout with random bf16 weights N(0, 0.02) (nothing is downloaded; each tensor drawn on the device, written
one at a time), and every row loads it with the host's own Load Diffusion Model (``comfy.sd.
load_diffusion_model``): the classic model as with ``--disable-dynamic-vram`` (every weight read into host
memory), and, on ComfyUI 0.33 with CUDA, the Dynamic VRAM model as ComfyUI runs by default (its weights views of
the file's mapping, read from it as they are needed; the nodes' twin of it is built from the same file). The
file is in the page cache (it was just written): the reads are warm. It is deleted after the model's rows.

``flux12b_fp8`` and ``flux12b_q8_0`` are the same Flux with every Linear weight quantized (the rule of
``harness/tiny_models.py``), each tensor quantized on the device: fp8 e4m3 in ComfyUI's per-layer
``comfy_quant`` format (its scale and config entries beside each weight; ComfyUI 0.33 loads it as
``QuantizedTensor``); and GGUF Q8_0 (the non-quantized tensors in F32), loaded by city96's ComfyUI-GGUF's
``Unet Loader (GGUF)`` (``GGMLTensor``), the pack loaded as ComfyUI loads a custom node (from the host's
``custom_nodes`` or this repo's test host's). A host that cannot load one (0.3.75 has no per-layer
``comfy_quant``; no ComfyUI-GGUF) skips it and writes why. Budgets, bytes streamed and the lower bound count the
weights as stored (``offload.module_bytes``): quantized data and scales.

Every configuration is loaded, then runs the diffusion model's forward (``apply_model``) on fixed inputs
for ``--steps`` steps, as one generation would; that is a round. Rows of one budget take their rounds in
turn (A B C A B C ...), so a drift of the machine touches them alike, and the group's first row is
measured a second time at the end of each round, as a control. Per row: load plus the first step, the
median of every later step with its min and max, the wall time of a round, peak VRAM, peak host memory over
the load and the steps (anonymous, sampled: what the process allocated; and the resident set's high-water mark:
also the file's mapped pages and the driver's pinned allocations) and the bytes the pack pinned. Two rows that
placed the same blocks the same way must agree within 2 %, or the run says it is too noisy (``too_noisy`` in the
JSON, a line above the table).

Budgets: ``--budgets``, shares of the model's bytes handed to ComfyUI's loader
(``partially_load(device, budget)``, as ``load_models_gpu`` passes its ``lowvram_model_memory``); and
``--cards``, VRAM sizes users own (GiB): a filler allocation leaves exactly that much device memory free
and ComfyUI's own ``load_models_gpu`` decides what to load, as on such a card (CUDA only).

Configurations: fully resident (the reference); every block streamed (Async Block Offload, prefetch 1
and 2); per budget, ComfyUI's partial loading with its async offload on (2 streams, its NVIDIA default)
and off, the pack's nodes (Async Block Offload with the leading blocks that fit, Partial GPU Residency
trailing / strided / auto, the Sequential Offload Wrapper). On ComfyUI 0.33 with CUDA and comfy-aimdo,
each card also gets ComfyUI's Dynamic VRAM and each node on a Dynamic VRAM model (elsewhere those rows
are skipped, and the run's notes say why). The lower bound is max(resident step, bytes that do not fit /
pinned host-to-device bandwidth).

Writes ``<model>.json``, ``<model>.md`` (the table and the issue's targets) and ``<model>.png`` (step
time against the share budgets, one line per method) to ``--out``.

Needs a CUDA device and exits with status 2 without one. ``--smoke`` runs the same code on the CPU with
tiny shapes (the times mean nothing), so the test suite can check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness.comfy_host import REPO, interrupt_on_sigterm

from bench.checkpoints import CHECKPOINTS, SMOKE_CHECKPOINTS, Checkpoint
from bench.comfy_models import Comfy, cannot_load, import_comfy, load_file, load_model, make_inputs
from bench.configs import Bases, configs
from bench.measure import OUT_OF_MEMORY, measure_all, measure_round, progress
from bench.plot import line_chart
from bench.results import (
    CARD,
    GIB,
    RESIDENT,
    SHARE,
    Budget,
    ModelRun,
    markdown,
    series,
    write,
    write_skipped,
)
from bench.timing import file_read_gbps, h2d_bandwidth_gbps

NO_CUDA_EXIT = 2
COMMIT_ENV = "BLOCK_OFFLOAD_COMMIT"  # the commit a copy of the checkout was made from, where its .git is not


def run_model(comfy: Comfy, checkpoint: Checkpoint, args: argparse.Namespace, device: torch.device, bandwidth: float,
              folder: Path):  # fmt: skip
    """Every configuration on ``checkpoint``'s model, written as its file into ``folder``, every row loaded from
    that file; the file deleted after."""
    dtype = torch.float32 if args.smoke else torch.bfloat16
    started = time.perf_counter()
    shapes = checkpoint.shapes(dtype)
    path, classic = load_model(comfy, checkpoint, shapes, device, dtype, folder)
    try:
        read_gbps = file_read_gbps(path)  # warm: the file was just written, and read by the classic load
        read = "" if read_gbps is None else f", read at {read_gbps:.1f} GB/s as the file tier reads it"
        notes = {"checkpoint": f"{path.name}, {path.stat().st_size / 1e9:.2f} GB, every row loaded from it{read}"}
        why_not = no_dynamic_vram_rows(comfy, checkpoint, args)
        if why_not is not None:
            notes["Dynamic VRAM rows"] = f"skipped: {why_not}"
        # ComfyUI's default on NVIDIA: the same file mapped, its weights read from it as they are needed.
        dynamic = None if why_not is not None else load_file(comfy, path, device, dtype, dynamic=True)
        return measure_model(comfy, checkpoint, shapes, args, device, bandwidth, read_gbps, classic, dynamic, notes,
                             started)  # fmt: skip
    finally:
        path.unlink()


def no_dynamic_vram_rows(comfy: Comfy, checkpoint: Checkpoint, args: argparse.Namespace) -> str | None:
    """Why the run has no Dynamic VRAM rows, or None."""
    if args.no_dynamic_vram:
        return "--no-dynamic-vram"
    if comfy.no_dynamic_vram:
        return comfy.no_dynamic_vram
    if checkpoint.is_gguf:
        return "ComfyUI-GGUF's loader makes its own classic patcher (GGUFModelPatcher)"
    return None


def measure_model(comfy: Comfy, checkpoint: Checkpoint, shapes: dict[str, torch.Tensor], args: argparse.Namespace,
                  device: torch.device, bandwidth: float, read_gbps: float | None, classic, dynamic,
                  notes: dict[str, str], started: float) -> ModelRun:  # fmt: skip
    """Every configuration on the ``classic`` model and its ``dynamic`` load (None: no Dynamic VRAM rows);
    ``bandwidth``: pinned host-to-device, ``read_gbps``: the checkpoint file's read, in GB/s."""
    # As stored (quantized data and scales), as the pack's plan counts them: budgets and lower bounds in these.
    model_bytes = comfy.offload.module_bytes(classic.model.diffusion_model)
    progress(
        f"{checkpoint.name}: written and loaded in {time.perf_counter() - started:.0f} s, {model_bytes / GIB:.2f} GiB"
    )
    inputs = make_inputs(checkpoint, shapes, device)
    blocks = comfy.find_blocks(classic.model.diffusion_model).blocks
    block_bytes = [comfy.offload.module_bytes(block) for _, block in blocks]
    # What the host holds a block's Linear weights as (a quantized model's tensor kind).
    weight = next(w for _, block in blocks for w in block.parameters() if w.dim() == 2)
    notes["block weights"] = f"{type(weight).__name__}, {weight.dtype}"
    # ComfyUI's own estimate of the sampling activations (what its sampler asks load_models_gpu to leave free).
    need = int(classic.model.memory_required(inputs["x"].shape))
    bases = Bases(
        classic, dynamic, block_bytes, model_bytes - sum(block_bytes), need + comfy.mm.minimum_inference_memory()
    )
    budgets = [Budget(SHARE, int(share * model_bytes)) for share in args.budgets]
    if device.type == "cuda":
        budgets += [Budget(CARD, int(gib * GIB)) for gib in args.cards]
    elif args.cards:
        # A card is a filler allocation on a CUDA device. On the CPU (a dry run of a campaign call, which names only
        # cards) half the model's bytes stand in, so the offloading rows the call measures run their code too.
        notes["card budgets"] = "skipped: a card is imposed by a filler allocation on a CUDA device"
        if not budgets:
            budgets = [Budget(SHARE, model_bytes // 2)]
            notes["card budgets"] += "; 50% of the model's bytes stand in for them"
    dropped: dict[str, str] = {}
    measurements = measure_all(
        configs(comfy, bases, budgets, args.rows),
        args.rounds,
        lambda config: measure_round(comfy, config, inputs, args.steps, need),
        dropped,
    )
    comfy.mm.NUM_STREAMS = 2
    meta = run_meta(device, args)
    meta["wall time"] = f"{time.perf_counter() - started:.0f} s"
    meta.update(notes)
    if dropped:
        meta["dropped rows"] = "; ".join(f"{row}: {why}" for row, why in dropped.items())
    failed = tuple(row for row, why in dropped.items() if why != OUT_OF_MEMORY)
    return ModelRun(
        checkpoint.name,
        checkpoint.title,
        model_bytes,
        bandwidth,
        measurements,
        meta,
        read_gbps=read_gbps,
        failed=failed,
    )


def run_meta(device: torch.device, args: argparse.Namespace) -> dict[str, str]:
    def output(*command: str) -> str:
        try:
            return subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    import comfyui_version  # ComfyUI's own, on the path once import_comfy ran

    dirty = output("git", "status", "--porcelain")

    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "driver": output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        if device.type == "cuda"
        else "",
        "torch": torch.__version__,
        "ComfyUI": comfyui_version.__version__,
        # The device machine's copy of the checkout may carry an older .git: the commit sent with it is named.
        "commit": os.environ.get(COMMIT_ENV)
        or output("git", "rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if dirty else ""),
        "command": " ".join(["python -m bench.comfy_bench", *args.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "steps": f"{args.rounds} interleaved rounds of {args.steps} steps (the first step of each is not steady)",
    }
    return {key: value for key, value in meta.items() if value}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(CHECKPOINTS), default=list(CHECKPOINTS))
    parser.add_argument(
        "--budgets", nargs="*", type=float, default=[0.25, 0.5, 0.75], help="shares of the model's bytes"
    )
    parser.add_argument("--cards", nargs="*", type=float, default=[8, 12, 16, 24], help="VRAM sizes in GiB (CUDA)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per row (each loads the model)")
    parser.add_argument("--steps", type=int, default=20, help="steps per round; all but the first are steady")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=[],
        help="only the methods starting with one of these (a run that must fit "
        "a time limit; fully resident is always needed)",
    )
    parser.add_argument(
        "--no-dynamic-vram",
        action="store_true",
        help="no Dynamic VRAM rows (a run that must fit a time limit)",
    )
    parser.add_argument(
        "--files",
        type=Path,
        default=None,
        help="where the checkpoint files are written (default: a temporary folder; /dev/shm spares a slow disk)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, times mean nothing"
    )
    args = parser.parse_args(argv)
    args.argv = argv
    if args.budgets and not 0 < min(args.budgets) <= max(args.budgets) < 1:
        parser.error("budgets are shares of the model's bytes, between 0 and 1")
    if args.rows and not any(RESIDENT.startswith(row) for row in args.rows):
        parser.error(f"--rows must keep {RESIDENT!r}: every ratio is to it")
    if args.rounds < 1 or args.steps < 2:
        parser.error("at least 1 round of 2 steps: the first step of a round is not a steady one")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # ComfyUI's and the pack's INFO lines: off
    if not torch.cuda.is_available() and not args.smoke:
        print(
            "comfy_bench: no CUDA device. This benchmark compares GPU offloading and its figures only mean "
            "something on a GPU; run it on a CUDA machine (docs/benchmarks.md). "
            "--smoke runs the same code with tiny shapes on the CPU, to test the script only.",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: threads only add contention on a shared machine
    with (
        tempfile.TemporaryDirectory(prefix="comfy_bench_user_") as user_dir,
        tempfile.TemporaryDirectory(prefix="comfy_bench_files_", dir=args.files) as files,
    ):
        comfy = import_comfy(args.smoke, Path(user_dir))
        bandwidth = h2d_bandwidth_gbps(device, nbytes=(64 << 20) if args.smoke else (1 << 30))
        failed: list[str] = []
        for name in args.models:
            checkpoint = (SMOKE_CHECKPOINTS if args.smoke else CHECKPOINTS)[name]
            reason = cannot_load(checkpoint)
            if reason is not None:
                progress(f"{name}: skipped: {reason}")
                data, table = write_skipped(name, checkpoint.title, reason, run_meta(device, args), args.out)
                print(f"wrote {data}, {table}")
                continue
            run = run_model(comfy, checkpoint, args, device, bandwidth, Path(files))
            data, table = write(run, args.out)
            chart = line_chart(
                series(run),
                args.out / f"{run.model}.png",
                title=f"{run.title}: step time vs VRAM budget ({run.meta.get('device', '')})",
                x_label="VRAM budget for the model's weights (GiB)",
                y_label="seconds per step (median)",
            )
            print(markdown(run))
            print(f"wrote {data}, {table}, {chart}")
            failed += [f"{name}: {row}" for row in run.failed]
    if failed:
        # The tables are written, without these rows; the exit status says a row has a bug to fix.
        progress(f"comfy_bench: rows that raised (tracebacks above): {'; '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    interrupt_on_sigterm()
    sys.exit(main())
