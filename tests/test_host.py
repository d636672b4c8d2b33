"""The harness itself: a real ComfyUI serves this pack, runs a workflow, and fails clearly."""

from __future__ import annotations

import json
import logging
import re
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest

from harness.comfy_client import PromptValidationError
from harness.comfy_host import (
    REPO,
    ComfyHost,
    ComfyPathError,
    PortInUseError,
    StartupError,
    resolve_comfyui_path,
)

from scripts.demo import resolve_workflow

PACK_NODE_IDS = ("AsyncBlockOffload", "PartialGPUResidency", "SequentialOffloadWrapper")


def _declared_node_ids() -> list[str]:
    """The pack's node ids that nodes/ already defines (the test tightens as they appear)."""
    source = "\n".join(p.read_text() for p in (REPO / "nodes").rglob("*.py"))
    return [node_id for node_id in PACK_NODE_IDS if re.search(rf"[\"']{node_id}[\"']", source)]


def test_object_info_is_served(comfy_host: ComfyHost) -> None:
    info = comfy_host.object_info()
    assert "KSampler" in info and "SaveLatent" in info
    for node_id in _declared_node_ids():
        assert node_id in info, f"{node_id} is defined in nodes/ but ComfyUI does not list it"
        assert info[node_id]["python_module"].startswith("custom_nodes.block_offload")


def test_pack_imported_without_error(comfy_host: ComfyHost) -> None:
    log = comfy_host.log_text()
    assert "IMPORT FAILED" not in log, comfy_host.log_tail(80)
    pack_line = [line for line in log.splitlines() if line.rstrip().endswith("custom_nodes/block_offload")]
    assert pack_line, "the pack is not in ComfyUI's 'Import times for custom nodes' list:\n" + comfy_host.log_tail(80)


@pytest.mark.usefixtures("comfy")  # ComfyUI's modules importable here, for the pack's nodes
def test_the_log_says_once_which_comfyui_the_pack_runs_on(comfy_host: ComfyHost) -> None:
    from conftest import HOST_VERSION

    from block_offload.nodes import TESTED, version_notice

    assert HOST_VERSION in TESTED
    lines = [line for line in comfy_host.log_text().splitlines() if "a version this pack is tested on" in line]
    assert lines == [f"Block Offload: ComfyUI {HOST_VERSION}, a version this pack is tested on"], lines
    level, line = version_notice("0.37.2")
    assert level == logging.WARNING and "ComfyUI 0.37.2 is not a version this pack is tested on" in line
    assert "0.3.75 and 0.33.0" in line and "stream as usual" in line
    assert "no comfyui_version module" in version_notice(None)[1]


def test_validation_error_carries_node_errors(comfy_host: ComfyHost) -> None:
    prompt = {
        "1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64}},
        "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "tests/invalid"}},
    }
    with pytest.raises(PromptValidationError) as caught:
        comfy_host.queue(prompt)
    assert "1" in caught.value.node_errors
    assert "batch_size" in str(caught.value) and "EmptyLatentImage" in str(caught.value)


def _with_unique_prefix(prompt: dict[str, Any], prefix: str) -> dict[str, Any]:
    prompt = json.loads(json.dumps(prompt))
    for node in prompt.values():
        if node.get("class_type") == "SaveLatent":
            node["inputs"]["filename_prefix"] = prefix
    return prompt


def _assert_finite_latent(path: Path) -> None:
    from safetensors.torch import load_file

    tensor = load_file(str(path))["latent_tensor"]
    assert tensor.numel() > 0
    assert bool(tensor.float().isfinite().all()), f"{path} holds non-finite values"


def test_small_graph_runs_and_writes_a_latent(comfy_host: ComfyHost) -> None:
    """Needs no model: the websocket follow, the history entry and the output-file helper."""
    prefix = f"tests/{uuid.uuid4().hex[:8]}/empty"
    prompt = {
        "1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": prefix}},
    }
    result = comfy_host.run(prompt, timeout=120)
    assert result.ok, result.error_text()
    types = result.event_types()
    assert types.index("execution_start") < types.index("execution_success")
    assert result.events[-1].type == "executing" and result.events[-1].data["node"] is None
    assert result.history["status"]["status_str"] == "success"
    (latent,) = result.latent_files()
    assert latent.is_file() and latent.parent == comfy_host.output_dir / Path(prefix).parent
    _assert_finite_latent(latent)


