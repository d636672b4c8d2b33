"""What the pack last did, for the demo, the panel and anyone asking ``GET /block_offload/report``."""

from __future__ import annotations

import weakref
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import psutil

from ..offload import memory_snapshot

if TYPE_CHECKING:
    from .patcher import _Engine

_active: weakref.ref | None = None
_last_summary: dict[str, Any] = {}


def engine_started(engine: _Engine) -> None:
    global _active
    _active = weakref.ref(engine)
    _last_summary.clear()
    _last_summary.update(node=engine.request.node, plan=engine.summary)


def engine_stopped(engine: _Engine) -> None:
    """Keeps the stopped engine's last step: the report describes the last run, not only a live one."""
    step = engine.recorder.latest()
    if step is not None:
        _last_summary["timeline"] = step.as_dict()


def snapshot() -> dict[str, Any]:
    engine = _active() if _active is not None else None
    data = dict(_last_summary)
    if engine is not None:
        step = engine.recorder.latest()
        if step is not None:
            data["timeline"] = step.as_dict()
        memory = memory_snapshot(engine.recorder.device)
        data["device"] = str(engine.recorder.device)
        data["memory"] = asdict(memory)
    data["process_rss_bytes"] = psutil.Process().memory_info().rss
    return data


def register_routes() -> None:
    from aiohttp import web
    from server import PromptServer

    @PromptServer.instance.routes.get("/block_offload/report")
    async def get_report(request: web.Request) -> web.Response:
        return web.json_response(snapshot())
