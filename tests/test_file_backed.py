"""Dynamic VRAM models streamed from their own checkpoint file (ComfyUI 0.33): no copy of the model in RAM.

ComfyUI's Dynamic VRAM reader maps the checkpoint (``harness/dynamic_vram.py`` runs the real reader on the
CPU); the pack's twin keeps those views, holds host buffers for as many streamed blocks as its cap allows
(``BLOCK_OFFLOAD_MAX_PINNED_GB``), and reads the others from the file at every step. Each case is compared
bitwise with the same file loaded the classic way, fully resident, in the same compute dtype.
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import HOST_VERSION
from safetensors.torch import load_file, save_file

from harness import tiny_models as tm
from harness import tiny_specs
from harness.cgroups import CgroupUnavailable, limited
from harness.dynamic_vram import COMPUTE, DynamicVram
from harness.host_memory import peak_during
from harness.inprocess import Unstreamed, count_packs, offloaded, sample
from harness.prompts import ASYNC, PARTIAL, SEQUENTIAL, differs

from bench.checkpoints import resized
from block_offload.offload import StackCosts, release_freed_host_memory
from block_offload.offload.file_source import read_threads

FAST_READS = 100e9  # bytes/s

pytestmark = [
    pytest.mark.skipif(HOST_VERSION.startswith("0.3."), reason=f"ComfyUI {HOST_VERSION} has no Dynamic VRAM"),
    pytest.mark.usefixtures("allow_cpu_streaming"),
]

GIB = 2**30
#: Blocks of the deep tiny Wan: enough that the blocks are most of the model, as in a real Wan, and that
#: the stream buffers (a few blocks, on the CPU "device") and the run's own allocations are small beside it.
BLOCKS = 64
STAGING_SLOTS = 2


@pytest.fixture(scope="module")
def deep_wan(comfy: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Wan 2.1 with its blocks repeated to ``BLOCKS``, stored in fp32 and in bf16."""
    state_dict = load_file(comfy.models["wan21"])
    for index in range(tiny_specs.WAN21_LAYERS, BLOCKS):
        source = f"blocks.{index % tiny_specs.WAN21_LAYERS}."
        for key in [key for key in state_dict if key.startswith(source)]:
            state_dict[f"blocks.{index}.{key.removeprefix(source)}"] = state_dict[key].clone()
    folder = tmp_path_factory.mktemp("deep_wan")
    paths = {}
    for name, dtype in {"fp32": torch.float32, "bf16": torch.bfloat16}.items():
        paths[name] = folder / f"wan21-deep-{name}.safetensors"
        save_file({key: value.to(dtype) for key, value in state_dict.items()}, paths[name])
    return paths


@pytest.fixture(scope="module")
def wide_wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wide Wan (``WAN21_WIDE_SIZES``), stored in fp32. The second module tree a Dynamic VRAM twin holds (5 MiB
    for the deep Wan's 1,428 modules: 5 % of its weights, 1e-4 of a real Wan's) is small beside its weights."""
    artifact = tm.Artifact("wan21_wide", resized(tiny_specs.wan21_specs, **tiny_specs.WAN21_WIDE_SIZES), torch.float32)
    path = tmp_path_factory.mktemp("wide_wan") / "wan21-wide-fp32.safetensors"
    save_file(tm.build_state_dict(artifact), path)
    return path


def block_bytes(model) -> int:
    """The blocks' bytes in the dtype the model computes in (a classic load holds them so)."""
    return sum(comfy_size(block) for block in model.model.diffusion_model.blocks)


