"""A line chart as a PNG, drawn with Pillow (which ComfyUI already installs): no plotting library.

Enough for the benchmark's one figure kind: a few named lines of (x, y) points, linear axes
from zero, a legend beside the plot.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

# Distinguishable on white (Okabe-Ito, then Paul Tol's muted set), one per method line.
PALETTE = (
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#882255",
    "#117733", "#332288", "#999933", "#AA4499", "#44AA99", "#661100", "#6699CC",
)  # fmt: skip
# Reference lines, not methods: dashed, in black and grey.
REFERENCES = {"fully resident": "#000000", "lower bound": "#888888"}


def _ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top``."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def _dashed(draw: ImageDraw.ImageDraw, a: tuple[float, float], b: tuple[float, float], fill: str) -> None:
    length = math.dist(a, b)
    for start in range(0, int(length), 12):
        t0, t1 = start / length, min(start + 7, length) / length
        p0 = (a[0] + (b[0] - a[0]) * t0, a[1] + (b[1] - a[1]) * t0)
        p1 = (a[0] + (b[0] - a[0]) * t1, a[1] + (b[1] - a[1]) * t1)
        draw.line([p0, p1], fill=fill, width=2)


def line_chart(
    series: dict[str, list[tuple[float, float]]],
    path: Path,
    *,
    title: str,
    x_label: str,
    y_label: str,
    size: tuple[int, int] = (1280, 600),
) -> Path:
    """Draws ``series`` (name -> points) and writes the PNG to ``path``."""
    image = chart_image(series, title=title, x_label=x_label, y_label=y_label, size=size)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def chart_image(
    series: dict[str, list[tuple[float, float]]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    size: tuple[int, int],
    legend_width: int = 460,
) -> Image.Image:
    """``series`` drawn as lines, the legend to the right of the plot (``legend_width`` pixels)."""
    width, height = size
    font = ImageFont.load_default(size=14)
    small = ImageFont.load_default(size=12)
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = 80, 70, width - legend_width, height - 60
    points = [p for line in series.values() for p in line]
    x_ticks = _ticks(max((x for x, _ in points), default=1.0))
    y_ticks = _ticks(max((y for _, y in points), default=1.0))

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            left + (right - left) * x / x_ticks[-1],
            bottom - (bottom - top) * y / y_ticks[-1],
        )

    draw.text((left, 15), title, fill="black", font=font)
    for x in x_ticks:
        px, _ = at(x, 0)
        draw.line([(px, top), (px, bottom)], fill="#e6e6e6")
        draw.text((px, bottom + 8), f"{x:g}", fill="black", font=small, anchor="mt")
    for y in y_ticks:
        _, py = at(0, y)
        draw.line([(left, py), (right, py)], fill="#e6e6e6")
        draw.text((left - 8, py), f"{y:g}", fill="black", font=small, anchor="rm")
    draw.rectangle([left, top, right, bottom], outline="black")
    draw.text(((left + right) / 2, height - 22), x_label, fill="black", font=font, anchor="mm")
    draw.text((12, top - 24), y_label, fill="black", font=font)

    methods = 0
    for number, (name, line) in enumerate(series.items()):
        dashed = name in REFERENCES
        colour = REFERENCES[name] if dashed else PALETTE[methods % len(PALETTE)]
        methods += not dashed
        pixels = [at(x, y) for x, y in line]
        for a, b in zip(pixels, pixels[1:], strict=False):
            if dashed:
                _dashed(draw, a, b, colour)
            else:
                draw.line([a, b], fill=colour, width=3)
        if not dashed:
            for px, py in pixels:
                draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colour)
        legend_y = top + 4 + number * 22
        if dashed:
            _dashed(draw, (right + 20, legend_y + 7), (right + 50, legend_y + 7), colour)
        else:
            draw.line([(right + 20, legend_y + 7), (right + 50, legend_y + 7)], fill=colour, width=3)
        draw.text((right + 58, legend_y), name, fill="black", font=small)
    return image


# The panel's colours (web/block_offload_panel.js), so the picture reads the same in both places.
TIMELINE_COLOURS = {
    "copy": "#d6a23f",
    "compute": "#4f8fd6",
    "compute_streamed": "#3fb68b",
    "stall": "#e5533d",
}


def timeline_chart(step: dict, placement: str, path: Path, *, title: str, size: tuple[int, int] = (1280, 260)) -> Path:
    """One step of the engine's timeline as the live panel draws it: a copy lane and a compute lane, one
    box per block call labelled with the block, streamed blocks' compute in green, stalls (compute waiting
    for its copy) as a red bar before the compute they delayed. ``step`` is a recorder step as the pack's
    report gives it (``StepTimeline.as_dict``, times in ms from the step's start); ``placement`` has one
    letter per block, R resident or S streamed."""
    width, height = size
    font = ImageFont.load_default(size=14)
    small = ImageFont.load_default(size=12)
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    left, right, lane = 90, width - 20, 56
    lanes = {"copy": 50, "compute": 50 + lane + 10}
    spans = step["spans"]
    end = max([s["compute_end"] for s in spans] + [s["copy_end"] or 0 for s in spans] + [1e-9])
    ticks = _ticks(end, count=8)

    def x(t: float) -> float:
        return left + (right - left) * max(0.0, t) / ticks[-1]

    draw.text((left, 15), title, fill="black", font=font)
    for name, top in lanes.items():
        draw.text((10, top + lane / 2), name, fill="black", font=font, anchor="lm")
    for span in spans:
        if span["copy_start"] is not None and span["copy_end"] > 0:
            x0, x1 = x(span["copy_start"]), x(span["copy_end"])
            _box(draw, x0, max(x0 + 1, x1), lanes["copy"], lane, TIMELINE_COLOURS["copy"], str(span["block"]), small)
        streamed = span["block"] < len(placement) and placement[span["block"]] != "R"
        colour = TIMELINE_COLOURS["compute_streamed" if streamed else "compute"]
        x0, x1 = x(span["compute_start"]), x(span["compute_end"])
        _box(draw, x0, max(x0 + 1, x1), lanes["compute"], lane, colour, str(span["block"]), small)
        if span["stall"] > 0:
            s0 = x(span["compute_start"] - span["stall"])
            bottom = lanes["compute"] + lane
            draw.rectangle([s0, bottom - 5, max(s0 + 2, x0), bottom], fill=TIMELINE_COLOURS["stall"])
    axis = lanes["compute"] + lane + 8
    draw.line([(left, axis), (right, axis)], fill="black")
    for t in ticks:
        draw.line([(x(t), axis), (x(t), axis + 4)], fill="black")
        draw.text((x(t), axis + 6), f"{t:g} ms", fill="black", font=small, anchor="mt")
    legend = [("copy", "copy"), ("resident block", "compute"), ("streamed block", "compute_streamed"),
              ("stall: compute waits for its copy", "stall")]  # fmt: skip
    lx = left
    for label, key in legend:
        draw.rectangle([lx, height - 24, lx + 14, height - 10], fill=TIMELINE_COLOURS[key])
        draw.text((lx + 20, height - 17), label, fill="black", font=small, anchor="lm")
        lx += 30 + draw.textlength(label, font=small)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def _box(draw: ImageDraw.ImageDraw, x0: float, x1: float, top: float, height: float, colour: str, label: str,
         font: ImageFont.ImageFont) -> None:  # fmt: skip
    draw.rectangle([x0, top, x1, top + height], fill=colour, outline="white")
    if x1 - x0 >= 14:
        draw.text(((x0 + x1) / 2, top + height / 2), label, fill="white", font=font, anchor="mm")


# -- the H100 records' figure (python -m bench.plot) ------------------------------------------------------

#: The pack's rows the figure draws, against ComfyUI's async offload (its NVIDIA default) and the bound.
PACK_ROWS = (
    "Async Block Offload, leading blocks that fit, prefetch 1",
    "Partial GPU Residency, strided",
    "Partial GPU Residency, auto",
    "Sequential Offload Wrapper, prefetch 2",
)
COMFYUI_ROW = "ComfyUI, async offload on"


def record_series(record) -> dict[str, list[tuple[float, float]]]:
    """Step time (s) against the budget (% of the model's bytes) for the records' rows the figure draws."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in record.rows:
        if row.share is not None and row.method in (COMFYUI_ROW, *PACK_ROWS):
            lines.setdefault(row.method, []).append((100 * row.share, row.ms_per_step / 1000))
    shares = sorted({share for points in lines.values() for share, _ in points})
    lines["fully resident"] = [(shares[0], record.resident_ms / 1000), (shares[-1], record.resident_ms / 1000)]
    lines["lower bound"] = [(share, record.lower_bound_ms(share / 100) / 1000) for share in shares]
    return {name: sorted(points) for name, points in lines.items()}


def records_figure(folder: Path, models: tuple[str, ...], path: Path, *, device: str) -> Path:
    """One panel per model, stacked: the pack's rows, ComfyUI's async offload and the lower bound."""
    from bench.records import read_model

    panels = []
    for model in models:
        record = read_model(folder, model)
        panels.append(
            chart_image(
                record_series(record),
                title=f"{record.title}: step time vs VRAM budget ({device})",
                x_label="VRAM budget for the weights (% of the model's bytes)",
                y_label="seconds per step",
                size=(1280, 520),
            )
        )
    figure = Image.new("RGB", (1280, sum(panel.height for panel in panels)), "white")
    for number, panel in enumerate(panels):
        figure.paste(panel, (0, number * panel.height))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.save(path)
    return path


if __name__ == "__main__":
    repo = Path(__file__).resolve().parents[1]
    written = records_figure(
        repo / "docs" / "records" / "h100-2026-11-23",
        ("wan14b", "flux12b"),
        repo / "docs" / "h100-2026-11-23.png",
        device="H100 80GB HBM3, commit 52fc85d",
    )
    print(f"wrote {written}")
