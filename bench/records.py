"""The committed GPU records (``docs/records/<device>-<date>/``) read back as rows: the benchmark's JSON, and
the progress logs of runs that stopped before writing one.

The first H100 run (2026-11-23, commit 52fc85d) wrote JSON only for its 75 % budgets; the 25 % and 50 %
rows exist only as the progress lines ``method: <s> s/step; <placement>`` that ``bench/comfy_bench.py``
printed as it went, in the order it measured: the rows without a budget, then each budget's rows starting
with ComfyUI's async offload on (``--budgets 0.25 0.5 0.75``). Those lines are parsed here, so the plot is
made from the committed files as they are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from bench.results import AUTO, COMFYUI

#: The budgets of the logged runs, in the order they ran (the command's default).
LOGGED_SHARES = (0.25, 0.5, 0.75)
_LINE = re.compile(r"^(?P<method>[^:]+): (?P<seconds>\d+\.\d+) s/step; (?P<placement>.*)$")
#: The placement line of an automatic placement's first load, which measured its costs.
_MEASURING = "not measured on this device yet"
_FIRST_RUN = f"{AUTO} (first run: strided, measuring)"


@dataclass(frozen=True)
class RecordRow:
    method: str
    share: float | None  # the budget as a share of the model's bytes; None: no budget
    ms_per_step: float


@dataclass(frozen=True)
class ModelRecord:
    """One model's rows from a record folder, and what the lower bound needs."""

    model: str
    title: str
    model_bytes: int
    bandwidth_gbps: float
    resident_ms: float
    rows: list[RecordRow]

    def lower_bound_ms(self, share: float) -> float:
        """At a budget, what does not fit is copied every step at the pinned bandwidth, or the resident step."""
        return max(self.resident_ms, (1 - share) * self.model_bytes / (self.bandwidth_gbps * 1e6))


def log_rows(text: str) -> list[RecordRow]:
    """The rows of a progress log; the budget advances at each "ComfyUI, async offload on" line."""
    rows, share, shares = [], None, iter(LOGGED_SHARES)
    for line in text.splitlines():
        found = _LINE.match(line)
        if found is None:
            continue
        method = _FIRST_RUN if _MEASURING in found["placement"] else found["method"]
        if method == f"{COMFYUI}, async offload on":
            share = next(shares)
        rows.append(RecordRow(method, share, float(found["seconds"]) * 1000))
    return rows


def read_model(folder: Path, model: str) -> ModelRecord:
    """``<model>-*.json`` (each written by the benchmark) and ``<model>-*.log`` for the budgets no JSON has."""
    records = [json.loads(path.read_text()) for path in sorted(folder.glob(f"{model}-*.json"))]
    if not records:
        raise FileNotFoundError(f"no {model}-*.json in {folder}: the model's size and bandwidth come from one")
    rows = [
        RecordRow(row["method"], row["budget_fraction"], row["ms_per_step"]) for data in records for row in data["rows"]
    ]
    covered = {row.share for row in rows}
    for path in sorted(folder.glob(f"{model}-*.log")):
        rows += [row for row in log_rows(path.read_text()) if row.share not in covered]
    first = records[0]
    return ModelRecord(model, first["title"], first["model_bytes"], first["bandwidth_gbps"], first["resident_ms"], rows)
