"""Parking: a streamer that stops without restoring, and the next one on the same modules adopting its
host buffers, so a host that hands a model from engine to engine (ComfyUI: a new clone every prompt)
neither copies nor pins the streamed weights again: the nodes in-process in a real ComfyUI. The engine's own
parking: ``tests/torch_only/test_parking.py``."""

from __future__ import annotations

import gc
from collections.abc import Iterable
from types import SimpleNamespace

import pytest
import torch

from harness.inprocess import async_offload, count_packs, offloaded, sample, wan
from harness.parking import host_ptrs

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")  # the nodes stream on the CPU too


def host_buffers(model) -> dict[int, int]:
    runner = model.offload_engine.runner
    return host_ptrs(runner)


def block_weights(model, indices: Iterable[int]) -> dict[str, int]:
    """Where the tensors of blocks ``indices`` are now: name, address."""
    blocks = model.model.diffusion_model.blocks
    return {f"{i}.{name}": t.data_ptr() for i in indices for name, t in blocks[i].state_dict().items()}


def test_consecutive_prompts_stream_the_same_memory(comfy: SimpleNamespace) -> None:
    """Each sampling run loads a new clone of the same MODEL; the previous clone's engine stops, the new one
    streams the same memory: pageable on the CPU, the loader's own tensors, never copied into host buffers;
    bitwise equal results; /free still leaves no engine and nothing pinned, the weights where they were."""
    model = wan(comfy)
    reference = sample(comfy, model)
    patched = async_offload(comfy, model, resident=1)
    assert torch.equal(sample(comfy, patched), reference)
    engine = patched.offload_engine
    streamed = sorted(engine.runner.report().streamed)
    first = block_weights(patched, streamed)
    assert all(state.in_place and state.host.numel() == 0 for state in engine.runner.host.blocks.values())
    assert torch.equal(sample(comfy, patched), reference)
    assert patched.offload_engine is not engine  # a new engine, on the same memory
    assert block_weights(patched, streamed) == first
    comfy.mm.unload_all_models()
    assert patched.offload_engine is None and comfy.pinned.PINNED_MEMORY.used == 0
    assert block_weights(patched, streamed) == first
    assert torch.equal(sample(comfy, model), reference)
    comfy.mm.unload_all_models()


def test_the_resident_part_stays_loaded_across_prompts(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next prompt's clone finds the resident blocks as the last engine left them: ComfyUI loads none of
    them again (no weight goes host to device), and the result is the same. A plain clone loading the same
    weights in between changes ComfyUI's books, and the next streaming load starts from the host again."""
    model = wan(comfy)
    reference = sample(comfy, model)
    patched = async_offload(comfy, model, resident=2)
    loaded: list[tuple[str, int]] = []
    load_weight = type(patched).patch_weight_to_device

    def counting(self, key: str, *args, **kwargs):
        loaded.append((key, comfy.utils.get_attr(self.model, key).nbytes))
        return load_weight(self, key, *args, **kwargs)

    monkeypatch.setattr(type(patched), "patch_weight_to_device", counting)
    assert torch.equal(sample(comfy, patched), reference)
    first = sum(nbytes for key, nbytes in loaded if ".blocks." in key)
    # The two resident blocks, once (ComfyUI leaves a block's own parameter, Wan's modulation, to its forward).
    assert 0.99 * patched.offload_engine.plan.resident_bytes < first <= patched.offload_engine.plan.resident_bytes
    books = patched.loaded_size()
    loaded.clear()
    assert torch.equal(sample(comfy, patched), reference)
    assert loaded == [], "the second prompt loaded weights again"
    assert patched.loaded_size() == books

    assert torch.equal(sample(comfy, model), reference)  # a plain clone of the same weights loads them its way
    loaded.clear()
    assert torch.equal(sample(comfy, patched), reference)
    assert sum(nbytes for key, nbytes in loaded if ".blocks." in key) == first
    comfy.mm.unload_all_models()


def test_lora_plain_lora_across_prompts_on_the_same_weights(comfy: SimpleNamespace) -> None:
    """A LoRA'd block's weights change between prompts: it is packed again, never adopted stale."""
    model = wan(comfy)
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))
    plain_reference = sample(comfy, model)
    lora_reference = sample(comfy, comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0])
    assert not torch.equal(plain_reference, lora_reference)
    offloaded = async_offload(comfy, model, resident=1)
    with_lora = comfy.sd.load_lora_for_models(offloaded, None, lora, 1.0, 0)[0]
    for expected, patched in [(lora_reference, with_lora), (plain_reference, offloaded)] * 2:
        assert torch.equal(sample(comfy, patched), expected)
    plain = host_buffers(offloaded)
    assert torch.equal(sample(comfy, offloaded), plain_reference)
    assert host_buffers(offloaded) == plain  # plain after plain: adopted
    comfy.mm.unload_all_models()
    assert comfy.pinned.PINNED_MEMORY.used == 0
    assert torch.equal(sample(comfy, model), plain_reference)
    comfy.mm.unload_all_models()


