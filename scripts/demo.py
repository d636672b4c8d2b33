"""Run an example workflow on a real ComfyUI with tiny random-weight models, and print the result.

Writes the tiny checkpoints into .host/models (harness/tiny_models.py), starts ComfyUI
(harness/comfy_host.py), queues example_workflows/api/<name>.json unchanged, follows it
over the websocket, prints status, wall time, output files and a summary of what the pack
did (placement, step time, copy time hidden, bandwidth, memory; from GET /block_offload/report)
with the last step's timeline drawn to a PNG (``--json``: the whole report instead), then stops
the server.
Use scripts/demo.sh, which runs scripts/setup.sh first (and this as ``python -m scripts.demo``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from harness.comfy_client import RunResult
from harness.comfy_host import REPO, ComfyHost, ComfyHostError, ensure_tiny_models

from bench.plot import timeline_chart  # the timeline is drawn as the benchmark draws its plots

WORKFLOWS = REPO / "example_workflows" / "api"
# The workflow run when none is named; when it is absent, the first by name.
DEFAULT_WORKFLOW = "async_block_offload_wan21_t2v"
REPORT_PATH = "/block_offload/report"


def available() -> list[str]:
    return sorted(p.stem for p in WORKFLOWS.glob("*.json"))


def resolve_workflow(name: str | None) -> Path:
    if name:
        as_path = Path(name)
        if as_path.is_file():
            return as_path
        candidate = WORKFLOWS / f"{name.removesuffix('.json')}.json"
        if candidate.is_file():
            return candidate
        raise SystemExit(f"demo: no workflow {name!r}; available in {WORKFLOWS}: {', '.join(available()) or 'none'}")
    default = WORKFLOWS / f"{DEFAULT_WORKFLOW}.json"
    if default.is_file():
        return default
    names = available()
    if not names:
        raise SystemExit(f"demo: no API-format workflow in {WORKFLOWS}")
    return WORKFLOWS / f"{names[0]}.json"


def describe_latent(path: Path) -> str:
    try:
        from safetensors.torch import load_file
    except ImportError:  # pragma: no cover - safetensors is one of ComfyUI's requirements
        return ""
    tensor = load_file(str(path)).get("latent_tensor")
    if tensor is None:
        return "no latent_tensor in it"
    t = tensor.float()
    finite = bool(t.isfinite().all())
    return f"shape {tuple(t.shape)}, {tensor.dtype}, finite={finite}, mean {t.mean():.4f}, std {t.std():.4f}"


def print_result(result: RunResult, startup_s: float, total_s: float) -> None:
    print(f"status:        {result.status}")
    print(f"prompt id:     {result.prompt_id}")
    print(f"run wall time: {result.wall_s:.2f} s (server start {startup_s:.2f} s, whole demo {total_s:.2f} s)")
    counts = result.summary()["events"]
    print("events:        " + ", ".join(f"{k} x{v}" for k, v in counts.items()))
    files = result.output_files()
    print("outputs:" + ("" if files else "       none"))
    for path in files:
        extra = describe_latent(path) if path.suffix == ".latent" and path.is_file() else ""
        print(f"  {path}" + (f"  ({extra})" if extra else ""))
    if not result.ok:
        print(f"error:\n{result.error_text() or json.dumps(result.history.get('status'), indent=2)}")


def fetch_report(host: ComfyHost) -> dict[str, Any] | None:
    resp = host.get(REPORT_PATH)
    if resp.status_code != 200:
        print(f"offload report: GET {REPORT_PATH} answered {resp.status_code}: {resp.text[:500]}")
        return None
    return dict(resp.json())


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def print_summary(report: dict[str, Any], timeline_png: Path) -> Path | None:
    """What the pack did, in a dozen lines; the last step's timeline drawn to ``timeline_png``."""
    if not report.get("plan"):
        print("offload:       nothing streamed in this run (the server log says why)")
        return None
    print(f"offload:       {report['node']}: {report['plan']}")
    print(f"placement:     {report['placement']}  (R resident, S streamed), prefetch {report['prefetch']}")
    memory, step = report["memory"], report.get("timeline")
    if step is not None:
        bandwidth = step["bandwidth_gbps"]
        print(f"last step:     {step['duration_ms']:.2f} ms, {len(step['spans'])} block calls "
              f"(step {report['steps_done']} of the run)")  # fmt: skip
        print(f"copies:        {_mib(step['bytes_copied'])} in {step['copy_ms']:.2f} ms, "
              f"{step['overlap']:.0%} hidden behind compute (stall {step['stall_ms']:.2f} ms)")  # fmt: skip
        print("bandwidth:     " + ("none copied" if bandwidth is None else f"{bandwidth:.1f} GB/s host to device"))
    if report["accelerator"]:
        print(f"device memory: {_mib(memory['allocated'])} allocated: resident weights "
              f"{_mib(memory['resident_weights'])}, stream buffers {_mib(memory['streaming_buffers'])}; "
              f"pinned RAM {_mib(memory['pinned_host'])}")  # fmt: skip
    else:
        print(f"memory:        no accelerator: process RSS {_mib(memory['process_rss'])}; streamed blocks "
              f"{_mib(report['streamed_host_bytes'])} in RAM (copies and times are the CPU's)")  # fmt: skip
    for notice in report["notices"]:
        print(f"notice:        {notice}")
    if step is None:
        return None
    title = f"{report['node']}: last step, {step['duration_ms']:.2f} ms ({report['device']})"
    return timeline_chart(step, report["placement"], timeline_png, title=title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workflow", nargs="?", help=f"name in example_workflows/api/ or a path; "
                        f"default {DEFAULT_WORKFLOW}")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the workflow may run (default 600)")
    parser.add_argument("--gpu", action="store_true", help="run without --cpu (ComfyUI picks the CUDA device)")
    parser.add_argument("--list", action="store_true", help="list the workflows and exit")
    parser.add_argument("--json", action="store_true", help="print the pack's whole report as JSON instead")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(available()))
        return 0

    t0 = time.monotonic()
    workflow = resolve_workflow(args.workflow)
    prompt = json.loads(workflow.read_text())
    print(f"workflow:      {workflow.relative_to(REPO) if workflow.is_relative_to(REPO) else workflow}")
    try:
        models = ensure_tiny_models()
    except ComfyHostError as exc:
        print(f"note: {exc}; running with the models already in .host/models", file=sys.stderr)
        models = {}
    for key, path in models.items():
        print(f"tiny model:    {key}: {path}")
    try:
        # On the CPU the nodes would pass the model through (nothing to save); the demo shows the streaming.
        env = {**os.environ, "BLOCK_OFFLOAD_ALLOW_CPU": "1"}
        with ComfyHost(cpu=not args.gpu, env=env) as host:
            print(f"ComfyUI:       {host.url} ({host.comfyui_path}), log {host.log_path}")
            result = host.run(prompt, timeout=args.timeout)
            print_result(result, host.startup_s or 0.0, time.monotonic() - t0)
            report = fetch_report(host)
            if report is not None and args.json:
                print(json.dumps(report, indent=2))
            elif report is not None:
                png = host.output_dir / "block_offload" / f"timeline-{result.prompt_id[:8]}.png"
                drawn = print_summary(report, png)
                if drawn is not None:
                    print(f"timeline:      {drawn}")
    except ComfyHostError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
