"""What the planner keeps across restarts: each model's measured step costs per device, and the placements searched
from them, in one small JSON file (``CostCache``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .costs import Prediction, StackCosts, predict
from .plan import OffloadPlan, ResidencyPolicy
from .planner import best_plan


def cache_key(device_name: str, architecture: str, block_bytes: Sequence[int]) -> str:
    """Measurements hold for one device and one stack shape."""
    return f"{device_name} | {architecture} | {len(block_bytes)} blocks | {sum(block_bytes)} bytes"


class CostCache:
    """Measured ``StackCosts`` by ``cache_key`` in one JSON file, with the placements searched from them, so a
    restarted ComfyUI places at once. The newest ``limit`` entries are kept. A missing or unreadable file is an
    empty cache: measurements are a shortcut, never a requirement."""

    def __init__(self, path: str | os.PathLike[str], limit: int = 64) -> None:
        self.path = Path(path)
        self.limit = limit

    def _entries(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        entries = data.get("entries") if isinstance(data, dict) else None
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> StackCosts | None:
        entry = self._entries().get(key)
        if entry is None:
            return None
        try:
            return StackCosts.from_dict(entry["costs"])
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, costs: StackCosts) -> None:
        """Keeps ``costs`` for ``key``, dropping placements searched from earlier ones."""
        entries = self._entries()
        entries.pop(key, None)
        entries[key] = {"measured": time.strftime("%Y-%m-%d %H:%M:%S"), "costs": costs.as_dict()}
        self._write(dict(list(entries.items())[-self.limit :]))

    def plan(self, key: str, search: str) -> OffloadPlan | None:
        entry = self._entries().get(key)
        kept = entry.get("plans", {}).get(search) if isinstance(entry, dict) else None
        if not isinstance(kept, dict):
            return None
        try:
            return _plan_from_dict(kept)
        except (KeyError, TypeError, ValueError):
            return None

    def keep_plan(self, key: str, search: str, plan: OffloadPlan) -> None:
        entries = self._entries()
        entry = entries.get(key)
        if not isinstance(entry, dict):
            return
        kept = entry.get("plans")
        plans: dict[str, Any] = kept if isinstance(kept, dict) else {}
        plans.pop(search, None)
        plans[search] = _plan_as_dict(plan)
        entry["plans"] = dict(list(plans.items())[-self.limit :])
        self._write(entries)

    def _write(self, entries: dict[str, dict[str, Any]]) -> None:
        # Written whole then renamed, so a reader never sees half a file. A failure (a full disk; on Windows a
        # reader holding the file) must cost only what was to be kept, never the load.
        temporary = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as handle:
                temporary = handle.name
                json.dump({"version": 1, "entries": entries}, handle, indent=1)
            os.replace(temporary, self.path)
        except OSError as error:
            logging.warning(f"Block Offload: could not keep the measured costs in {self.path} ({error})")
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)


def _plan_as_dict(plan: OffloadPlan) -> dict[str, Any]:
    policy = None if plan.policy is None else plan.policy.value
    return {
        "resident": sorted(plan.resident),
        "prefetch": plan.prefetch,
        "pin_memory": plan.pin_memory,
        "policy": policy,
        "ring_bytes": plan.ring_bytes,
        "block_bytes": list(plan.block_bytes),
    }


def _plan_from_dict(data: dict[str, Any]) -> OffloadPlan:
    policy = None if data["policy"] is None else ResidencyPolicy(data["policy"])
    return OffloadPlan(
        tuple(int(size) for size in data["block_bytes"]),
        frozenset(int(block) for block in data["resident"]),
        int(data["prefetch"]),
        bool(data["pin_memory"]),
        policy,
        int(data["ring_bytes"]),
    )


def search_key(costs: StackCosts, budget_bytes: int, search: Mapping[str, object]) -> str:
    """What a search's answer depends on besides the costs: budget, other arguments, and the patches' costs."""
    patches = hashlib.sha1(json.dumps(costs.patch_ms).encode()).hexdigest()[:12] if costs.patch_ms else "none"
    return json.dumps({"budget_bytes": budget_bytes, **search, "patches": patches}, sort_keys=True)


def cached_best_plan(cache: CostCache, key: str, costs: StackCosts, budget_bytes: int, **search: Any) -> Prediction:
    """``best_plan``, searched once per costs and arguments; later loads, restarts included, only predict the kept
    placement again."""
    asked = search_key(costs, budget_bytes, search)
    kept = cache.plan(key, asked)
    if kept is not None and kept.block_bytes == costs.block_bytes:
        return predict(costs, kept, inline_copies=search.get("inline_copies", False))
    found = best_plan(costs, budget_bytes, **search)
    cache.keep_plan(key, asked, found.plan)
    return found