def test_comfyui_unloading_a_parked_model_counts_only_what_it_loaded(comfy: SimpleNamespace) -> None:
    """Between prompts ComfyUI may partially unload the model (to make room for the VAE, say) while its
    streamed blocks are parked on the host: it must neither move nor count them, since it never loaded them."""
    patched = async_offload(comfy, wan(comfy), resident=1)
    sample(comfy, patched)
    loaded = patched.model.model_loaded_weight_memory
    assert 0 < loaded < patched.model_size()
    patched.detach(unpatch_all=False)  # load_models_gpu's hand-over to the next prompt's clone: it parks
    freed = patched.partially_unload(patched.offload_device, memory_to_free=patched.model_size())
    assert (freed, patched.model.model_loaded_weight_memory) == (loaded, 0)
    comfy.mm.unload_all_models()


def test_another_clone_detached_or_deleted_while_one_streams_does_not_stop_it(comfy: SimpleNamespace) -> None:
    """ComfyUI 0.33 and 0.3.75 detach a patcher as it is deleted (``ModelPatcher.__del__``), which the cycle
    collector may do at any time. Only the clone whose load started the engine hands the weights over."""
    model = wan(comfy)
    reference = sample(comfy, model)
    offloaded = async_offload(comfy, model, resident=1)
    clone = offloaded.clone()  # what a node after ours makes (model options, a sampler patch)
    assert torch.equal(sample(comfy, clone), reference)
    engine = clone.offload_engine
    assert engine is not None
    offloaded.detach(unpatch_all=False)
    del offloaded
    gc.collect()
    assert clone.offload_engine is engine and engine.runner.enabled, "a clone that was not loaded stopped the engine"
    assert comfy.patcher.state_of(model.model).parked_load is None
    assert torch.equal(sample(comfy, clone), reference)
    comfy.mm.unload_all_models()