@pytest.mark.usefixtures("tiny_models")
def test_example_workflow_writes_a_finite_latent(comfy_host: ComfyHost) -> None:
    workflow = resolve_workflow(None)
    prefix = f"tests/{uuid.uuid4().hex[:8]}/{workflow.stem}"
    prompt = _with_unique_prefix(json.loads(workflow.read_text()), prefix)
    assert any(n.get("class_type") == "SaveLatent" for n in prompt.values()), f"{workflow} has no SaveLatent"
    result = comfy_host.run(prompt, timeout=540)
    assert result.ok, result.error_text() + "\n" + comfy_host.log_tail()
    latents = result.latent_files()
    assert latents, f"no .latent output in {result.outputs()}"
    for path in latents:
        assert path.is_file()
        _assert_finite_latent(path)


# ------------------------------------------------------------------ clear errors
def test_bogus_comfyui_folder_is_named(tmp_path: Path) -> None:
    bogus = tmp_path / "not-comfyui"
    with pytest.raises(ComfyPathError, match=re.escape(str(bogus))):
        ComfyHost(bogus)


def test_bogus_comfyui_path_env_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path))
    with pytest.raises(ComfyPathError) as caught:
        resolve_comfyui_path()
    assert str(tmp_path) in str(caught.value) and "COMFYUI_PATH" in str(caught.value)


def test_missing_setup_says_run_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    with pytest.raises(ComfyPathError, match=r"scripts/setup\.sh"):
        resolve_comfyui_path(host_dir=tmp_path)


def test_port_in_use_is_reported(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        host = ComfyHost(port=port, log_path=tmp_path / "comfy.log")
        with pytest.raises(PortInUseError, match=rf"Port {port} .* already in use.*another port"):
            host.start()
        assert not host.running


def test_failed_start_shows_the_log_tail(tmp_path: Path) -> None:
    host = ComfyHost(extra_args=["--no-such-flag"], log_path=tmp_path / "comfy.log", startup_timeout=120)
    with pytest.raises(StartupError) as caught:
        host.start()
    message = str(caught.value)
    assert "exited with code" in message
    assert "unrecognized arguments: --no-such-flag" in message  # from the log's tail
    assert "unrecognized arguments" in caught.value.log_tail
    assert not host.running and not host.log_open  # stopped, log closed


def test_run_result_helpers() -> None:
    """RunResult helpers on a hand-made result (no server)."""
    from harness.comfy_client import RunResult, WsEvent

    base = Path("/tmp/base")
    result = RunResult(
        prompt_id="p",
        status="success",
        events=[WsEvent("execution_start", {"prompt_id": "p"}), WsEvent("block_offload.step", {"ms": 1.5})],
        history={"outputs": {"9": {"latents": [{"filename": "a.latent", "subfolder": "s", "type": "output"}]}}},
        wall_s=1.0,
        base_dir=base,
        output_dir=base / "output",
    )
    assert result.event_types() == ["execution_start", "block_offload.step"]
    assert result.latent_files() == [base / "output" / "s" / "a.latent"]
    assert result.events_of("block_offload.step")[0].data == {"ms": 1.5}


PROBE_PACK = """
from server import PromptServer


class ProbeMessages:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"count": ("INT", {"default": 3})}}

    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, count):
        server = PromptServer.instance
        for i in range(count):
            server.send_sync("probe.step", {"i": i}, server.client_id)
        server.send_sync("probe.broadcast", {"done": True})
        return {}


NODE_CLASS_MAPPINGS = {"ProbeMessages": ProbeMessages}
"""


def test_custom_messages_are_kept_in_order(tmp_path: Path) -> None:
    """A pack's own websocket messages (to this client, or broadcast) come back in order."""
    (tmp_path / "custom_nodes" / "probe_messages").mkdir(parents=True)
    (tmp_path / "custom_nodes" / "probe_messages" / "__init__.py").write_text(PROBE_PACK)
    with ComfyHost(base_dir=tmp_path) as host:
        result = host.run({"1": {"class_type": "ProbeMessages", "inputs": {"count": 3}}}, timeout=60)
    assert result.ok, result.error_text()
    types = result.event_types()
    assert [e.data["i"] for e in result.events_of("probe.step")] == [0, 1, 2]
    assert types.index("probe.step") > types.index("execution_start")
    assert types.index("probe.broadcast") < types.index("execution_success")


def test_nodes_have_display_names_and_a_tooltip_on_every_input(comfy_host: ComfyHost) -> None:
    info = comfy_host.object_info()
    names = {
        "AsyncBlockOffload": "Async Block Offload",
        "PartialGPUResidency": "Partial GPU Residency",
        "SequentialOffloadWrapper": "Sequential Offload Wrapper",
    }
    for node_id, display_name in names.items():
        node = info[node_id]
        assert node["display_name"] == display_name and node["category"] == "offload"
        inputs = {**node["input"]["required"], **node["input"].get("optional", {})}
        for name, (_, options) in inputs.items():
            assert options.get("tooltip"), f"{node_id}.{name} has no tooltip"
