"""The ComfyUI benchmark (bench/comfy_bench.py) without a GPU: it refuses, its smoke mode runs the
whole script on tiny shapes, and its table, targets and plot come out right from known figures.
The GPU check (scripts/gpu_check.sh) refuses without CUDA too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from bench.plot import line_chart
from bench.results import ALL_STREAMED, AUTO, COMFYUI, GIB, RESIDENT, Measurement, ModelRun, markdown, series

REPO = Path(__file__).resolve().parents[1]


def bench(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.comfy_bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


def test_without_cuda_it_refuses_with_status_2() -> None:
    done = bench("--models", "wan14b", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2, done.stderr
    assert "no CUDA device" in done.stderr and "--smoke" in done.stderr


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


def test_smoke_run_writes_the_table_the_json_and_the_plot(tmp_path: Path) -> None:
    done = bench("--smoke", "--models", "wan14b", "--budgets", "0.5", "--steps", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "wan14b.json").read_text())
    rows = {row["method"]: row for row in data["rows"]}
    expected = {
        RESIDENT,
        f"{ALL_STREAMED}, prefetch 1",
        f"{ALL_STREAMED}, prefetch 2",
        f"{COMFYUI}, async offload on",
        f"{COMFYUI}, async offload off",
        "Async Block Offload, leading blocks that fit, prefetch 1",
        "Async Block Offload, leading blocks that fit, prefetch 2",
        "Partial GPU Residency, trailing",
        "Partial GPU Residency, strided",
        f"{AUTO} (first run: strided, measuring)",
        AUTO,
        "Sequential Offload Wrapper, prefetch 2",
    }
    assert set(rows) == expected
    assert all(row["ms_per_step"] > 0 and row["host_rss_bytes"] > 0 for row in rows.values())
    assert rows[RESIDENT]["x_resident"] == 1.0
    # The planner placed the second automatic run and said what it expected; the first one measured.
    assert "chosen by the planner" in rows[AUTO]["placement"] and rows[AUTO]["predicted_ms"] > 0
    assert "not measured on this device yet" in rows[f"{AUTO} (first run: strided, measuring)"]["placement"]
    # ComfyUI's rows are compared with ComfyUI's best at their budget; the pack's streamed its blocks.
    assert min(rows[f"{COMFYUI}, async offload {s}"]["x_comfyui"] for s in ("on", "off")) == 1.0
    assert rows[f"{ALL_STREAMED}, prefetch 1"]["streamed_bytes"] > 0
    assert 0 <= rows[f"{ALL_STREAMED}, prefetch 1"]["overlap"] <= 1
    table = (tmp_path / "wan14b.md").read_text()
    assert table.count("\n| ") == 2 + len(expected) and "Targets:" in table and "Measured on: device cpu" in table
    with Image.open(tmp_path / "wan14b.png") as image:
        assert image.size == (1280, 600)


def made_up_run() -> ModelRun:
    """Figures worked out by hand: a 100 GiB model, 10 GB/s, resident 1 s per step."""

    def m(method: str, budget: float | None, ms: float, streamed: float = 0, predicted: float | None = None):
        budget_bytes = None if budget is None else int(budget * GIB)
        return Measurement(method, budget_bytes, ms, 0, GIB, int(streamed * GIB), 0.9, predicted)

    return ModelRun(
        "wan14b",
        "made up",
        100 * GIB,
        10.0,
        [
            m(RESIDENT, None, 1000),
            m(f"{ALL_STREAMED}, prefetch 1", None, 11000, streamed=100),
            m(f"{ALL_STREAMED}, prefetch 2", None, 12500, streamed=100),
            m(f"{COMFYUI}, async offload on", 50, 9000),
            m(f"{COMFYUI}, async offload off", 50, 12000),
            m("Partial GPU Residency, strided", 50, 6000),
            m(AUTO, 50, 6200, predicted=5890),
        ],
        {"device": "made up"},
    )


def test_ratios_and_targets_from_known_figures(tmp_path: Path) -> None:
    run = made_up_run()
    rows = {row["method"]: row for row in run.rows()}
    bound_at_half = 50 * GIB / 10e9 * 1000  # what does not fit, at 10 GB/s: 5369 ms
    assert rows[AUTO]["lower_bound_ms"] == pytest.approx(bound_at_half)
    assert rows[AUTO]["x_lower_bound"] == pytest.approx(6200 / bound_at_half)
    assert rows[AUTO]["x_comfyui"] == pytest.approx(6200 / 9000)  # against ComfyUI's faster mode
    assert rows[AUTO]["x_resident"] == pytest.approx(6.2)
    assert rows[AUTO]["prediction_error"] == pytest.approx(5890 / 6200 - 1)
    all_streamed = rows[f"{ALL_STREAMED}, prefetch 1"]
    assert all_streamed["x_lower_bound"] == pytest.approx(11000 / (100 * GIB / 10e9 * 1000))
    checks = dict(run.checks())
    assert len(checks) == 4
    (faster, auto, bound, missed) = checks
    assert checks[faster] and "Partial GPU Residency, strided, 6.00 s" in faster and "9.00 s" in faster
    assert checks[auto]  # 6.2 s is within 1.05 x 6.0 s
    # Every block streamed: 100 GiB at 10 GB/s is 10.74 s; 11 s is within 1.10x of it, 12.5 s is not.
    assert checks[bound] and "1.024x the lower bound" in bound
    assert not checks[missed] and "1.164x the lower bound" in missed
    table = markdown(run)
    assert table.count("\n| ") == 2 + 7  # header, rule, rows
    assert f"- **misses**: {missed}" in table and f"- holds: {bound}" in table
    lines = series(run)
    assert lines["lower bound"] == [(50.0, pytest.approx(bound_at_half / 1000))]
    assert lines[RESIDENT] == [(50.0, 1.0), (50.0, 1.0)]
    chart = line_chart(lines, tmp_path / "chart.png", title="t", x_label="x", y_label="y")
    with Image.open(chart) as image:
        assert image.size == (1280, 600) and image.getpixel((5, 5)) == (255, 255, 255)