def comfy_size(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def cap_host_buffers(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    from block_offload.nodes.comfy_memory import PINNED_LIMIT_ENV

    monkeypatch.setenv(PINNED_LIMIT_ENV, str(nbytes / GIB))


class Forwards:
    """Counts the passes through a model's blocks (one engine step each), and the bytes its engine had read
    from the file as each began."""

    def __init__(self, model) -> None:
        self.count = 0
        self.read_before: list[int] = []
        self._model = model
        self._handle = model.model.diffusion_model.register_forward_pre_hook(self._called)

    def _called(self, *_: object) -> None:
        self.count += 1
        engine = self._model.offload_engine
        self.read_before.append(engine.runner.report().bytes_read if engine else 0)

    def remove(self) -> None:
        self._handle.remove()


def assert_reads_match_the_file_tier(report, forwards: Forwards, prefetch: int, first_pass_known: bool) -> None:
    """Each pass read every file-tier unit once, as stored, and nothing else, but for the reads made ahead for
    the next pass (as far as the copies and the staging slots run). The first pass of a sequential wrapper
    guesses the modules' call order (their list order) and may read some twice: exact from the second on."""
    per_pass = report.file_tier_bytes
    ahead = (prefetch + STAGING_SLOTS) * report.staging_bytes // STAGING_SLOTS
    after_first = report.bytes_read - forwards.read_before[1]
    assert abs(after_first - (forwards.count - 1) * per_pass) <= ahead, (after_first, per_pass, ahead)
    if first_pass_known:
        total = report.bytes_read
        assert forwards.count * per_pass <= total <= forwards.count * per_pass + ahead, (total, per_pass, ahead)


def classic_run(
    comfy: SimpleNamespace,
    dynamic_vram: DynamicVram,
    unstreamed: Unstreamed,
    deep_wan: dict[str, Path],
    stored: str,
    compute: str,
) -> tuple[torch.Tensor, int, int]:
    """The deep Wan stored as ``stored``, loaded the classic way (fully resident) and computed in ``compute``:
    its latent, its blocks' bytes and the model's size; sampled once for all the cases that ask."""

    def run() -> tuple[torch.Tensor, int, int]:
        classic = dynamic_vram.load_classic(deep_wan[stored], COMPUTE[compute])
        done = sample(comfy, classic), block_bytes(classic), comfy_size(classic.model)
        comfy.mm.unload_all_models()
        return done

    return unstreamed.once((stored, compute), run)


@pytest.mark.parametrize("compute", list(COMPUTE))
@pytest.mark.parametrize("stored", ["fp32", "bf16"])
@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_a_model_four_times_the_host_cap_streams_from_its_file_exactly(
    comfy: SimpleNamespace,
    dynamic_vram: DynamicVram,
    deep_wan: dict[str, Path],
    unstreamed: Unstreamed,
    monkeypatch: pytest.MonkeyPatch,
    node: str,
    stored: str,
    compute: str,
) -> None:
    path = deep_wan[stored]
    reference, blocks, _ = classic_run(comfy, dynamic_vram, unstreamed, deep_wan, stored, compute)
    cap = blocks // 4
    cap_host_buffers(monkeypatch, cap)

    model = dynamic_vram.load(path, COMPUTE[compute])
    streaming = offloaded(comfy, node, model)
    forwards = Forwards(streaming)
    latent = sample(comfy, streaming)
    forwards.remove()
    assert torch.equal(latent, reference), differs(latent, reference)

    engine = streaming.offload_engine
    report = engine.runner.report()
    read = report.read_each_step
    assert len(read) >= len(report.streamed) // 2, f"{len(read)} of {len(report.streamed)} read from the file"
    assert report.host_bytes - report.staging_bytes <= cap, (report.host_bytes, report.staging_bytes, cap)
    assert_reads_match_the_file_tier(report, forwards, prefetch=1, first_pass_known=node != SEQUENTIAL)
    assert "read from the checkpoint file each step" in engine.summary, engine.summary
    from block_offload.nodes.placement import threads_said

    threads = read_threads(source.handle for source in report.file_slices)
    assert f"as stored, read by {threads_said(threads)}, " in engine.summary, engine.summary
    # The panel: the three tiers in the placement strip, the plan line, a read lane in the last step.
    status = comfy.panel.snapshot()
    assert status["placement"].count("F") == len(read) and status["plan"] == engine.summary, status["placement"]
    assert status["last_step"]["reads"] and status["last_step"]["bytes_read"] > 0, status["last_step"]
    # Reads at under half the bandwidth measured at the start (a cache turned cold): one notice, once.
    engine.read_bandwidth = 1e15
    engine.note_cold_reads()
    engine.note_cold_reads()
    assert len([n for n in engine.notices if "page cache no longer holds it" in n]) == 1, engine.notices
    # ComfyUI counted what the engine allocates on the device: the ring, and (fp32 stored) the cast staging.
    assert 0 < report.device_buffer_bytes <= engine.placement.buffer_bytes, (
        report.device_buffer_bytes,
        engine.placement,
    )
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("cap_share", [None, 0.25], ids=["uncapped", "cap-a-quarter"])
def test_host_memory_at_the_peak_is_the_cap_and_the_buffers(
    comfy: SimpleNamespace,
    dynamic_vram: DynamicVram,
    wide_wan: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    cap_share: float | None,
) -> None:
    """Anonymous memory (RssAnon: what the process allocated, not the checkpoint pages it maps) added by
    streaming the twin, at its peak, sampled while the node places the model and samples: at most the host
    buffers (the cap, or with none, the streamed blocks), the staging slots, what a GPU would hold (the
    resident part and the stream buffers, RAM on the CPU "device") and 10 % of the model. Stored fp32,
    computed in fp16: read in the stored dtype and cast, the worst case for a transient copy."""
    path, dtype = wide_wan, torch.float16
    # ComfyUI alone has run a prompt: the first run's own allocations (kernels, thread pools) are its.
    classic = dynamic_vram.load_classic(path, dtype)
    sample(comfy, classic)
    model_bytes = comfy_size(classic.model)
    cap = int(block_bytes(classic) * cap_share) if cap_share else None
    comfy.mm.unload_all_models()
    del classic
    if cap is not None:
        cap_host_buffers(monkeypatch, cap)
    model = dynamic_vram.load(path, dtype)
    gc.collect()
    release_freed_host_memory()  # the classic reference's memory, freed but kept by the allocator

    with peak_during(os.getpid()) as peak:
        streaming = offloaded(comfy, ASYNC, model)
        sample(comfy, streaming)
    report = streaming.offload_engine.runner.report()
    host_buffers = report.host_bytes - report.staging_bytes
    device_side = streaming.loaded_size() + report.device_buffer_bytes
    bound = (cap if cap is not None else host_buffers) + report.staging_bytes + device_side + 0.1 * model_bytes
    with capsys.disabled():
        print(
            f"\n{tiny_specs.WAN21_WIDE_SIZES['WAN21_LAYERS']}-block Wan, "
            f"{model_bytes / 2**20:.1f} MiB in fp16 (stored fp32), cap "
            f"{'none' if cap is None else f'{cap / 2**20:.1f} MiB'}: RssAnon +{peak.anon_growth / 2**20:.1f} MiB "
            f"at the peak (host buffers {host_buffers / 2**20:.1f}, staging {report.staging_bytes / 2**20:.1f}, "
            f"device side {device_side / 2**20:.1f} MiB; bound {bound / 2**20:.1f}); "
            f"{len(report.read_each_step)} of {len(report.streamed)} blocks read from the file"
        )
    if cap is None:
        assert not report.read_each_step, "no cap: every block fits in host memory"
    else:
        assert host_buffers <= cap and report.read_each_step
    assert peak.anon_growth <= bound, (peak.anon_growth, bound)
    comfy.mm.unload_all_models()


def test_in_a_container_the_twin_s_host_buffers_stay_within_its_memory_limit(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, deep_wan: dict[str, Path]
) -> None:
    """The twin with no cap of the pack's own, run in a real memory cgroup whose limit leaves room for a quarter of
    its blocks beyond the pack's RAM headroom, as a container's ``--memory`` would: psutil sees the host's RAM, the
    kernel kills at the limit. Host buffers for at most that room, the rest read from the file at each step,
    bitwise the classic load; the plan line names the limit."""
    from block_offload.nodes.comfy_memory import RAM_HEADROOM

    path, dtype = deep_wan["fp32"], COMPUTE["fp16"]
    classic = dynamic_vram.load_classic(path, dtype)
    reference = sample(comfy, classic)
    room = block_bytes(classic) // 4
    comfy.mm.unload_all_models()
    del classic
    model = dynamic_vram.load(path, dtype)
    try:
        with limited(RAM_HEADROOM + room) as group:
            streaming = offloaded(comfy, ASYNC, model)
            latent = sample(comfy, streaming)
    except CgroupUnavailable as why:
        pytest.skip(f"no memory cgroup can be made here: {why}")
    assert torch.equal(latent, reference), differs(latent, reference)
    engine = streaming.offload_engine
    report = engine.runner.report()
    assert report.host_bytes - report.staging_bytes <= room, (report.host_bytes, report.staging_bytes, room)
    assert len(report.read_each_step) >= len(report.streamed) // 2, (len(report.read_each_step), report.streamed)
    assert f"memory limit, {(RAM_HEADROOM + room) / GIB:.2f} GiB: cgroup {group}" in engine.summary, engine.summary
    comfy.mm.unload_all_models()


def with_lora(comfy: SimpleNamespace, model, strength: float):
    return comfy.sd.load_lora_for_models(model, None, load_file(comfy.models["wan21_lora"]), strength, 0)[0]


def as_cast(comfy: SimpleNamespace, dynamic_vram: DynamicVram, path: Path, dtype: torch.dtype, strength: float):
    """The reference of a node on the Dynamic VRAM model with the LoRA: patched as Dynamic VRAM patches it."""
    return dynamic_vram.load_patched_as_cast(path, dtype, load_file(comfy.models["wan21_lora"]), strength)


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_lora_before_and_after_and_a_strength_change_on_blocks_read_from_the_file(
    comfy: SimpleNamespace,
    dynamic_vram: DynamicVram,
    stored_wan: dict[str, Path],
    unstreamed: Unstreamed,
    monkeypatch: pytest.MonkeyPatch,
    node: str,
) -> None:
    """No host buffer at all (a cap of one byte): every streamed block is read from the file, cast from
    fp32 to bf16 on the device and patched there, bitwise as the Dynamic VRAM model patches it."""
    path, dtype = stored_wan["fp32"], torch.bfloat16

    def cast_runs() -> dict[float, torch.Tensor]:
        runs = {strength: sample(comfy, as_cast(comfy, dynamic_vram, path, dtype, strength)) for strength in (1.0, 0.5)}
        comfy.mm.unload_all_models()
        return runs

    references = unstreamed.once("LoRA on the cast fp32 file", cast_runs)
    cap_host_buffers(monkeypatch, 1)
    model = dynamic_vram.load(path, dtype)
    cases = {
        "LoRA then node": (1.0, lambda: offloaded(comfy, node, with_lora(comfy, model, 1.0))),
        "node then LoRA": (1.0, lambda: with_lora(comfy, offloaded(comfy, node, model), 1.0)),
        "strength changed": (0.5, lambda: with_lora(comfy, offloaded(comfy, node, model), 0.5)),
        "strength changed before the node": (0.5, lambda: offloaded(comfy, node, with_lora(comfy, model, 0.5))),
    }
    for case, (strength, build) in cases.items():
        streaming = build()
        latent = sample(comfy, streaming)
        assert torch.equal(latent, references[strength]), f"{case}: {differs(latent, references[strength])}"
        report = streaming.offload_engine.runner.report()
        assert report.read_each_step == report.streamed, case
        # No host buffer of weights: the staging slots, and the LoRA's adapters staged with their blocks.
        assert report.companion_bytes > 0 and report.host_bytes == report.staging_bytes + report.companion_bytes, case
    comfy.mm.unload_all_models()


def test_a_quantized_checkpoint_streams_its_stored_bytes_from_the_file(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp8 ``comfy_quant`` (QuantizedTensor): the quantized data and scales are read from the file as stored
    and rebuilt around the device copy, bitwise as the classic load computes."""
    path = comfy.models[tm.WAN21_FP8]
    reference = sample(comfy, dynamic_vram.load_classic(path, torch.bfloat16))
    comfy.mm.unload_all_models()
    cap_host_buffers(monkeypatch, 1)
    model = dynamic_vram.load(path, torch.bfloat16)
    for node in (ASYNC, PARTIAL, SEQUENTIAL):
        streaming = offloaded(comfy, node, model)
        forwards = Forwards(streaming)
        latent = sample(comfy, streaming)
        forwards.remove()
        assert torch.equal(latent, reference), f"{node}: {differs(latent, reference)}"
        report = streaming.offload_engine.runner.report()
        assert report.read_each_step, f"{node}: nothing read from the file"
        assert_reads_match_the_file_tier(report, forwards, prefetch=1, first_pass_known=node != SEQUENTIAL)
        comfy.mm.unload_all_models()


@pytest.mark.parametrize("name", [tm.WAN21_INT8, tm.WAN21_W4A4])
def test_a_lora_on_quantized_blocks_read_from_the_file_computes_as_the_classic_load(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Every streamed block read from the file as stored (int8, 4-bit), then patched and re-quantized in the
    ring as it arrives: bitwise the classic full load with the LoRA, which runs the format's own kernel."""
    path = comfy.models[name]
    reference = sample(comfy, with_lora(comfy, dynamic_vram.load_classic(path, torch.bfloat16), 1.0))
    comfy.mm.unload_all_models()
    cap_host_buffers(monkeypatch, 1)
    model = dynamic_vram.load(path, torch.bfloat16)
    for node in (ASYNC, PARTIAL, SEQUENTIAL):
        for order in ("LoRA then node", "node then LoRA"):
            if order == "LoRA then node":
                streaming = offloaded(comfy, node, with_lora(comfy, model, 1.0))
            else:
                streaming = with_lora(comfy, offloaded(comfy, node, model), 1.0)
            latent = sample(comfy, streaming)
            assert torch.equal(latent, reference), f"{node}, {order}: {differs(latent, reference)}"
            report = streaming.offload_engine.runner.report()
            assert report.read_each_step, f"{node}, {order}: nothing read from the file"
            comfy.mm.unload_all_models()


def test_a_checkpoint_truncated_mid_run_stops_with_a_clear_error_and_comfyui_goes_on(
    comfy: SimpleNamespace,
    dynamic_vram: DynamicVram,
    stored_wan: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    path = tmp_path / "wan21-bf16.safetensors"
    shutil.copy(stored_wan["bf16"], path)
    cap_host_buffers(monkeypatch, 1)
    model = dynamic_vram.load(path, torch.bfloat16)
    streaming = offloaded(comfy, ASYNC, model)
    sample(comfy, streaming)
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)
    with pytest.raises(RuntimeError, match=rf"{path.name} (changed|ended .* early).*load the model again"):
        sample(comfy, streaming)
    comfy.mm.unload_all_models()
    # ComfyUI goes on: another model loads, streams and samples.
    other = dynamic_vram.load(stored_wan["bf16"], torch.bfloat16)
    reference = sample(comfy, dynamic_vram.load_classic(stored_wan["bf16"], torch.bfloat16))
    assert torch.equal(sample(comfy, offloaded(comfy, ASYNC, other)), reference)
    comfy.mm.unload_all_models()


def test_an_unloaded_twin_keeps_no_copy_of_what_comfyui_loaded(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, deep_wan: dict[str, Path]
) -> None:
    """ComfyUI's unload moves what it loaded (the resident block and everything outside the blocks, cast to
    fp16) back to the host; the twin points those weights at the file again, and loads them again after."""
    path, dtype = deep_wan["fp32"], torch.float16
    reference = sample(comfy, dynamic_vram.load_classic(path, dtype))
    comfy.mm.unload_all_models()
    model = dynamic_vram.load(path, dtype)
    streaming = offloaded(comfy, ASYNC, model)
    assert torch.equal(sample(comfy, streaming), reference)
    twin = streaming.model
    from block_offload.nodes.dynamic_vram import file_slice, file_views

    views = file_views(twin)
    weights = {name for name in twin.state_dict() if name.startswith("diffusion_model.")}  # not the sigmas
    assert weights <= set(views), f"not views of the checkpoint: {weights - set(views)}"
    assert twin.diffusion_model.head.head.weight.dtype == torch.float16  # cast for ComfyUI's load
    comfy.mm.unload_all_models()
    held = dict(twin.named_parameters())
    moved = [name for name in views if name in held and file_slice(held[name]) is None]
    assert not moved, f"left as copies after the unload: {moved[:5]}"
    assert torch.equal(sample(comfy, offloaded(comfy, ASYNC, model)), reference)
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_lora_changes_on_a_twin_write_no_host_byte(
    comfy: SimpleNamespace,
    dynamic_vram: DynamicVram,
    stored_wan: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    node: str,
) -> None:
    """Host buffers packed from the file park and are adopted like any (their file views kept beside them):
    a strength change, the LoRA removed, a LoRA before the node, each bitwise ComfyUI's classic load with the
    same patches, and no block packed again, in the host tier or the file tier."""
    path, dtype = stored_wan["bf16"], torch.float16
    references = {s: sample(comfy, as_cast(comfy, dynamic_vram, path, dtype, s)) for s in (1.0, 0.5)}
    classic = dynamic_vram.load_classic(path, dtype)
    references[0.0] = sample(comfy, classic)
    cap_host_buffers(monkeypatch, block_bytes(classic) // 2)
    comfy.mm.unload_all_models()
    del classic

    model = dynamic_vram.load(path, dtype)
    streaming = offloaded(comfy, node, model)
    first = with_lora(comfy, streaming, 1.0)
    assert torch.equal(sample(comfy, first), references[1.0])
    report = first.offload_engine.runner.report()
    assert report.read_each_step and report.streamed - report.read_each_step, "both tiers"
    packed = count_packs(monkeypatch)
    for strength, patcher in [
        (0.5, with_lora(comfy, streaming, 0.5)),  # another strength
        (0.0, streaming),  # the LoRA removed
        (1.0, offloaded(comfy, node, with_lora(comfy, model, 1.0))),  # before the node: another engine
    ]:
        assert torch.equal(sample(comfy, patcher), references[strength]), strength
    assert packed == [], f"{len(packed)} blocks packed again ({sum(packed)} bytes written)"
    comfy.mm.unload_all_models()
    # The real unload gives every weight of the twin back to the file.
    from block_offload.nodes.dynamic_vram import file_slice, file_views

    views = file_views(streaming.model)
    held = dict(streaming.model.named_parameters())
    assert not [name for name in views if name in held and file_slice(held[name]) is None]


def test_a_later_engine_starts_from_the_call_order_its_model_last_ran(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, stored_wan: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sequential wrapper's modules are not called in their list order, so an engine's first pass reads
    some of them twice; the next engine of the model (another patch set) starts from the order the last
    one saw, and reads each file-tier module once from its first pass on."""
    cap_host_buffers(monkeypatch, 1)
    model = dynamic_vram.load(stored_wan["bf16"], torch.float16)
    first = offloaded(comfy, SEQUENTIAL, model)
    sample(comfy, first)
    engine = first.offload_engine
    order = engine.runner.report().last_order
    assert list(order) != sorted(order), "the modules' calls follow their list order: nothing to learn"
    second = with_lora(comfy, first, 0.5)
    forwards = Forwards(second)
    sample(comfy, second)
    forwards.remove()
    assert second.offload_engine is not engine, "the patch set changed: another engine"
    assert_reads_match_the_file_tier(second.offload_engine.runner.report(), forwards, prefetch=1, first_pass_known=True)
    comfy.mm.unload_all_models()


def test_a_lora_that_stays_is_baked_once_into_the_host_buffers_and_a_change_packs_them_from_the_file(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, stored_wan: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planned placement where the patches are most of the step (the blocks' compute given as 0.01 ms, the
    patches timed on this CPU): the first prompt patches at each call; once the LoRA has run long enough for
    baking to have paid twice over, an engine writes it once into the host-tier blocks' buffers, whose
    originals are the file's views (the file-tier blocks are still patched at each call). Each output is
    bitwise ComfyUI's classic full load; a clone with the same patches adopts the baked buffers as they are,
    and a strength change packs the baked blocks from the file again, and only them."""
    from block_offload.nodes import engine as engine_module
    from block_offload.nodes.loaded_patch import LoadedPatch

    path, dtype = stored_wan["bf16"], torch.float16
    references = {s: sample(comfy, as_cast(comfy, dynamic_vram, path, dtype, s)) for s in (1.0, 0.5)}
    classic = dynamic_vram.load_classic(path, dtype)
    cap_host_buffers(monkeypatch, block_bytes(classic) // 2)
    # The file tier's read speed is measured from the page cache as the model is placed, and bounds the step from
    # below; on a loaded machine that bound can pass this 0.05 ms stack's whole step and hide the saving the test
    # is about. A fixed speed keeps the bound under it.
    monkeypatch.setattr(engine_module, "read_bandwidth", lambda slices: FAST_READS)
    comfy.mm.unload_all_models()
    del classic

    model = dynamic_vram.load(path, dtype)
    found = comfy.placement.find_blocks(model.model.diffusion_model)
    blocks = found.blocks
    sizes = [comfy.placement.module_bytes(block, comfy.placement.recorded_dtype) for _, block in blocks]
    cache = comfy.placement.cost_cache()
    cache.path.unlink(missing_ok=True)
    key = comfy.placement.cache_key(comfy.placement.device_name(model.load_device), found.model_class, sizes)
    costs = StackCosts(tuple(sizes), tuple(range(len(sizes))), (0.01,) * len(sizes), (0.0,) * len(sizes), 0.0, 1e3)
    cache.put(key, costs)
    streaming = comfy.nodes.AsyncBlockOffload.execute(
        model, resident_blocks=1, prefetch_blocks=1, pin_memory=True, policy="auto"
    ).result[0]
    lora = with_lora(comfy, streaming, 1.0)
    baked = []
    for _ in range(3):  # evicted between prompts: each places the model again, its history kept on the model
        assert torch.equal(sample(comfy, lora), references[1.0])
        engine = lora.offload_engine
        assert "chosen by the planner" in engine.summary, engine.summary
        baked.append(engine.baked)
        if engine.baked:
            break
        assert "patches applied at each call: baking them into the host buffers would save" in engine.summary
        comfy.mm.unload_all_models()
    report = engine.runner.report()
    assert not [notice for notice in engine.notices if "planned resident" in notice], engine.notices
    assert baked[0] == frozenset() and baked[-1], (baked, engine.summary)
    assert baked[-1] == report.streamed - report.read_each_step, "every host-tier block, no file-tier block"
    assert "patches baked once into the host buffers of" in engine.summary
    # Patched where they arrive: the file-tier blocks only (their patches are the engine's ``transforms``).
    assert set(engine.runner.spec.transforms) == set(report.read_each_step), (
        engine.runner.spec.transforms,
        report.read_each_step,
    )

    packed = count_packs(monkeypatch)
    written: list[str] = []
    write_to_host = LoadedPatch.write_to_host
    monkeypatch.setattr(
        LoadedPatch, "write_to_host", lambda self, device: (written.append(self.key), write_to_host(self, device))[1]
    )
    assert torch.equal(sample(comfy, lora.clone()), references[1.0])  # the same patches: as they are
    assert packed == [] and written == []
    changed = with_lora(comfy, streaming, 0.5)
    assert torch.equal(sample(comfy, changed), references[0.5])
    assert changed.offload_engine.baked == frozenset() and written == []
    changed.offload_engine.runner.finish_packing()  # they are packed again in the background
    assert len(packed) == len(baked[-1]), f"{len(packed)} blocks packed again, {len(baked[-1])} were baked"
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_where_comfyui_chose_fast_disk_the_twin_holds_no_host_buffer(
    comfy: SimpleNamespace,
    dynamic_vram: DynamicVram,
    deep_wan: dict[str, Path],
    unstreamed: Unstreamed,
    monkeypatch: pytest.MonkeyPatch,
    node: str,
) -> None:
    """ComfyUI 0.36+ reads the offloaded weights of a checkpoint on a fast disk from the file at each step instead
    of pinning them in RAM (``ModelPatcher.fast_disk``, which its loader sets and ``clone()`` passes on). The
    twin and every clone of it keep the choice, and the file tier follows it: no host buffer (it would take more
    RAM than ComfyUI alone), every streamed unit read from the file through the staging slots, which is all the
    anonymous memory the node adds at its peak beside the device side; the plan line says so. Bitwise the
    classic load. With ``BLOCK_OFFLOAD_MAX_PINNED_GB`` set, host buffers up to it, as on any disk."""
    from block_offload.nodes.comfy_memory import PINNED_LIMIT_ENV

    reference, blocks, model_bytes = classic_run(comfy, dynamic_vram, unstreamed, deep_wan, "bf16", "fp16")
    cap = blocks // 4
    monkeypatch.delenv(PINNED_LIMIT_ENV, raising=False)
    model = dynamic_vram.load(deep_wan["bf16"], COMPUTE["fp16"])
    model.fast_disk = True  # as ComfyUI 0.36+'s loader sets it for a checkpoint on a fast NVMe disk
    gc.collect()
    release_freed_host_memory()

    with peak_during(os.getpid()) as peak:
        streaming = offloaded(comfy, node, model)
        latent = sample(comfy, streaming)
    assert torch.equal(latent, reference), differs(latent, reference)
    assert streaming.fast_disk and streaming.clone().fast_disk and with_lora(comfy, streaming, 1.0).fast_disk
    engine = streaming.offload_engine
    report = engine.runner.report()
    assert report.read_each_step == report.streamed and report.host_bytes == report.staging_bytes > 0
    assert "ComfyUI chose fast-disk for this checkpoint: no host buffers" in engine.summary, engine.summary
    device_side = streaming.loaded_size() + report.device_buffer_bytes
    # The slack is the run's own memory (the sampler, Python state): +2.5 to +10.7 MiB above the rest here,
    # 3 to 11 % of the model, and once (a CI run, 2026-11-28) 66 KB over 15 %; a host copy of the weights would
    # be 100 %.
    bound = report.staging_bytes + device_side + 0.2 * model_bytes
    print(
        f"fast-disk, {node}: RssAnon +{peak.anon_growth / 2**20:.1f} MiB at the peak (staging "
        f"{report.staging_bytes / 2**20:.1f}, device side {device_side / 2**20:.1f}, "
        f"model {model_bytes / 2**20:.1f} MiB)"
    )
    assert peak.anon_growth <= bound, (peak.anon_growth, bound)
    comfy.mm.unload_all_models()

    cap_host_buffers(monkeypatch, cap)  # the user's own cap: host buffers up to it
    kept = offloaded(comfy, node, model)
    assert torch.equal(sample(comfy, kept), reference)
    report = kept.offload_engine.runner.report()
    assert 0 < report.host_bytes - report.staging_bytes <= cap and report.read_each_step
    assert f"{PINNED_LIMIT_ENV} keeps some in RAM" in kept.offload_engine.summary
    comfy.mm.unload_all_models()
