"""The ComfyUI benchmark's measurements, their statistics and ratios, the targets they are held to, and the
Markdown table and JSON written from them. Plain Python: tested on the CPU with made-up figures."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness  # noqa: F401 - makes the pack importable as block_offload

from block_offload.offload import GIB

#: Method names of ComfyUI's own loading start with this; everything else is this pack.
COMFYUI = "ComfyUI"
RESIDENT = "fully resident"
AUTO = "Partial GPU Residency, auto"
#: The pack's rows without a budget that stream every block (Async Block Offload, 0 resident).
ALL_STREAMED = "Async Block Offload, every block streamed"
#: Appended to the method of a row measured a second time in the same rounds, as a noise control.
AGAIN = " (again)"
#: The first prompt of a distilled model, timed from the file (the load and this many steps); the other one timed is
#: a round's whole prompt (``first_prompt_steps``).
DISTILLED_STEPS = 4


def first_prompt_steps(steps_per_round: int) -> tuple[int, ...]:
    """The first prompts a table shows: a distilled model's 4 steps, and the round's whole prompt."""
    return tuple(sorted({DISTILLED_STEPS, steps_per_round}))


# The targets.
WAN_BOUND_RATIO = 1.10  # Wan-shaped, 0 resident: within 1.10x of the lower bound
AUTO_RATIO = 1.05  # automatic placement: within 5 % of the best configuration at its budget
#: Two measurements of one placement in one run must agree this closely, or the run is too noisy to tell
#: 3 % apart (issue 19).
NOISE_TOLERANCE = 0.02
#: Fewest steady steps per row for a median the tolerance can rest on.
MIN_STEADY_STEPS = 7

SHARE, CARD = "share", "card"


@dataclass(frozen=True, order=True)
class Budget:
    """A VRAM budget: a share of the model's bytes handed to ComfyUI's loader, or a card of that many bytes
    (the rest of the device taken by a filler allocation, so ComfyUI and the pack see that card)."""

    kind: str  # SHARE or CARD
    nbytes: int

    def label(self, model_bytes: int) -> str:
        if self.kind == CARD:
            return f"{self.nbytes / GIB:g} GiB card"
        return f"{self.nbytes / model_bytes:.0%} ({self.nbytes / GIB:.2f} GiB)"


@dataclass(frozen=True)
class Round:
    """One load of a configuration and the steps run on it, as one generation would."""

    started_s: float  # the load's start (time.perf_counter): the order the rounds ran in
    load_first_ms: float  # from the start of the load to the end of the first step
    step_ms: tuple[float, ...]  # every step after the first, each timed on its own
    wall_ms: float  # the load and every step
    peak_vram_bytes: int | None
    # Host memory at its peak over the round: anonymous (RssAnon, sampled: what the process allocated, the
    # pack's pinned buffers included) and resident (VmHWM, exact: also the checkpoint's mapped pages and what
    # the driver allocated pinned, as Dynamic VRAM's staging buffers).
    host_anon_peak_bytes: int
    host_rss_peak_bytes: int
    pinned_host_bytes: (
        int  # page-locked after the steps, ComfyUI's and the pack's alike (``measure.pinned_host_bytes``)
    )
    # Of ``load_first_ms``, the pack's copy into host buffers (and pinning) before the first step, and the bytes it
    # copied into them over the round, in the background too; None for ComfyUI's rows.
    packing_ms: float | None = None
    packed_bytes: int | None = None
    # Where ``load_first_ms`` went: the load (ComfyUI's, with the pack's engine start), then the first step; of that
    # step, as the pack's recorder saw it, its copies and those from blocks not pinned or packed yet (None for
    # ComfyUI's rows). What issue 49's first step costs, part by part.
    load_ms: float | None = None
    first_copy_ms: float | None = None
    first_unpacked_ms: float | None = None
    first_unpacked_bytes: int | None = None


@dataclass(frozen=True)
class Measurement:
    """One configuration over its rounds: the steady step is the median of every step after each round's
    first, with its spread."""

    method: str
    budget: Budget | None  # None: no budget (fully resident; every block streamed)
    rounds: tuple[Round, ...]
    streamed_bytes: int = 0  # copied to the device per step
    overlap: float | None = None  # share of copy time hidden behind compute (the pack's recorder)
    predicted_ms: float | None = None  # the planner's prediction (automatic placement)
    placement: str = ""
    #: Equal for two rows that placed the same blocks the same way (the noise check pairs them).
    placement_key: str = ""
    measuring: bool = False  # an automatic placement's first run, placed by its policy to measure the costs
    copied_bytes: int | None = None  # what the pack's engine copied in the last step (its recorder); None: ComfyUI
    file_bytes: int = 0  # of ``streamed_bytes``, read from the checkpoint file at every step (the pack's file tier)

    @property
    def steady_ms(self) -> list[float]:
        return [ms for one in self.rounds for ms in one.step_ms]

    @property
    def ms_per_step(self) -> float:
        return statistics.median(self.steady_ms)

    @property
    def min_ms(self) -> float:
        return min(self.steady_ms)

    @property
    def max_ms(self) -> float:
        return max(self.steady_ms)

    @property
    def load_first_ms(self) -> float:
        return statistics.median(one.load_first_ms for one in self.rounds)

    def first_prompt_ms(self, steps: int) -> float | None:
        """A prompt of ``steps`` steps from the file, as a user's first one after a load: the load, the first step
        and the next ``steps - 1`` as timed (median over the rounds); None when the rounds ran fewer steps."""
        if self.steps_per_round < steps:
            return None
        return statistics.median(one.load_first_ms + sum(one.step_ms[: steps - 1]) for one in self.rounds)

    @property
    def packing_ms(self) -> float | None:
        """Of ``load_first_ms``, the pack's copy into host buffers (None for ComfyUI's rows)."""
        packing = [one.packing_ms for one in self.rounds if one.packing_ms is not None]
        return statistics.median(packing) if packing else None

    @property
    def wall_ms(self) -> float:
        return statistics.median(one.wall_ms for one in self.rounds)

    @property
    def steps_per_round(self) -> int:
        return 1 + len(self.rounds[0].step_ms)

    @property
    def peak_vram_bytes(self) -> int | None:
        peaks = [one.peak_vram_bytes for one in self.rounds if one.peak_vram_bytes is not None]
        return max(peaks) if peaks else None

    @property
    def host_anon_peak_bytes(self) -> int:
        return max(one.host_anon_peak_bytes for one in self.rounds)

    @property
    def host_rss_peak_bytes(self) -> int:
        return max(one.host_rss_peak_bytes for one in self.rounds)

    @property
    def pinned_host_bytes(self) -> int:
        return max(one.pinned_host_bytes for one in self.rounds)

    @property
    def budget_bytes(self) -> int | None:
        return None if self.budget is None else self.budget.nbytes

    def summary(self) -> dict:
        """The figures a row reports, beside the samples they come from."""
        return {
            "method": self.method,
            "budget_kind": None if self.budget is None else self.budget.kind,
            "budget_bytes": self.budget_bytes,
            "ms_per_step": self.ms_per_step,
            "min_ms": self.min_ms,
            "max_ms": self.max_ms,
            "steady_steps": len(self.steady_ms),
            "load_first_ms": self.load_first_ms,
            "first_prompt_ms": {
                steps: self.first_prompt_ms(steps) for steps in first_prompt_steps(self.steps_per_round)
            },
            "packing_ms": self.packing_ms,
            "wall_ms": self.wall_ms,
            "steps_per_round": self.steps_per_round,
            "peak_vram_bytes": self.peak_vram_bytes,
            "host_anon_peak_bytes": self.host_anon_peak_bytes,
            "host_rss_peak_bytes": self.host_rss_peak_bytes,
            "pinned_host_bytes": self.pinned_host_bytes,
            "streamed_bytes": self.streamed_bytes,
            "copied_bytes": self.copied_bytes,
            "file_bytes": self.file_bytes,
            "overlap": self.overlap,
            "predicted_ms": self.predicted_ms,
            "placement": self.placement,
            "placement_key": self.placement_key,
            "measuring": self.measuring,
            "rounds": [asdict(one) for one in self.rounds],
        }


@dataclass(frozen=True)
class Disagreement:
    """Two rows of one placement whose steady steps differ by more than the tolerance."""

    budget: Budget | None
    methods: tuple[str, ...]
    spread: float  # (slowest median / fastest median) - 1


@dataclass
class ModelRun:
    """Every configuration of one model, and what is needed to put them in proportion."""

    model: str
    title: str
    model_bytes: int
    bandwidth_gbps: float  # pinned host-to-device, measured in the same process
    measurements: list[Measurement]
    meta: dict[str, str] = field(default_factory=dict)  # device, driver, torch, commit, command, date
    read_gbps: float | None = None  # reading the checkpoint file as the file tier does, warm; None: not measured
    failed: tuple[str, ...] = ()  # rows dropped because they raised (a bug to fix, unlike a row out of memory)

    @property
    def resident_ms(self) -> float:
        resident = next((m.ms_per_step for m in self.measurements if m.method == RESIDENT), None)
        if resident is None:
            raise ValueError(f"{self.model}: no fully resident measurement, and every ratio is to it")
        return resident

    @property
    def budgets(self) -> list[Budget]:
        return sorted({m.budget for m in self.measurements if m.budget is not None})

    def lower_bound_ms(self, streamed_bytes: int, file_bytes: int = 0) -> float:
        """No method streaming ``streamed_bytes`` per step, ``file_bytes`` of them read from the checkpoint file,
        beats the resident step, those copies alone, or those reads alone."""
        reads = file_bytes / (self.read_gbps * 1e6) if file_bytes and self.read_gbps else 0.0
        return max(self.resident_ms, streamed_bytes / (self.bandwidth_gbps * 1e6), reads)

    def budget_bound_ms(self, budget: Budget) -> float:
        """At a budget, at least what does not fit must be copied every step."""
        return self.lower_bound_ms(max(0, self.model_bytes - budget.nbytes))

    def at(self, budget: Budget, comfyui: bool) -> list[Measurement]:
        return [m for m in self.measurements if m.budget == budget and m.method.startswith(COMFYUI) == comfyui]

    def disagreements(self) -> list[Disagreement]:
        """Rows of one budget that placed the same blocks the same way (a row measured again, the automatic
        placement's first run and the policy it used) but whose medians differ by more than the tolerance."""
        groups: dict[tuple[Budget | None, str], list[Measurement]] = {}
        for m in self.measurements:
            groups.setdefault((m.budget, m.placement_key or m.method.removesuffix(AGAIN)), []).append(m)
        found = []
        for (budget, _), same in groups.items():
            if len(same) < 2:
                continue
            fastest, slowest = min(same, key=_ms), max(same, key=_ms)
            spread = slowest.ms_per_step / fastest.ms_per_step - 1
            if spread > NOISE_TOLERANCE:
                found.append(Disagreement(budget, tuple(m.method for m in same), spread))
        return found

    @property
    def too_noisy(self) -> bool:
        return bool(self.disagreements() or self.short_rows())

    def rows(self) -> list[dict]:
        """Each measurement with its ratios: to resident, to the lower bound, to ComfyUI's best at its budget."""
        rows = []
        for m in self.measurements:
            bound = self.lower_bound_ms(m.streamed_bytes) if m.budget is None else self.budget_bound_ms(m.budget)
            bound = max(bound, self.lower_bound_ms(0, m.file_bytes))  # a file tier: its reads
            comfyui = self.at(m.budget, comfyui=True) if m.budget is not None else []
            best_comfyui = min((c.ms_per_step for c in comfyui), default=None)
            rows.append(
                {
                    **m.summary(),
                    "budget_fraction": None if m.budget is None else m.budget.nbytes / self.model_bytes,
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
            label = budget.label(self.model_bytes)
            ours, theirs = self.at(budget, comfyui=False), self.at(budget, comfyui=True)
            if ours and theirs:
                best, rival = min(ours, key=_ms), min(theirs, key=_ms)
                found.append(
                    (
                        f"{label}: fastest of this pack ({best.method}, {best.ms_per_step / 1000:.3f} s) vs "
                        f"ComfyUI's fastest ({rival.method}, {rival.ms_per_step / 1000:.3f} s)",
                        best.ms_per_step < rival.ms_per_step,
                    )
                )
            for auto in (m for m in ours if m.method == AUTO):
                best = min(ours, key=_ms)
                found.append(
                    (
                        f"{label}: automatic placement {auto.ms_per_step / 1000:.3f} s within {AUTO_RATIO:.2f}x "
                        f"of the best at this budget ({best.method}, {best.ms_per_step / 1000:.3f} s)",
                        auto.ms_per_step <= AUTO_RATIO * best.ms_per_step,
                    )
                )
        if self.model.startswith("wan"):
            for m in self.measurements:
                if m.budget is None and m.method.startswith(ALL_STREAMED):
                    ratio = m.ms_per_step / self.lower_bound_ms(m.streamed_bytes)
                    found.append(
                        (
                            f"{m.method}: {ratio:.3f}x the lower bound (target {WAN_BOUND_RATIO:.2f}x)",
                            ratio <= WAN_BOUND_RATIO,
                        )
                    )
        return found

    def noise_lines(self) -> list[str]:
        """What makes the run too noisy to tell 3 % apart, one line each; empty when nothing does."""
        lines = [
            f"{budget_text(d.budget, self.model_bytes)}: {' and '.join(d.methods)} placed the same blocks but "
            f"their medians differ by {d.spread:.1%} (tolerance {NOISE_TOLERANCE:.0%})"
            for d in self.disagreements()
        ]
        short = self.short_rows()
        if short:
            lines.append(
                f"fewer than {MIN_STEADY_STEPS} steady steps in {len(short)} of {len(self.measurements)} rows "
                f"(e.g. {short[0].method}: {len(short[0].steady_ms)})"
            )
        return lines

    def short_rows(self) -> list[Measurement]:
        """Rows with too few steady steps for their median to hold; an automatic placement's first run has one
        load by nature (the next load is planned), so it is not held to it."""
        return [m for m in self.measurements if len(m.steady_ms) < MIN_STEADY_STEPS and not m.measuring]

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "title": self.title,
            "model_bytes": self.model_bytes,
            "bandwidth_gbps": self.bandwidth_gbps,
            "read_gbps": self.read_gbps,
            "resident_ms": self.resident_ms,
            "too_noisy": self.too_noisy,
            "noise": self.noise_lines(),
            "meta": self.meta,
            "rows": self.rows(),
            "checks": [{"check": text, "holds": holds} for text, holds in self.checks()],
        }


def _ms(m: Measurement) -> float:
    return m.ms_per_step


def budget_text(budget: Budget | None, model_bytes: int) -> str:
    return "no budget" if budget is None else budget.label(model_bytes)


def _cell(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def markdown(run: ModelRun) -> str:
    """The model's table and its checks, as the docs show them."""
    steps = run.measurements[0].steps_per_round if run.measurements else 0
    prompts = first_prompt_steps(steps)
    lines = [
        f"### {run.title}",
        "",
        f"{run.model_bytes / GIB:.1f} GiB of weights; pinned host-to-device bandwidth {run.bandwidth_gbps:.1f} GB/s; "
        + ("" if run.read_gbps is None else f"the checkpoint file read at {run.read_gbps:.1f} GB/s; ")
        + f"fully resident {run.resident_ms / 1000:.3f} s per step.",
        "",
    ]
    noise = run.noise_lines()
    if noise:
        lines += ["**Too noisy to tell 3 % apart:** " + "; ".join(noise) + ".", ""]
    lines += [
        "| method | budget | s/step (median) | min-max | x resident | x lower bound | x ComfyUI | load + 1st step s "
        + "".join(f"| first {n}-step prompt s " for n in prompts)
        + f"| of which packing s | {steps}-step wall s | peak VRAM GiB | peak host RAM GiB, anon / resident "
        "| pinned GiB | streamed GiB/step | overlap | predicted s | prediction error |",
        "| --- | --- " + "| ---: " * (15 + len(prompts)) + "|",
    ]
    for row, m in zip(run.rows(), run.measurements, strict=True):
        peak = None if row["peak_vram_bytes"] is None else row["peak_vram_bytes"] / GIB
        predicted = None if row["predicted_ms"] is None else row["predicted_ms"] / 1000
        packing = None if row["packing_ms"] is None else row["packing_ms"] / 1000
        cells = [
            row["method"],
            "" if m.budget is None else m.budget.label(run.model_bytes),
            f"{row['ms_per_step'] / 1000:.3f}",
            f"{row['min_ms'] / 1000:.3f}-{row['max_ms'] / 1000:.3f}",
            f"{row['x_resident']:.2f}",
            f"{row['x_lower_bound']:.2f}",
            _cell(row["x_comfyui"], ".2f"),
            f"{row['load_first_ms'] / 1000:.2f}",
            *(_cell(_seconds(m.first_prompt_ms(n)), ".2f") for n in prompts),
            _cell(packing, ".2f"),
            f"{row['wall_ms'] / 1000:.2f}",
            _cell(peak, ".2f"),
            f"{row['host_anon_peak_bytes'] / GIB:.1f} / {row['host_rss_peak_bytes'] / GIB:.1f}",
            f"{row['pinned_host_bytes'] / GIB:.2f}",
            f"{row['streamed_bytes'] / GIB:.2f}"
            + (f", {row['file_bytes'] / GIB:.2f} from the file" if row["file_bytes"] else ""),
            _cell(row["overlap"], ".0%"),
            _cell(predicted, ".3f"),
            _cell(row["prediction_error"], "+.1%"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Targets:", ""]
    lines += [f"- {'holds' if holds else '**misses**'}: {text}" for text, holds in run.checks()]
    lines += ["", "Placements (the pack's plan line, or what ComfyUI loaded):", ""]
    lines += [f"- {m.method}, {budget_text(m.budget, run.model_bytes)}: {m.placement}" for m in run.measurements]
    meta = ", ".join(f"{key} {value}" for key, value in run.meta.items())
    return "\n".join([*lines, "", f"Measured on: {meta}.", ""])


def write(run: ModelRun, out_dir: Path) -> tuple[Path, Path]:
    """``<model>.json`` and ``<model>.md`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data, table = out_dir / f"{run.model}.json", out_dir / f"{run.model}.md"
    data.write_text(json.dumps(run.as_dict(), indent=1) + "\n")
    table.write_text(markdown(run))
    return data, table


def write_skipped(model: str, title: str, reason: str, meta: dict[str, str], out_dir: Path) -> tuple[Path, Path]:
    """``<model>.json`` and ``<model>.md`` for a model this host cannot load, saying why."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data, table = out_dir / f"{model}.json", out_dir / f"{model}.md"
    data.write_text(json.dumps({"model": model, "title": title, "skipped": reason, "meta": meta}, indent=1) + "\n")
    details = ", ".join(f"{key} {value}" for key, value in meta.items())
    table.write_text(f"### {title}\n\nSkipped: {reason}.\n\nOn: {details}.\n")
    return data, table


def series(run: ModelRun) -> dict[str, list[tuple[float, float]]]:
    """Step time (s) against the share budgets (GiB), one line per method; budget-free rows as flat lines.
    Cards are left out (their budget holds the activations too, so they do not share the axis), and so are
    the noise controls (a second row of the same configuration)."""
    lines: dict[str, list[tuple[float, float]]] = {}
    budgets = [b for b in run.budgets if b.kind == SHARE]
    low, high = (budgets[0].nbytes / GIB, budgets[-1].nbytes / GIB) if budgets else (0.0, run.model_bytes / GIB)
    for m in run.measurements:
        if m.method.endswith(AGAIN) or (m.budget is not None and m.budget.kind != SHARE):
            continue
        if m.budget is None:
            lines[m.method] = [(low, m.ms_per_step / 1000), (high, m.ms_per_step / 1000)]
        else:
            lines.setdefault(m.method, []).append((m.budget.nbytes / GIB, m.ms_per_step / 1000))
    lines["lower bound"] = [(b.nbytes / GIB, run.budget_bound_ms(b) / 1000) for b in budgets]
    return {name: sorted(points) for name, points in lines.items()}
