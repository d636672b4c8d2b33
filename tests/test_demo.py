"""The demo's summary (scripts/demo.py): what a newcomer reads after the first run, and the timeline PNG."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from harness.comfy_host import REPO, ComfyHost

from bench.plot import TIMELINE_COLOURS
from scripts.demo import fetch_report, print_summary

WORKFLOW = REPO / "example_workflows" / "api" / "async_block_offload_wan21_t2v.json"


def _colour_pixels(image: Image.Image, colour: str) -> int:
    rgb = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return sum(count for count, pixel in image.getcolors(maxcolors=1 << 16) if pixel == rgb)


@pytest.mark.usefixtures("tiny_models")
def test_the_summary_says_what_streamed_in_a_dozen_lines_and_draws_the_step(
    comfy_host: ComfyHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = comfy_host.run(json.loads(WORKFLOW.read_text()), timeout=300)
    assert result.ok, result.error_text()
    report = fetch_report(comfy_host)
    assert report is not None and report["prompt_id"] == result.prompt_id
    png = print_summary(report, tmp_path / "timeline.png")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 12, lines
    text = "\n".join(lines)
    assert (
        "offload:       Async Block Offload: WanModel (blocks: 5 x WanAttentionBlock; 0.01 GiB): 1/5 blocks resident"
        in text
    )
    # policy auto: strided while it measures, then the planner's pick of the one resident block.
    placement = re.search(r"placement:     ([RS]{5})  \(R resident, S streamed\), prefetch (\d)", text)
    assert placement and placement[1].count("R") == 1 and int(placement[2]) <= 1, text
    assert "hidden behind compute" in text and "last step:" in text and "process RSS" in text

    full = Image.open(png).convert("RGB")
    image = full.crop((0, 0, full.width, full.height - 32))  # the lanes, without the legend
    assert _colour_pixels(image, TIMELINE_COLOURS["compute"]) > 0, "no resident block drawn"
    assert _colour_pixels(image, TIMELINE_COLOURS["compute_streamed"]) > 0, "no streamed block drawn"
    # Four streamed boxes for one resident one, in proportion to their compute time.
    # The resident block is the one the placement names (the planner's pick under auto), not always block 0.
    spans = report["timeline"]["spans"]
    resident = placement[1].index("R")
    streamed_ms = sum(s["compute_end"] - s["compute_start"] for s in spans if s["block"] != resident)
    resident_ms = sum(s["compute_end"] - s["compute_start"] for s in spans if s["block"] == resident)
    ratio = _colour_pixels(image, TIMELINE_COLOURS["compute_streamed"]) / _colour_pixels(
        image, TIMELINE_COLOURS["compute"]
    )
    assert ratio == pytest.approx(streamed_ms / resident_ms, rel=0.25)