def test_a_node_sampling_without_its_engine_says_so(comfy: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    """If ComfyUI ever loads a node's MODEL without the pack's placement (here: the books left as the old
    hand-over bug left them, the plain model's full load taken for the parked one), the run is still the
    model's, and the log and the panel say that it did not stream."""
    model = wan(comfy)
    offloaded = async_offload(comfy, model, resident=1)
    reference = sample(comfy, offloaded)
    assert torch.equal(sample(comfy, model), reference)
    state = comfy.patcher.state_of(model.model)
    state.parked_load = offloaded.loaded_state()  # what the plain clone's detach used to record
    with caplog.at_level("WARNING"):
        assert torch.equal(sample(comfy, offloaded), reference)
    assert offloaded.offload_engine is None
    (warning,) = [r.message for r in caplog.records if "sampling without streaming" in r.message]
    assert warning.startswith("Block Offload (Async Block Offload): ")
    notices = comfy.panel.snapshot()["notices"]
    assert len(notices) == 1 and "sampling without streaming" in notices[0]
    comfy.mm.unload_all_models()
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert torch.equal(sample(comfy, offloaded), reference)  # unloaded: the next prompt streams again
    assert offloaded.offload_engine is not None
    assert not [r for r in caplog.records if "sampling without streaming" in r.message]
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("node", ["async", "partial", "sequential"])
def test_lora_changes_and_branches_write_no_host_byte(
    comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, node: str
) -> None:
    """The streamed blocks' host buffers hold the weights as ComfyUI loaded them and the patches are applied on
    the device: a strength change, a LoRA removed or added, a LoRA before the node and one after it all adopt
    the same buffers, and each result is ComfyUI's fully loaded one with the same patches, bit for bit."""
    model = wan(comfy)
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))

    def with_lora(patcher, strength: float):
        return comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)[0]

    references = {strength: sample(comfy, with_lora(model, strength)) for strength in (1.0, 0.5)}
    references[0.0] = sample(comfy, model)
    comfy.mm.unload_all_models()

    streaming = offloaded(comfy, node, model)
    first = with_lora(streaming, 1.0)
    assert torch.equal(sample(comfy, first), references[1.0])
    buffers = host_buffers(first)
    patched_weights = first.model.lowvram_patch_counter  # ComfyUI's count of per-layer patches
    assert patched_weights > 0
    packed = count_packs(monkeypatch)
    for strength, patcher in [
        (0.5, with_lora(streaming, 0.5)),  # another strength
        (0.0, streaming),  # the LoRA removed
        (1.0, with_lora(streaming, 1.0)),  # added again
        (1.0, offloaded(comfy, node, with_lora(model, 1.0))),  # before the node: another engine
        (0.5, with_lora(streaming, 0.5)),
    ]:
        assert torch.equal(sample(comfy, patcher), references[strength]), strength
        assert host_buffers(patcher) == buffers, f"strength {strength}: the blocks were packed again"
        assert patcher.model.lowvram_patch_counter == (patched_weights if strength else 0)
    assert packed == [], f"{len(packed)} blocks packed again ({sum(packed)} bytes written)"
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("node", ["async", "partial", "sequential"])
def test_lora_adapters_are_read_from_the_ring_where_they_came_with_their_block(
    comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, node: str
) -> None:
    """Every streamed weight's patch is computed from adapter copies in the device ring, staged with its
    block (packed once per set of patches), not from the LoRA's tensors in host memory; bitwise the same. Both
    ways a patch is computed are watched: in the engine's scratch (a plain LoRA, ``loaded_patch.py``) and by
    ComfyUI's ``calculate_weight`` (anything else)."""
    model = wan(comfy)
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))
    patched = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]
    reference = sample(comfy, patched)
    comfy.mm.unload_all_models()
    streaming = offloaded(comfy, node, patched)
    import comfy.lora as comfy_lora  # importable once the ``comfy`` fixture has set ComfyUI up

    from block_offload.nodes import loaded_patch

    calls: list[tuple[str, list[int]]] = []
    in_scratch: list[list[int]] = []
    calculate_weight, patch_plain_loras = comfy_lora.calculate_weight, loaded_patch.patch_plain_loras

    def spy(patches, weight, key, *args, **kwargs):
        tensors = [t for entry in patches for t in _tensors(entry)]
        calls.append((key, [t.data_ptr() for t in tensors]))
        return calculate_weight(patches, weight, key, *args, **kwargs)

    def scratch_spy(current, loras, *args):  # only ever a streamed weight, where it arrives
        in_scratch.append([tensor.data_ptr() for lora in loras for tensor in (lora.up, lora.down)])
        return patch_plain_loras(current, loras, *args)

    monkeypatch.setattr(comfy_lora, "calculate_weight", spy)
    monkeypatch.setattr(loaded_patch, "patch_plain_loras", scratch_spy)
    assert torch.equal(sample(comfy, streaming), reference)
    engine = streaming.offload_engine
    runner = engine.runner
    ring = runner.ring.memory
    inside = range(ring.data_ptr(), ring.data_ptr() + ring.numel())
    streamed = [
        (key, ptrs) for key, ptrs in calls if any(key.startswith(name + ".") for name in engine.placement.streamed)
    ] + [("in scratch", ptrs) for ptrs in in_scratch]
    assert in_scratch and runner.report().companion_bytes > 0  # the tiny Wan's LoRA is a plain one
    # ComfyUI counted the ring the adapters made larger.
    assert runner.report().device_buffer_bytes <= engine.placement.buffer_bytes, (
        runner.report().device_buffer_bytes,
        engine.placement,
    )
    assert all(ptrs and all(ptr in inside for ptr in ptrs) for _, ptrs in streamed), streamed[:3]
    comfy.mm.unload_all_models()


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return _tensors(getattr(value, "weights", ()))
