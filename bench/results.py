"""The ComfyUI benchmark's measurements, their ratios, the targets they are held to, and the
Markdown table and JSON written from them. Plain Python: tested on the CPU with made-up figures."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness  # noqa: F401 - makes the pack importable as block_offload

from block_offload.offload import GIB

#: Method names of ComfyUI's own partial loading start with this; everything else is this pack.
COMFYUI = "ComfyUI"
RESIDENT = "fully resident"
AUTO = "Partial GPU Residency, auto"
#: The pack's rows without a budget that stream every block (Async Block Offload, 0 resident).
ALL_STREAMED = "Async Block Offload, every block streamed"

# The targets.
WAN_BOUND_RATIO = 1.10  # Wan-shaped, 0 resident: within 1.10x of the lower bound
AUTO_RATIO = 1.05  # automatic placement: within 5 % of the best configuration at its budget


@dataclass(frozen=True)
class Measurement:
    """One configuration, timed over a few steps after a warm-up."""

    method: str
    budget_bytes: int | None  # None: no budget (fully resident; every block streamed)
    ms_per_step: float
    peak_vram_bytes: int | None
    host_rss_bytes: int
    streamed_bytes: int = 0  # copied to the device per step
    overlap: float | None = None  # share of copy time hidden behind compute (the pack's recorder)
    predicted_ms: float | None = None  # the planner's prediction (automatic placement)
    placement: str = ""
    pinned_host_bytes: int = 0  # page-locked by the pack (offload.device.pinned_bytes); 0 for ComfyUI's rows
    measuring: bool = False  # an automatic placement's first run, placed by its policy to measure the costs


@dataclass
class ModelRun:
    """Every configuration of one model, and what is needed to put them in proportion."""

    model: str
    title: str
    model_bytes: int
    bandwidth_gbps: float  # pinned host-to-device, measured in the same process
    measurements: list[Measurement]
    meta: dict[str, str] = field(default_factory=dict)  # device, driver, torch, commit, command, date

    @property
    def resident_ms(self) -> float:
        resident = next((m.ms_per_step for m in self.measurements if m.method == RESIDENT), None)
        if resident is None:
            raise ValueError(f"{self.model}: no fully resident measurement, and every ratio is to it")
        return resident

    @property
    def budgets(self) -> list[int]:
        return sorted({m.budget_bytes for m in self.measurements if m.budget_bytes is not None})

    def lower_bound_ms(self, streamed_bytes: int) -> float:
        """No method streaming ``streamed_bytes`` per step beats the resident step or those copies alone."""
        return max(self.resident_ms, streamed_bytes / (self.bandwidth_gbps * 1e6))

    def budget_bound_ms(self, budget_bytes: int) -> float:
        """At a budget, at least what does not fit must be copied every step."""
        return self.lower_bound_ms(max(0, self.model_bytes - budget_bytes))

    def at(self, budget_bytes: int, comfyui: bool) -> list[Measurement]:
        return [
            m for m in self.measurements if m.budget_bytes == budget_bytes and m.method.startswith(COMFYUI) == comfyui
        ]

    def rows(self) -> list[dict]:
        """Each measurement with its ratios: to resident, to the lower bound, to ComfyUI's best at its budget."""
        rows = []
        for m in self.measurements:
            if m.budget_bytes is None:
                bound = self.lower_bound_ms(m.streamed_bytes)
            else:
                bound = self.budget_bound_ms(m.budget_bytes)
            comfyui = self.at(m.budget_bytes, comfyui=True) if m.budget_bytes is not None else []
            best_comfyui = min((c.ms_per_step for c in comfyui), default=None)
            rows.append(
                {
                    **asdict(m),
                    "budget_fraction": None if m.budget_bytes is None else m.budget_bytes / self.model_bytes,
                    "x_resident": m.ms_per_step / self.resident_ms,
                    "lower_bound_ms": bound,
                    "x_lower_bound": m.ms_per_step / bound,
                    "x_comfyui": None if best_comfyui is None else m.ms_per_step / best_comfyui,
                    "prediction_error": None if m.predicted_ms is None else m.predicted_ms / m.ms_per_step - 1,
                }
            )
        return rows

    def checks(self) -> list[tuple[str, bool]]:
        """The issue's targets, each as (what was checked, with the figures; whether it holds)."""
        found: list[tuple[str, bool]] = []
        for budget in self.budgets:
            label = f"{budget / self.model_bytes:.0%} budget ({budget / GIB:.2f} GiB)"
            ours, theirs = self.at(budget, comfyui=False), self.at(budget, comfyui=True)
            if ours and theirs:
                best, rival = min(ours, key=_ms), min(theirs, key=_ms)
                found.append(
                    (
                        f"{label}: fastest of this pack ({best.method}, {best.ms_per_step / 1000:.2f} s) vs "
                        f"ComfyUI's fastest ({rival.method}, {rival.ms_per_step / 1000:.2f} s)",
                        best.ms_per_step < rival.ms_per_step,
                    )
                )
            for auto in (m for m in ours if m.method == AUTO):
                best = min(ours, key=_ms)
                found.append(
                    (
                        f"{label}: automatic placement {auto.ms_per_step / 1000:.2f} s within {AUTO_RATIO:.2f}x "
                        f"of the best at this budget ({best.method}, {best.ms_per_step / 1000:.2f} s)",
                        auto.ms_per_step <= AUTO_RATIO * best.ms_per_step,
                    )
                )
        if self.model.startswith("wan"):
            for m in self.measurements:
                if m.budget_bytes is None and m.method.startswith(ALL_STREAMED):
                    ratio = m.ms_per_step / self.lower_bound_ms(m.streamed_bytes)
                    found.append(
                        (
                            f"{m.method}: {ratio:.3f}x the lower bound (target {WAN_BOUND_RATIO:.2f}x)",
                            ratio <= WAN_BOUND_RATIO,
                        )
                    )
        return found

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "title": self.title,
            "model_bytes": self.model_bytes,
            "bandwidth_gbps": self.bandwidth_gbps,
            "resident_ms": self.resident_ms,
            "meta": self.meta,
            "rows": self.rows(),
            "checks": [{"check": text, "holds": holds} for text, holds in self.checks()],
        }


