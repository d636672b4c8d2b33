"""The ComfyUI benchmark (bench/comfy_bench.py) without a GPU: it refuses, its smoke mode builds every model
it offers from this host's own detection and runs it, rows of one budget are measured in interleaved
rounds, and its statistics, noise check, table, targets and plot come out right from known figures.
The GPU check (scripts/gpu_check.sh) refuses without CUDA too."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import HOST_VERSION
from PIL import Image

from harness import tiny_quantized
from harness.comfy_host import HOST_DIR, REPO
from harness.dynamic_vram import DynamicVram

from bench.checkpoints import (
    CHECKPOINTS,
    FLUX12B_FP8,
    FLUX12B_Q8_0,
    LTX23_22B_FP8,
    MINIMAX_H3_INT8,
    SMOKE_CHECKPOINTS,
)
from bench.comfy_models import GGUF_PACK, load_file, load_model, q8_0
from bench.configs import Config
from bench.measure import OUT_OF_MEMORY, Placed, measure_all
from bench.plot import line_chart
from bench.results import (
    AGAIN,
    ALL_STREAMED,
    AUTO,
    CARD,
    COMFYUI,
    GIB,
    RESIDENT,
    SHARE,
    Budget,
    Measurement,
    ModelRun,
    Round,
    markdown,
    series,
)
from block_offload.offload.layout import ALIGNMENT

#: The benchmarks and their arithmetic that import no ComfyUI (the engine's, the planner's, the figures').
NO_COMFYUI = pytest.mark.one_host(reason="no ComfyUI in it")
#: A benchmark's run through ComfyUI, whose figures are measured on the GPU campaign's host (ComfyUI 0.33) only; what
#: each host builds and loads for it is smoke-tested on every host (the Flux and Qwen-Image and fp8 and Q8_0 tests).
CAMPAIGN_HOST = pytest.mark.one_host(reason="its figures are measured on the GPU campaign's host only")


def bench(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.comfy_bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


@NO_COMFYUI
def test_without_cuda_it_refuses_with_status_2() -> None:
    done = bench("--models", "wan14b", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2, done.stderr
    assert "no CUDA device" in done.stderr and "--smoke" in done.stderr


@NO_COMFYUI
def test_the_gpu_check_refuses_without_cuda_and_runs_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "all", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable},
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    assert "sees no CUDA device" in done.stderr and "nothing was run" in done.stderr
    assert not any(tmp_path.iterdir()), "it wrote a report without running anything"


#: Every way ``bench/pinning.py`` pins a first load's weights, by the name it prints each under.
PINNING_WAYS = (
    "register first",
    "copy first",
    "in place",
    "torch's pinned allocator",
    "file copied first",
    "file read",
    "file in place",
)


def campaign_dry_run(out: Path, *call: str) -> str:
    """``scripts/gpu_campaign.sh [CALL] --dry-run`` into ``out``: its report, once it exited 0."""
    from harness.comfy_host import resolve_comfyui_path

    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_campaign.sh"), *call, "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable, "COMFYUI_PATH": str(resolve_comfyui_path())},
        cwd=REPO,
    )
    report = (out / "campaign.md").read_text()
    assert done.returncode == 0, report + done.stderr[-2000:]
    return report


@pytest.mark.skipif(HOST_VERSION.startswith("0.3."), reason="the GPU campaign runs ComfyUI 0.33 (Dynamic VRAM)")
def test_the_gpu_campaign_dry_run_runs_every_part_of_the_call_a_lent_gpu_runs_first(tmp_path: Path) -> None:
    """``scripts/gpu_campaign.sh --dry-run`` with no call named: the call a lent GPU runs first
    (docs/records/gpu-campaign.md's order: 8, the first prompt), each part with tiny shapes, exits 0 and leaves its
    figures in the report: what the next GPU runs cannot break unseen, the node's row of the head-to-head included (a
    share budget for the card)."""
    report = campaign_dry_run(tmp_path)
    assert report.startswith("### GPU campaign call 8,"), report
    for part in ("flux12b-12gib-first-prompt", "pinning", "file-reads"):
        assert f"#### {part}: exit 0" in report, report
    # The head-to-head's first-prompt columns, every way of pinning, and the reads each way warm and cold.
    # The whole prompt's column: 5 steps in a dry run (20 on the GPU).
    assert "| load + 1st step s | first 4-step prompt s | first 5-step prompt s |" in report, report
    assert "| fully resident |" in report, report
    # On the CPU half the model's bytes stand in for the card: ComfyUI's offloading and the node's rows run too.
    assert "| ComfyUI, async offload on | 50% (" in report and "| Partial GPU Residency, auto | 50% (" in report, report
    assert all(f"\n{way}: " in report for way in PINNING_WAYS), report
    assert "| warm |" in report and "| cold |" in report and "the mapping copied, 1 thread" in report, report


@pytest.mark.skipif(HOST_VERSION.startswith("0.3."), reason="the GPU campaign runs ComfyUI 0.33 (Dynamic VRAM)")
def test_the_gpu_campaign_dry_run_of_call_10_has_its_rows_and_columns(tmp_path: Path) -> None:
    """Call 10 (against ComfyUI's own block prefetch, issue 74) on the CPU: tiny LTX-2 and MiniMax H3 from their
    files (MiniMax H3's blocks int8 as in the call; the tiny LTX-2's layers are too small to quantize), each row's
    first 4- and 5-step prompts (8 on the GPU), steady step, peak VRAM and host RAM. Dynamic VRAM's rows need CUDA:
    the report says they were skipped, and the node on the classic model runs the node's code in their stead."""
    report = campaign_dry_run(tmp_path, "10")
    assert report.startswith("### GPU campaign call 10,") and "#### ltx23-and-minimax-h3: exit 0" in report, report
    columns = "| load + 1st step s | first 4-step prompt s | first 5-step prompt s |"  # 8 steps on the GPU
    for model in (LTX23_22B_FP8, MINIMAX_H3_INT8):
        table = (tmp_path / "bench" / f"{model}.md").read_text()
        assert columns in table and "| peak VRAM GiB | peak host RAM GiB, anon / resident |" in table, table
        for row in (RESIDENT, f"{COMFYUI}, async offload on", AUTO):
            assert f"\n| {row} |" in table, (row, table)
        assert "Dynamic VRAM rows skipped: smoke runs on the CPU" in table, table
    data = json.loads((tmp_path / "bench" / f"{MINIMAX_H3_INT8}.json").read_text())
    assert data["meta"]["block weights"].startswith("QuantizedTensor"), data["meta"]


@pytest.mark.skipif(HOST_VERSION.startswith("0.3."), reason="Dynamic VRAM came with ComfyUI 0.33")
@pytest.mark.parametrize("name", ["wan14b", FLUX12B_FP8])
def test_every_row_loads_the_checkpoint_file_as_comfyui_loads_it(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, tmp_path: Path, name: str
) -> None:
    """The benchmark writes each checkpoint as a file (bf16, or fp8 in ComfyUI's per-layer format) and every row
    loads it with ComfyUI's own Load Diffusion Model: the classic model as with ``--disable-dynamic-vram``,
    every weight copied into the process and its layers built with their weights although the benchmark turned
    Dynamic VRAM on (the first GPU campaign failed there: "the host built a model unlike the checkpoint", 628
    keys); the Dynamic VRAM model as views of the file's mapping. Both hold the file's tensors, and the flag is
    on again after."""
    from comfy import memory_management, model_detection
    from safetensors import safe_open

    from block_offload.nodes.dynamic_vram import file_slice

    host = SimpleNamespace(detection=model_detection, sd=comfy.sd)
    checkpoint, cpu = SMOKE_CHECKPOINTS[name], torch.device("cpu")
    path, classic = load_model(host, checkpoint, checkpoint.shapes(torch.bfloat16), cpu, torch.bfloat16, tmp_path)
    assert path.parent == tmp_path and memory_management.aimdo_enabled
    dynamic = load_file(host, path, cpu, torch.bfloat16, dynamic=True)
    with safe_open(path, framework="pt") as stored:
        keys = list(stored.keys())
        weights = [key for key in keys if key.endswith(".weight")]
        assert len(weights) > 20 and (checkpoint.quant is None) == all(stored.get_tensor(k).dtype == torch.bfloat16
                                                                       for k in weights)  # fmt: skip
        for model, from_file in ((classic, False), (dynamic, True)):
            held = model.model.diffusion_model.state_dict()
            for key in weights:
                weight = held[key]
                data, want = getattr(weight, "_qdata", weight), stored.get_tensor(key)  # a QuantizedTensor's bytes
                # The classic model may compute in another dtype than the file's (fp32 on this CPU): exactly.
                assert data.dtype == want.dtype or not from_file, key
                assert torch.equal(data.to(want.dtype).view(torch.uint8), want.view(torch.uint8)), key
                assert (file_slice(data) is not None) == from_file, key
    linears = [m for m in classic.model.diffusion_model.modules() if type(m).__name__.endswith("Linear")]
    assert linears and all(layer.weight is not None for layer in linears)


#: The checkpoints whose layout ComfyUI's own classes give (built on the meta device, so ComfyUI is imported).
FROM_COMFYUI_CLASSES = (LTX23_22B_FP8, MINIMAX_H3_INT8)


@NO_COMFYUI
def test_the_real_checkpoints_have_the_real_models_sizes() -> None:
    """The shape descriptions the GPU run builds from, counted without building anything."""
    params = {
        name: sum(t.numel() for t in checkpoint.shapes(torch.bfloat16).values())
        for name, checkpoint in CHECKPOINTS.items()
        if name not in FROM_COMFYUI_CLASSES
    }
    # Wan 2.1 T2V 14B: 14.29e9 parameters; Flux.1-dev: 11.90e9; Qwen-Image: 20.43e9 (their published sizes).
    flux = pytest.approx(11.90e9, rel=2e-3)
    assert params == {"wan14b": pytest.approx(14.29e9, rel=2e-3), "flux12b": flux, "qwen20b": pytest.approx(20.43e9,
                      rel=2e-3), FLUX12B_FP8: flux, FLUX12B_Q8_0: flux}  # fmt: skip
    assert set(SMOKE_CHECKPOINTS) == set(CHECKPOINTS)


@pytest.mark.skipif(HOST_VERSION.startswith("0.3."), reason="LTX-2 and MiniMax H3 came after ComfyUI 0.3.75")
def test_the_checkpoints_comfyui_prefetches_have_its_classes_real_sizes(comfy: SimpleNamespace) -> None:
    """LTX-2.3 and MiniMax H3 as ComfyUI 0.33 builds them at their default sizes (docs/benchmarks.md's figures), and
    ComfyUI's detection reads the file's keys and metadata back into the same config."""
    params = {
        name: sum(t.numel() for t in CHECKPOINTS[name].shapes(torch.bfloat16).values()) for name in FROM_COMFYUI_CLASSES
    }
    assert params == {
        LTX23_22B_FP8: pytest.approx(19.72e9, rel=1e-3),
        MINIMAX_H3_INT8: pytest.approx(33.12e9, rel=1e-3),
    }
    from comfy import model_detection

    for name in FROM_COMFYUI_CLASSES:
        checkpoint = CHECKPOINTS[name]
        shapes = checkpoint.shapes(torch.bfloat16)
        metadata = dict(checkpoint.metadata) or None
        config = model_detection.model_config_from_unet(shapes, "", metadata=metadata).unet_config
        switches = json.loads(checkpoint.metadata["config"])["transformer"] if checkpoint.metadata else {}
        assert switches.items() <= config.items(), (name, config)


@CAMPAIGN_HOST
def test_smoke_run_writes_the_table_the_json_and_the_plot(tmp_path: Path) -> None:
    done = bench("--smoke", "--models", "wan14b", "--budgets", "0.5", "--rounds", "2", "--steps", "3",
                 "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "wan14b.json").read_text())
    rows = {row["method"]: row for row in data["rows"]}
    expected = {
        RESIDENT,
        f"{ALL_STREAMED}, prefetch 1",
        f"{ALL_STREAMED}, prefetch 2",
        RESIDENT + AGAIN,
        f"{COMFYUI}, async offload on",
        f"{COMFYUI}, async offload off",
        "Async Block Offload, leading blocks that fit, prefetch 1",
        "Async Block Offload, leading blocks that fit, prefetch 2",
        "Partial GPU Residency, trailing",
        "Partial GPU Residency, strided",
        f"{AUTO} (first run: strided, measuring)",
        AUTO,
        "Sequential Offload Wrapper, prefetch 2",
        f"{COMFYUI}, async offload on" + AGAIN,
    }
    assert set(rows) == expected
    for method, row in rows.items():
        first_run = method.endswith("measuring)")
        # Two rounds of three steps: each round's first step is the load's; the other two are steady.
        assert len(row["rounds"]) == (1 if first_run else 2) and row["steady_steps"] == (2 if first_run else 4)
        steady = [ms for one in row["rounds"] for ms in one["step_ms"]]
        assert row["min_ms"] == min(steady) and row["max_ms"] == max(steady) and row["min_ms"] > 0
        assert row["load_first_ms"] > 0 and row["wall_ms"] > row["load_first_ms"]
        assert 0 < row["host_anon_peak_bytes"] <= row["host_rss_peak_bytes"]
        # Each load of the pack's rows says what it copied into host buffers and how long that took, of its
        # load and first step; ComfyUI's rows have no such copy.
        packs = not method.startswith((COMFYUI, RESIDENT))
        for one in row["rounds"]:
            packing, packed = one["packing_ms"], one["packed_bytes"]
            # Every load is timed apart from its first step; the pack's rows also say what that step copied, and
            # how much of it came from blocks not pinned or packed yet.
            assert 0 < one["load_ms"] < one["load_first_ms"], (method, one)
            if packs:
                assert 0 < packing < one["load_first_ms"] and packed > 0, (method, one)
                unpacked_ms, copy_ms = one["first_unpacked_ms"], one["first_copy_ms"]
                assert 0 <= unpacked_ms <= copy_ms and one["first_unpacked_bytes"] >= 0, (method, one)
            else:
                assert packing is None and packed is None and one["first_copy_ms"] is None, (method, one)
        assert (row["packing_ms"] is not None) == packs, method
    # Interleaved: every row of a group ran its first round before any row of that group ran its second.
    for group in ({RESIDENT, f"{ALL_STREAMED}, prefetch 1", RESIDENT + AGAIN},
                  {f"{COMFYUI}, async offload off", "Partial GPU Residency, strided", AUTO}):  # fmt: skip
        firsts = [rows[m]["rounds"][0]["started_s"] for m in group]
        seconds = [rows[m]["rounds"][1]["started_s"] for m in group]
        assert max(firsts) < min(seconds)
    assert rows[RESIDENT]["x_resident"] == 1.0
    # The planner placed the automatic rows of the rounds and said what it expected; the first one measured.
    assert "not measured on this device yet" in rows[f"{AUTO} (first run: strided, measuring)"]["placement"]
    assert "not measured" not in rows[AUTO]["placement"]
    # The strided rows and the automatic first run placed the same blocks: the noise check pairs them.
    assert rows["Partial GPU Residency, strided"]["placement_key"] == rows[f"{AUTO} (first run: strided, measuring)"][
        "placement_key"] != ""  # fmt: skip
    # Against ComfyUI's fastest row at the budget, its noise control included (it may be the fastest).
    assert min(row["x_comfyui"] for method, row in rows.items() if method.startswith(COMFYUI)) == 1.0
    assert rows[f"{ALL_STREAMED}, prefetch 1"]["streamed_bytes"] > 0
    assert 0 <= rows[f"{ALL_STREAMED}, prefetch 1"]["overlap"] <= 1
    # Four steady steps per row are fewer than a median needs: the run says it is too noisy, and why.
    assert data["too_noisy"] and any("fewer than 7 steady steps" in line for line in data["noise"])
    assert "card budgets" in data["meta"] and "Dynamic VRAM rows" in data["meta"]
    # Every row loaded the file the run wrote, whose reading it measured as the file tier reads.
    assert "wan14b.safetensors" in data["meta"]["checkpoint"] and data["read_gbps"] > 0
    table = (tmp_path / "wan14b.md").read_text()
    assert table.count("\n| ") == 2 + len(expected) and "**Too noisy to tell 3 % apart:**" in table
    assert "Targets:" in table and "Measured on: device cpu" in table
    with Image.open(tmp_path / "wan14b.png") as image:
        assert image.size == (1280, 600)


@CAMPAIGN_HOST
def test_a_benchmark_stopped_by_its_time_cap_removes_its_checkpoint_files(tmp_path: Path) -> None:
    """The GPU campaign runs each part under ``timeout`` (SIGTERM): a part stopped there must not leave its
    checkpoint behind (Qwen-Image's is 41 GB, on a machine of 64 GiB of disk, in /dev/shm where it has room)."""
    files = tmp_path / "files"
    files.mkdir()
    args = ["--smoke", "--models", "wan14b", "--budgets", "0.5", "--rounds", "50", "--steps", "20",
            "--files", str(files), "--out", str(tmp_path / "out")]  # fmt: skip
    run = subprocess.Popen(
        [sys.executable, "-m", "bench.comfy_bench", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 240
        while not list(files.glob("comfy_bench_files_*/*.safetensors")) and run.poll() is None:
            assert time.monotonic() < deadline, "the benchmark wrote no checkpoint in 240 s"
            time.sleep(0.1)
        assert run.poll() is None, "the benchmark ended before it could be stopped:\n" + run.stderr.read()[-3000:]
        time.sleep(1.0)  # into its rows
        run.send_signal(signal.SIGTERM)
        stderr = run.communicate(timeout=60)[1]
    finally:
        run.kill()
    assert run.returncode != 0, stderr[-3000:]
    assert "KeyboardInterrupt" in stderr, stderr[-3000:]
    assert not list(files.iterdir()), f"left behind: {[p.name for p in files.rglob('*')]}"


def test_smoke_builds_and_runs_flux_and_qwen_image_from_the_hosts_own_detection(tmp_path: Path) -> None:
    """The other models the benchmark offers, built by this host's ComfyUI (its config, its classes) and
    streamed by the pack; two rows each, since every row's code is the same for all models (above)."""
    done = bench("--smoke", "--models", "flux12b", "qwen20b", "--budgets", "0.5", "--rounds", "1", "--steps", "2",
                 "--rows", RESIDENT, "Partial GPU Residency, strided", "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for model, architecture in (("flux12b", "Flux ("), ("qwen20b", "QwenImageTransformer2DModel (")):
        data = json.loads((tmp_path / f"{model}.json").read_text())
        rows = {row["method"]: row for row in data["rows"]}
        assert set(rows) == {RESIDENT, RESIDENT + AGAIN, "Partial GPU Residency, strided",
                             "Partial GPU Residency, strided" + AGAIN}  # fmt: skip
        assert rows["Partial GPU Residency, strided"]["placement"].startswith(architecture)
        assert rows["Partial GPU Residency, strided"]["streamed_bytes"] > 0
        assert data["model_bytes"] > GIB  # width 3072: what this host's detection fixes for both


def stored_bytes(name: str, keys: str) -> tuple[int, int]:
    """(bytes, tensors) of a smoke checkpoint's tensors whose keys start with ``keys``, as its format stores
    them: a quantized weight as fp8 (1 byte a value and an fp32 scale) or Q8_0 (34 bytes per 32 values), the
    rest in fp32, as the smoke builds them."""
    checkpoint = SMOKE_CHECKPOINTS[name]
    total = count = 0
    for spec in checkpoint.layout():
        if not spec.key.startswith(keys):
            continue
        values = math.prod(spec.shape)
        quantized = tiny_quantized.quantized(spec.key, torch.empty(spec.shape, device="meta"))
        if not quantized:
            total, count = total + 4 * values, count + 1
        elif checkpoint.is_gguf:
            total, count = total + values // 32 * 34, count + 1
        else:
            total, count = total + values + 4, count + 2
    return total, count


def test_smoke_runs_flux_fp8_and_q8_0_as_stored_and_streams_their_stored_bytes(tmp_path: Path) -> None:
    """The quantized variants on the CPU (the tiny Wan shape quantized: the tiny Flux takes a minute a model):
    the host loads them as its quantized tensors, the pack streams them as stored, and the bound counts that."""
    streamed = f"{ALL_STREAMED}, prefetch 1"
    done = bench("--smoke", "--models", FLUX12B_FP8, FLUX12B_Q8_0, "--budgets", "--rounds", "1", "--steps", "2",
                 "--rows", RESIDENT, streamed, "--out", str(tmp_path), timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    gguf_here = (HOST_DIR / "custom_nodes" / GGUF_PACK / "nodes.py").is_file() and importlib.util.find_spec("gguf")
    cases = {FLUX12B_FP8: ("QuantizedTensor", HOST_VERSION.startswith("0.3."), "comfy_quant"),
             FLUX12B_Q8_0: ("GGMLTensor", not gguf_here, "ComfyUI-GGUF")}  # fmt: skip
    for model, (kind, unloadable, why) in cases.items():
        data = json.loads((tmp_path / f"{model}.json").read_text())
        if unloadable:
            assert why in data["skipped"] and "rows" not in data
            continue
        rows = {row["method"]: row for row in data["rows"]}
        assert set(rows) == {RESIDENT, streamed, RESIDENT + AGAIN}
        assert data["meta"]["block weights"].startswith(kind + ",")
        model_bytes, _ = stored_bytes(model, "")
        block_bytes, tensors = stored_bytes(model, "blocks.")
        assert data["model_bytes"] == model_bytes  # stored: well under the fp32 model's 4 bytes a value
        row = rows[streamed]
        assert row["placement"].startswith("Wan") and "0/4 blocks resident" in row["placement"]
        assert row["streamed_bytes"] == block_bytes
        # ComfyUI's formats align each tensor in the pinned buffer; GGUF's are stored aligned already.
        assert block_bytes <= row["copied_bytes"] <= block_bytes + ALIGNMENT * tensors
        bound = max(data["resident_ms"], block_bytes / (data["bandwidth_gbps"] * 1e6))
        assert row["lower_bound_ms"] == pytest.approx(bound)


def test_q8_0_on_the_device_is_what_the_gguf_package_writes() -> None:
    gguf = pytest.importorskip("gguf")
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    weight[0, :32] = 0  # a block of zeros: scale 0
    expected = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(q8_0(weight), torch.from_numpy(expected))


def made_up_round(started_s: float, *step_ms: float) -> Round:
    return Round(started_s, 2 * step_ms[0], step_ms, 3 * sum(step_ms), 0, GIB, GIB, 0)


def made_up_run() -> ModelRun:
    """Figures worked out by hand: a 100 GiB model, 10 GB/s, resident 1 s per step."""
    half = Budget(SHARE, 50 * GIB)

    def m(method: str, budget: Budget | None, ms: float, streamed: float = 0, predicted: float | None = None,
          key: str = "") -> Measurement:  # fmt: skip
        # Seven steady steps: the median is ``ms``, the spread 0.98 ms to 1.02 ms.
        steps = (ms, 0.98 * ms, 1.02 * ms, ms, 0.99 * ms, 1.01 * ms, ms)
        return Measurement(method, budget, (made_up_round(0, *steps),), int(streamed * GIB), 0.9, predicted, "", key)

    return ModelRun(
        "wan14b",
        "made up",
        100 * GIB,
        10.0,
        [
            m(RESIDENT, None, 1000),
            m(f"{ALL_STREAMED}, prefetch 1", None, 11000, streamed=100),
            m(f"{ALL_STREAMED}, prefetch 2", None, 12500, streamed=100),
            m(f"{COMFYUI}, async offload on", half, 9000),
            m(f"{COMFYUI}, async offload off", half, 12000),
            m("Partial GPU Residency, strided", half, 6000, key="resident [0, 2], prefetch 1"),
            m(AUTO, half, 6200, predicted=5890),
            m(f"{COMFYUI}, async offload on" + AGAIN, half, 9100),  # 1.1 % apart: within the tolerance
        ],
        {"device": "made up"},
    )


@NO_COMFYUI
def test_ratios_targets_and_statistics_from_known_figures(tmp_path: Path) -> None:
    run = made_up_run()
    rows = {row["method"]: row for row in run.rows()}
    bound_at_half = 50 * GIB / 10e9 * 1000  # what does not fit, at 10 GB/s: 5369 ms
    assert rows[AUTO]["ms_per_step"] == 6200 and rows[AUTO]["min_ms"] == pytest.approx(0.98 * 6200)
    assert rows[AUTO]["max_ms"] == pytest.approx(1.02 * 6200) and rows[AUTO]["steady_steps"] == 7
    assert rows[AUTO]["lower_bound_ms"] == pytest.approx(bound_at_half)
    assert rows[AUTO]["x_lower_bound"] == pytest.approx(6200 / bound_at_half)
    assert rows[AUTO]["x_comfyui"] == pytest.approx(6200 / 9000)  # against ComfyUI's faster mode
    assert rows[AUTO]["x_resident"] == pytest.approx(6.2)
    assert rows[AUTO]["prediction_error"] == pytest.approx(5890 / 6200 - 1)
    all_streamed = rows[f"{ALL_STREAMED}, prefetch 1"]
    assert all_streamed["x_lower_bound"] == pytest.approx(11000 / (100 * GIB / 10e9 * 1000))
    assert not run.too_noisy and run.noise_lines() == []
    checks = dict(run.checks())
    assert len(checks) == 4
    (faster, auto, bound, missed) = checks
    assert checks[faster] and "Partial GPU Residency, strided, 6.000 s" in faster and "9.000 s" in faster
    assert checks[auto]  # 6.2 s is within 1.05 x 6.0 s
    # Every block streamed: 100 GiB at 10 GB/s is 10.74 s; 11 s is within 1.10x of it, 12.5 s is not.
    assert checks[bound] and "1.024x the lower bound" in bound
    assert not checks[missed] and "1.164x the lower bound" in missed
    table = markdown(run)
    assert table.count("\n| ") == 2 + 8  # header, rule, rows
    assert f"- **misses**: {missed}" in table and f"- holds: {bound}" in table and "Too noisy" not in table
    assert "| 6.200 | 6.076-6.324 |" in table  # the median and its spread
    lines = series(run)
    assert lines["lower bound"] == [(50.0, pytest.approx(bound_at_half / 1000))]
    assert lines[RESIDENT] == [(50.0, 1.0), (50.0, 1.0)]
    assert f"{COMFYUI}, async offload on" + AGAIN not in lines  # the control is not a line of its own
    chart = line_chart(lines, tmp_path / "chart.png", title="t", x_label="x", y_label="y")
    with Image.open(chart) as image:
        assert image.size == (1280, 600) and image.getpixel((5, 5)) == (255, 255, 255)


@NO_COMFYUI
def test_a_row_reading_its_file_at_every_step_is_bounded_by_those_reads_too() -> None:
    """A node on a Dynamic VRAM model whose streamed blocks are partly read from the checkpoint file at every step
    (the file tier) cannot beat those reads: its lower bound is the largest of the resident step, the copies
    and the reads at the file's measured bandwidth; a row without reads keeps its bound."""
    run = made_up_run()
    run.read_gbps = 2.0
    half = Budget(SHARE, 50 * GIB)
    twin = Measurement(
        "Partial GPU Residency, auto on a Dynamic VRAM model", half, (made_up_round(0, *[20000] * 7),),
        int(50 * GIB), file_bytes=int(30 * GIB),
    )  # fmt: skip
    run.measurements.append(twin)
    rows = {row["method"]: row for row in run.rows()}
    reads_ms = 30 * GIB / 2e9 * 1000  # 16106 ms, above the copies' 5369 ms
    assert rows[twin.method]["lower_bound_ms"] == pytest.approx(reads_ms)
    assert rows[twin.method]["x_lower_bound"] == pytest.approx(20000 / reads_ms)
    assert rows[AUTO]["lower_bound_ms"] == pytest.approx(50 * GIB / 10e9 * 1000)
    table = markdown(run)
    assert "the checkpoint file read at 2.0 GB/s" in table and "| 50.00, 30.00 from the file |" in table


@NO_COMFYUI
def test_two_measurements_of_one_placement_more_than_2_percent_apart_make_the_run_too_noisy() -> None:
    run = made_up_run()
    half = run.budgets[0]
    strided = next(m for m in run.measurements if m.method == "Partial GPU Residency, strided")
    # The automatic placement's first run placed the same blocks, and was 2.5 % slower; a third row 1.9 %.
    first_run = Measurement(f"{AUTO} (first run)", half, (made_up_round(0, 6150),), placement_key=strided.placement_key,
                            measuring=True)  # fmt: skip
    run.measurements.append(first_run)
    assert run.too_noisy
    (disagreement,) = run.disagreements()
    assert disagreement.methods == ("Partial GPU Residency, strided", f"{AUTO} (first run)")
    assert disagreement.spread == pytest.approx(6150 / 6000 - 1)
    (line,) = run.noise_lines()  # one step in the first run is its nature, not a want of steps
    assert "differ by 2.5%" in line and line in markdown(run) and json.loads(json.dumps(run.as_dict()))["too_noisy"]
    run.measurements[-1] = Measurement(first_run.method, half, (made_up_round(0, 6114),),
                                       placement_key=strided.placement_key, measuring=True)  # fmt: skip
    assert not run.too_noisy  # 1.9 %
    # A row with fewer than seven steady steps cannot rest a median on them.
    run.measurements.append(
        Measurement("Sequential Offload Wrapper, prefetch 2", half, (made_up_round(0, 7000, 7000),))
    )
    assert run.too_noisy and "fewer than 7 steady steps in 1 of 10 rows" in run.noise_lines()[0]


@NO_COMFYUI
def test_card_budgets_are_labelled_and_kept_off_the_share_plot() -> None:
    run = made_up_run()
    twelve = Budget(CARD, 12 * GIB)
    run.measurements.append(Measurement(f"{COMFYUI}, Dynamic VRAM", twelve, (made_up_round(0, *[8000] * 7),)))
    assert twelve.label(run.model_bytes) == "12 GiB card" and "| 12 GiB card |" in markdown(run)
    assert all(x != 12.0 for line in series(run).values() for x, _ in line)
    # At a card the bound is what does not fit that card: 88 GiB at 10 GB/s.
    assert run.rows()[-1]["lower_bound_ms"] == pytest.approx(88 * GIB / 10e9 * 1000)


@NO_COMFYUI
def test_rows_of_a_budget_take_their_rounds_in_turn_and_a_row_out_of_memory_or_failing_is_dropped() -> None:
    """The measuring loop with its measurements injected: the order it measured in, and what it kept. A row out
    of device memory, or one that raises, is dropped and named with why; the others are measured all the same
    (a device session is scarce)."""
    half = Budget(SHARE, GIB)

    def config(method: str, budget: Budget | None) -> Config:
        return Config(method, budget, lambda: None)

    resident, streamed = config(RESIDENT, None), config(ALL_STREAMED, None)
    comfyui, auto, too_big = config(f"{COMFYUI}, async offload on", half), config(AUTO, half), config("big", half)
    broken = config("broken", half)
    groups = [[resident, streamed, resident.again()], [comfyui, auto, too_big, broken, comfyui.again()]]
    order: list[str] = []

    def measure(c: Config) -> tuple[Round, Placed]:
        order.append(c.method)
        if c is too_big:
            raise torch.OutOfMemoryError("made up")
        if c is broken:
            raise KeyError("a made-up bug")
        measuring = c is auto and order.count(AUTO) == 1  # the first load of an automatic placement measures
        return made_up_round(len(order), 10.0 * len(order)), Placed("", "", 0, None, None, measuring)

    dropped: dict[str, str] = {}
    found = measure_all(groups, 2, measure, dropped)
    again = RESIDENT + AGAIN
    comfy_again = comfyui.method + AGAIN
    assert order == [AUTO,  # its measuring run, before the rounds
                     RESIDENT, ALL_STREAMED, again, RESIDENT, ALL_STREAMED, again,
                     comfyui.method, AUTO, "big", "broken", comfy_again, comfyui.method, AUTO, comfy_again]  # fmt: skip
    assert dropped == {
        "big at 1.00 GiB (share)": OUT_OF_MEMORY,
        "broken at 1.00 GiB (share)": "KeyError('a made-up bug')",
    }
    assert [m.method for m in found] == [RESIDENT, ALL_STREAMED, again, comfyui.method,
                                         f"{AUTO} (first run: strided, measuring)", AUTO, comfy_again]  # fmt: skip
    by_method = {m.method: m for m in found}
    # Each row keeps its own rounds, in order: the resident row ran 2nd and 5th (steps of 20 and 50 ms).
    assert by_method[RESIDENT].steady_ms == [20.0, 50.0] and by_method[RESIDENT].ms_per_step == 35.0
    assert len(by_method[f"{AUTO} (first run: strided, measuring)"].rounds) == 1
    assert by_method[AUTO].steady_ms == [90.0, 140.0]


@NO_COMFYUI
def test_the_file_tier_benchmark_runs_every_share_bitwise(tmp_path: Path) -> None:
    """``bench/file_tier.py`` on the CPU (the times mean nothing): every share and cache state streams the
    stack from its file and gives the resident output bit for bit; the fewer host buffers, the more blocks
    read from the file."""
    from bench import file_tier

    rows = file_tier.main(
        [
            "--allow-cpu",
            "--blocks",
            "4",
            "--dim",
            "64",
            "--tokens",
            "16",
            "--stored",
            "float32",
            "--cold",
            "--host-shares",
            "0",
            "0.5",
            "1",
            "--folder",
            str(tmp_path),
        ]
    )
    assert [(r["host_share"], r["cold"]) for r in rows] == [(s, c) for s in (0, 0.5, 1) for c in (False, True)]
    assert all(r["bitwise"] for r in rows)
    assert [r["blocks_from_file"] for r in rows[::2]] == [4, 2, 0]


@NO_COMFYUI
def test_the_file_reads_benchmark_times_one_thread_the_pool_and_the_mapping_warm_and_cold(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from bench import file_reads

    medians = file_reads.main(["--gib", "0.125", "--rounds", "1", "--folder", str(tmp_path)])
    assert set(medians) == {(cache, way) for cache in ("warm", "cold") for way in file_reads.WAYS}, medians
    assert all(gbps > 0 for gbps in medians.values()), medians
    out = capsys.readouterr().out
    assert "0.12 GiB read as Wan 14B blocks' weights, medians of 1 rounds; the engine reads this file with" in out, out
    assert "| warm |" in out and "| cold |" in out and not list(tmp_path.iterdir()), out  # the file is gone
    assert "the mapping copied, 1 thread" in out and out.count("x |") == 4, out


@CAMPAIGN_HOST
def test_the_lora_cost_benchmark_measures_every_row_on_the_cpu(
    comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench/lora_cost.py`` at its smallest on the CPU (the times mean nothing): every configuration is
    sampled, the planner's patch cost is measured, and both strength changes run to their first step."""
    from bench import lora_cost

    monkeypatch.setenv("BLOCK_OFFLOAD_ALLOW_CPU", "1")  # the benchmark sets it; restored after the test
    rows = lora_cost.main(["--blocks", "2", "--rank", "4", "--rounds", "1", "--steps", "1"])
    comfy.mm.unload_all_models()
    # Every row measured; no sign asserted: a per-step time is a difference of two runs, which a busy machine can
    # make negative at one round (as it did once, the CPU shared: -413 ms).
    assert len(rows) == 7 and all(math.isfinite(ms) for ms in rows.values()), rows
    assert rows["planner's patch cost"] > 0


@CAMPAIGN_HOST
def test_the_first_load_benchmark_times_comfyui_and_the_pack_from_the_file(tmp_path: Path) -> None:
    """bench/first_load.py on a 4-block Wan: both sides loaded and stepped in every round; the automatic placement
    measured on its first load and placed from the kept search on the third."""
    args = ["--dim", "256", "--ffn", "512", "--layers", "4", "--budget", "0.9", "--rounds", "3"]
    args += ["--folder", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "bench.first_load", *args], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rounds = [line for line in done.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 3 and all("ComfyUI" in line and "pack" in line for line in rounds), done.stdout
    for label in ("loaded", "first step done"):
        (line,) = [line for line in done.stdout.splitlines() if line.startswith(f"{label}, median of 3")]
        assert float(line.rsplit(" ", 1)[1].rstrip("x")) > 0, line
    log = done.stdout + done.stderr
    assert "this run measures it and the next one is planned" in log and "chosen by the planner" in log, log


@NO_COMFYUI
def test_the_search_benchmark_times_and_counts_every_budget() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.planner_speed", "--shapes", "wan14b", "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| wan14b")]
    assert [row[2].strip() for row in rows] == ["25%", "50%", "75%"], done.stdout
    assert all(int(row[4]) > 0 and "2400.0 ms predicted" in row[5] for row in rows), done.stdout


@NO_COMFYUI
def test_the_engine_micro_benchmark_prints_each_configuration_and_what_a_streamed_call_adds() -> None:
    """On the CPU only with ``--allow-cpu``; each streamed row gives its step, its ratio to resident, the time a
    streamed call adds over the resident step, and the overlap the recorder measured."""
    command = [sys.executable, "-m", "bench.engine_microbench", "--blocks", "4", "--dim", "64", "--tokens", "16"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert refused.returncode != 0 and "--allow-cpu" in refused.stderr, refused.stdout + refused.stderr
    done = subprocess.run(
        [*command, "--dtype", "float32", "--steps", "3", "--allow-cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line[:22].strip(): line[22:].split() for line in done.stdout.splitlines()[3:]}
    assert list(rows) == ["resident", "synchronous offload", "async, prefetch 1", "async, prefetch 2"], done.stdout
    assert len(rows["resident"]) == 2 and float(rows["resident"][1]) == 1.0, done.stdout
    for name in ("synchronous offload", "async, prefetch 1", "async, prefetch 2"):
        step, ratio, added, overlap = rows[name]
        resident = float(rows["resident"][0])
        # The two times are printed to 0.005 ms, the ratio and the added time come from the unrounded ones.
        rounding = 0.005 * (1 + float(ratio)) / resident + 1e-3
        assert math.isclose(float(ratio), float(step) / resident, abs_tol=rounding), done.stdout
        assert math.isclose(int(added), (float(step) - resident) * 1e3 / 4, abs_tol=3), done.stdout
        assert overlap.endswith("%"), done.stdout


@NO_COMFYUI
def test_the_pinning_benchmark_runs_every_way_and_packs_the_weights_in_order(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from bench import pinning

    weights = pinning.block_parts(1 << 20, parts=6)
    assert len(weights) == 6 and sum(w.numel() for w in weights) <= 1 << 20
    for weight in weights:
        weight.random_(0, 256)
    buffer = pinning.packed(weights, torch.empty(sum(w.numel() for w in weights), dtype=torch.uint8))
    assert torch.equal(buffer, torch.cat(weights))
    args = ["--dry-run", "--gib", "0.0625", "--block-mib", "16", "--parts", "8", "--rounds", "2"]
    ways = pinning.main([*args, "--folder", str(tmp_path)])
    assert set(ways) == set(PINNING_WAYS)
    out = capsys.readouterr().out
    assert "4 blocks of 16 MiB in 8 weights (0.06 GiB), cpu, medians of 2 rounds" in out, out
    assert all(f"{way}: " in out for way in ways) and "0 of 32 weights refused" in out, out
    assert "file in place: 0 of 4 blocks refused" in out and not list(tmp_path.iterdir()), out  # the file is gone
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as refused:
            pinning.main([])
        assert refused.value.code == 2 and "--dry-run" in capsys.readouterr().err


#: The server benchmarks' smallest Wan (4 blocks of width 256) and one round: they are run, not timed.
SERVER_BENCH_SIZE = ["--dim", "256", "--ffn", "512", "--layers", "4", "--rounds", "1"]


@CAMPAIGN_HOST
def test_the_cold_prompt_benchmark_times_both_graphs_through_a_server(tmp_path: Path) -> None:
    """``bench/cold_prompt.py`` through a real server (the times mean nothing here): every prompt of both graphs,
    each after ``/free``, reached its first step before its end, and the table and the JSON hold both sides."""
    from bench import cold_prompt
    from bench.cold_prompt import LOADER, NODE, SAMPLER

    ratios = cold_prompt.main([*SERVER_BENCH_SIZE, "--steps", "2", "--out", str(tmp_path), "--folder", str(tmp_path)])
    assert len(ratios) == 4 and all(math.isfinite(ratio) for ratio in ratios.values()), ratios
    data = json.loads((tmp_path / "cold_prompt.json").read_text())
    # Two prompts a side in the round (after the other graph's, after its own), the warm-up's one of ComfyUI's and
    # two of the node's (its measuring load and its search) beside them.
    counts = {group: len(prompts) for group, prompts in data["prompts"].items()}
    sides = {f"{side}, {after}": 1 for side in (COMFYUI, NODE) for after in ("after its own", "after the other's")}
    assert counts == {**sides, f"warm-up, {COMFYUI}": 1, f"warm-up, {NODE}": 2}, counts
    for group, prompts in data["prompts"].items():
        for prompt in prompts:
            (first, at), *later = prompt["steps_s"][SAMPLER]
            assert first == 1 and 0 < prompt["started_s"][SAMPLER] < at <= prompt["end_s"], (group, prompt)
            assert [step for step, _ in later] == [2], (group, prompt)  # the last step's message always comes
            assert (NODE in prompt["stage_s"]) == (NODE in group) and LOADER in prompt["stage_s"]
            assert bool(prompt["pack_steps"]) == (NODE in group), (group, prompt)  # the pack's record of its steps
            assert prompt["anon_peak_bytes"] >= prompt["anon_before_bytes"] > 0
    rows = {row["label"]: row["values"] for row in data["rows"]}
    assert all(values[NODE] is not None for values in rows.values()), rows
    # ComfyUI has no node to time, and the pack recorded only its own steps.
    assert rows[NODE][COMFYUI] is None and rows["POST /prompt -> 1st step done"][COMFYUI] is not None, rows
    table = (tmp_path / "cold_prompt.md").read_text()
    assert f"| | {COMFYUI} | {NODE} |" in table and "| POST /prompt -> 1st step done (s) |" in table, table
    assert data["meta"]["ComfyUI"] == HOST_VERSION
    assert "load average" in data["meta"] and "4 Wan 2.1 blocks" in data["meta"]["checkpoint"]


@CAMPAIGN_HOST
def test_the_model_switch_benchmark_runs_both_experts_warm_on_a_server_a_side(tmp_path: Path) -> None:
    """``bench/model_switch.py`` (the times mean nothing here): each side's server ran its prompts, both experts
    sampled in each (the high-noise one first), and the table and the JSON hold both sides with their memory."""
    from bench import model_switch
    from bench.cold_prompt import NODE
    from bench.model_switch import HIGH, LINKED_NOTE, LOW, sampler_stage

    # ComfyUI's classic loading (the CPU's only one) named as a mode, and the experts in one file, as the GPU
    # campaign runs them.
    args = [*SERVER_BENCH_SIZE, "--prompts", "2", "--modes", "classic", "--linked-experts", "--out", str(tmp_path),
            "--folder", str(tmp_path)]  # fmt: skip
    ratios = model_switch.main(args)
    assert set(ratios) == {"warm prompt, classic", "RssAnon peak, classic"}, ratios
    assert all(math.isfinite(r) for r in ratios.values()), ratios
    data = json.loads((tmp_path / "model_switch-classic.json").read_text())
    assert data["meta"]["Dynamic VRAM"] == "off" and LINKED_NOTE in data["notes"], data
    counts = {group: len(prompts) for group, prompts in data["prompts"].items()}
    assert counts == {COMFYUI: 1, NODE: 1, f"first prompt, {COMFYUI}": 1, f"first prompt, {NODE}": 1,
                      f"warm-up, {NODE}": 2}, counts  # fmt: skip
    for group, prompts in data["prompts"].items():
        for prompt in prompts:
            high, low = (prompt["steps_s"][sampler_stage(expert)] for expert in (HIGH, LOW))
            assert len(high) == len(low) == 2 and high[-1][1] < low[0][1] <= prompt["end_s"], (group, prompt)
    rows = {row["label"]: row["values"] for row in data["rows"]}
    assert all(values[COMFYUI] is not None and values[NODE] is not None for values in rows.values()), rows
    table = (tmp_path / "model_switch-classic.md").read_text()
    assert f"| | {COMFYUI} | {NODE} |" in table and "RssAnon, peak over the warm prompts (GiB)" in table, table
    assert any(note.startswith("host memory: the node's RssAnon peak") for note in data["notes"]), data["notes"]
    assert any("loaded an expert again" in note for note in data["notes"]), data["notes"]


def test_the_server_benchmarks_refuse_a_card_or_dynamic_vram_without_a_gpu(capsys: pytest.CaptureFixture) -> None:
    """``--card`` and ``--modes dynamic`` need a CUDA device: refused before any file is written, saying why."""
    from bench import cold_prompt, model_switch

    for main, args, why in (
        (cold_prompt.main, ["--card", "16"], "--card: a positive size in GiB, with --cuda"),
        (model_switch.main, ["--modes", "dynamic"], "Dynamic VRAM runs on an NVIDIA GPU (--cuda)"),
    ):
        with pytest.raises(SystemExit) as refused:
            main(args)
        assert refused.value.code == 2 and why in capsys.readouterr().err


def test_linked_experts_are_one_file_with_two_names(tmp_path: Path) -> None:
    """``--linked-experts``: the low-noise expert is a hard link to the high-noise one's file, so two 14B experts
    take one file's disk (and page cache) on the GPU machine, while ComfyUI sees two files to load."""
    from bench.cold_prompt import arguments, lay_out, parsed
    from bench.model_switch import EXPERTS

    args = parsed(arguments(None, steps=2), ["--dim", "64", "--ffn", "128", "--layers", "2"])
    models = lay_out(tmp_path, list(EXPERTS.values()), args, linked=True)
    folder = tmp_path / "models" / "diffusion_models"
    high, low = (folder / models.files[name] for name in EXPERTS.values())
    assert high != low and high.stat().st_ino == low.stat().st_ino and high.stat().st_nlink == 2
    assert high.stat().st_size >= models.file_bytes > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a card is carved out of a CUDA device")
def test_a_card_leaves_that_much_of_the_device_free_and_counts_it_as_the_total(comfy: SimpleNamespace) -> None:
    """``harness/card.py``: while the card is held, the driver reports the card's bytes free (to the caching
    allocator's 2 MiB rounding) and ComfyUI's total memory is the device's less the filler; after it, both are back."""
    from harness.card import GIB, card

    device = torch.device("cuda", torch.cuda.current_device())
    total_memory = comfy.mm.get_total_memory
    device_total = total_memory(device)
    with card(comfy.mm, device, 2 * GIB) as filled:
        free, _ = torch.cuda.mem_get_info(device)
        assert abs(free - 2 * GIB) <= 4 * 2**20, free
        assert comfy.mm.get_total_memory(device) == device_total - filled
    assert comfy.mm.get_total_memory is total_memory
    assert torch.cuda.mem_get_info(device)[0] > 2 * GIB + filled // 2