def _ms(m: Measurement) -> float:
    return m.ms_per_step


def _at(m: Measurement) -> str:
    return "" if m.budget_bytes is None else f" at {m.budget_bytes / GIB:.2f} GiB"


def _cell(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def markdown(run: ModelRun) -> str:
    """The model's table and its checks, as the docs show them."""
    lines = [
        f"### {run.title}",
        "",
        f"{run.model_bytes / GIB:.1f} GiB of weights; pinned host-to-device bandwidth {run.bandwidth_gbps:.1f} GB/s; "
        f"fully resident {run.resident_ms / 1000:.3f} s per step.",
        "",
        "| method | budget | s/step | x resident | x lower bound | x ComfyUI | peak VRAM GiB | host RAM GiB "
        "| pinned GiB | streamed GiB/step | overlap | predicted s | prediction error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in run.rows():
        budget = (
            "" if row["budget_bytes"] is None else f"{row['budget_fraction']:.0%} ({row['budget_bytes'] / GIB:.2f} GiB)"
        )
        peak = None if row["peak_vram_bytes"] is None else row["peak_vram_bytes"] / GIB
        predicted = None if row["predicted_ms"] is None else row["predicted_ms"] / 1000
        cells = [
            row["method"],
            budget,
            f"{row['ms_per_step'] / 1000:.3f}",
            f"{row['x_resident']:.2f}",
            f"{row['x_lower_bound']:.2f}",
            _cell(row["x_comfyui"], ".2f"),
            _cell(peak, ".2f"),
            f"{row['host_rss_bytes'] / GIB:.1f}",
            f"{row['pinned_host_bytes'] / GIB:.2f}",
            f"{row['streamed_bytes'] / GIB:.2f}",
            _cell(row["overlap"], ".0%"),
            _cell(predicted, ".3f"),
            _cell(row["prediction_error"], "+.1%"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Targets:", ""]
    lines += [f"- {'holds' if holds else '**misses**'}: {text}" for text, holds in run.checks()]
    lines += ["", "Placements (the pack's plan line, or what ComfyUI loaded):", ""]
    lines += [f"- {m.method}{_at(m)}: {m.placement}" for m in run.measurements]
    meta = ", ".join(f"{key} {value}" for key, value in run.meta.items())
    return "\n".join([*lines, "", f"Measured on: {meta}.", ""])


def write(run: ModelRun, out_dir: Path) -> tuple[Path, Path]:
    """``<model>.json`` and ``<model>.md`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data, table = out_dir / f"{run.model}.json", out_dir / f"{run.model}.md"
    data.write_text(json.dumps(run.as_dict(), indent=1) + "\n")
    table.write_text(markdown(run))
    return data, table


def series(run: ModelRun) -> dict[str, list[tuple[float, float]]]:
    """Step time (s) against budget (GiB), one line per method; budget-free rows as flat lines."""
    lines: dict[str, list[tuple[float, float]]] = {}
    budgets = run.budgets
    low, high = (budgets[0] / GIB, budgets[-1] / GIB) if budgets else (0.0, run.model_bytes / GIB)
    for m in run.measurements:
        if m.budget_bytes is None:
            lines[m.method] = [(low, m.ms_per_step / 1000), (high, m.ms_per_step / 1000)]
        else:
            lines.setdefault(m.method, []).append((m.budget_bytes / GIB, m.ms_per_step / 1000))
    lines["lower bound"] = [(b / GIB, run.budget_bound_ms(b) / 1000) for b in budgets]
    return {name: sorted(points) for name, points in lines.items()}
