"""The nodes' ModelPatcher integration, in-process against the real ComfyUI 0.3.75.

Real loader, real ModelPatcher, real ``load_models_gpu`` and sampler, on the CPU
(BLOCK_OFFLOAD_ALLOW_CPU=1 lets the nodes stream there, through the same code).
"""

from __future__ import annotations

import importlib
import logging
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import HOST_VERSION
from safetensors.torch import load_file, save_file

from harness.inprocess import Unstreamed, async_offload, offloaded, sample, wan
from harness.private_views import load_list
from harness.prompts import ASYNC, PARTIAL, SEQUENTIAL

from block_offload.offload import GIB

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")  # the nodes stream on the CPU too


def streamed_bytes(model) -> int:
    engine = model.offload_engine
    return engine.plan.streamed_bytes


def test_accounting_counts_only_the_resident_part(comfy: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    model = wan(comfy)
    patched = async_offload(comfy, model, resident=2)
    with caplog.at_level(logging.INFO):
        comfy.mm.load_models_gpu([patched])
    plan = patched.offload_engine.plan
    listed = sum(comfy.patcher.LoadEntry.of(entry).module_mem for entry in load_list(patched))
    # ComfyUI counted exactly what its loader was offered: everything but the streamed blocks.
    assert patched.loaded_size() == listed
    assert patched.model_size() == model.model_size()  # the model's size stays true
    unlisted = (
        sum(
            t.nbytes
            for n, t in patched.model.state_dict().items()
            if not any(n.startswith(p + ".") for p in comfy.patcher.state_of(patched.model).hidden)
        )
        - listed
    )
    assert patched.loaded_size() + plan.streamed_bytes + unlisted == patched.model_size()
    # ComfyUI's own log line reports the resident part only, never a full load.
    loaded_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded ")]
    assert loaded_lines and f"{patched.loaded_size() / 2**20:.2f} MB loaded" in loaded_lines[-1]
    assert "full load: False" in loaded_lines[-1]
    plan_lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("Block Offload (Async Block Offload)")
    ]
    assert len(plan_lines) == 1 and "2/5 blocks resident (0-1, leading), 3 streamed" in plan_lines[0]
    # Where the weights come from, then what is packed in the background (the streamed blocks, 3 of 5 tiny ones).
    clauses = r"; weights from ComfyUI's classic loader; (\d+\.\d\d) GiB pinned or packed in the background while "
    packed = re.search(clauses, plan_lines[0])
    runner = patched.offload_engine.runner
    runner.finish_packing()
    assert packed and float(packed[1]) == round(runner.host.background.packed_bytes / 2**30, 2), plan_lines[0]
    assert patched.model.model_lowvram
    comfy.mm.unload_all_models()
    assert patched.offload_engine is None and patched.loaded_size() == 0


def test_offloaded_sampling_is_bitwise_identical_and_input_untouched(comfy: SimpleNamespace) -> None:
    model = wan(comfy)
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    reference = sample(comfy, model)
    for resident in (0, 2, 5):
        for prefetch in (0, 1, 2):
            patched = async_offload(comfy, model, resident, prefetch)
            assert torch.equal(sample(comfy, patched), reference), (resident, prefetch)
            engine = patched.offload_engine
            if resident == 5:
                assert engine is None  # nothing to stream: ComfyUI loads it all, no engine runs
                continue
            assert len(engine.plan.streamed) == 5 - resident
            # The recorder saw every block of the last step run through the engine's hooks.
            spans = engine.recorder.latest().spans
            assert [s.block for s in spans] == list(range(5))
            assert sum(s.bytes_copied > 0 for s in spans) <= 5 - resident
    partial = comfy.nodes.PartialGPUResidency.execute(
        model, vram_budget_gb=0.01, policy="strided", prefetch_blocks=1, pin_memory=True
    ).result[0]
    assert torch.equal(sample(comfy, partial), reference)
    sequential = comfy.nodes.SequentialOffloadWrapper.execute(
        model, storage_dtype="as loaded", vram_limit_gb=0.001, prefetch_modules=2, pin_memory=True
    ).result[0]
    assert torch.equal(sample(comfy, sequential), reference)
    # The input MODEL, used again after all of them, gives the same result and kept its weights.
    assert torch.equal(sample(comfy, model), reference)
    comfy.mm.unload_all_models()
    assert model.get_attachment(comfy.patcher.ATTACHMENT) is None and type(model).__name__ == "ModelPatcher"
    for key, value in model.model.state_dict().items():
        assert torch.equal(value, before[key]) and not value.is_pinned(), key


def test_lora_applies_to_streamed_blocks_before_or_after_the_node(comfy: SimpleNamespace) -> None:
    model = wan(comfy)
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))

    def with_lora(m):
        return comfy.sd.load_lora_for_models(m, None, lora, 1.0, 0)[0]

    reference = sample(comfy, with_lora(model))
    assert not torch.equal(reference, sample(comfy, model)), "the LoRA changes nothing; the test would prove nothing"
    lora_then_offload = async_offload(comfy, with_lora(model), resident=1)
    offload_then_lora = with_lora(async_offload(comfy, model, resident=1))
    assert type(offload_then_lora) is type(lora_then_offload)  # clone() kept the streaming class
    assert torch.equal(sample(comfy, lora_then_offload), reference)
    assert torch.equal(sample(comfy, offload_then_lora), reference)
    # Back to the plain model: the LoRA'd weights were restored, not left patched.
    plain = sample(comfy, model)
    assert torch.equal(plain, sample(comfy, wan(comfy)))
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
@pytest.mark.parametrize("loading", ["classic", "dynamic_vram"])
def test_a_model_merge_before_the_node_computes_as_comfyui(
    comfy: SimpleNamespace, request: pytest.FixtureRequest, tmp_path, unstreamed: Unstreamed, loading: str, node: str
) -> None:
    """ModelMergeSimple patches every weight with the other model's. ComfyUI's load applies those of leaf modules
    only: a weight of a module whose submodules hold weights too (Wan's blocks' and head's ``modulation``) is left
    as loaded (``ModelPatcher._load_list``). The nodes patched those too before: on this CPU the merge streamed
    gave another latent (every value differed from ComfyUI's, by up to 0.25, with each node, on both hosts), and
    packed the second model's streamed weights into host buffers of their own."""
    if loading == "dynamic_vram" and HOST_VERSION.startswith("0.3."):
        pytest.skip(f"ComfyUI {HOST_VERSION} has no Dynamic VRAM")
    merge = importlib.import_module("comfy_extras.nodes_model_merging").ModelMergeSimple().merge
    other = tmp_path / "other_wan.safetensors"
    save_file({key: weight * 1.25 for key, weight in load_file(comfy.models["wan21"]).items()}, str(other))
    if loading == "classic":
        first, second = wan(comfy), comfy.sd.load_diffusion_model(str(other))
        load_references = lambda: (first, second)  # noqa: E731
    else:
        dynamic_vram = request.getfixturevalue("dynamic_vram")
        first, second = (dynamic_vram.load(path, torch.float32) for path in (comfy.models["wan21"], other))
        load_references = lambda: tuple(  # noqa: E731
            dynamic_vram.load_classic(path, torch.float32) for path in (comfy.models["wan21"], other)
        )

    def unmerged_and_merged() -> tuple[torch.Tensor, torch.Tensor]:
        references = load_references()
        return sample(comfy, references[0]), sample(comfy, merge(*references, 0.5)[0])

    plain, reference = unstreamed.once(("merge", loading), unmerged_and_merged)
    comfy.mm.unload_all_models()
    assert not torch.equal(reference, plain), "the merge changes nothing: the test would prove nothing"
    streaming = offloaded(comfy, node, merge(first, second, 0.5)[0])
    assert torch.equal(sample(comfy, streaming), reference)
    runner = streaming.offload_engine.runner
    assert runner.report().streamed
    # The second model's weights, the merge's adapters, are copied from where they lie: no second copy of them
    # (before: a host buffer as large as the streamed blocks).
    assert runner.report().companion_bytes == 0
    comfy.mm.unload_all_models()
    assert torch.equal(sample(comfy, first), plain), "the input MODEL changed"
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
@pytest.mark.parametrize("loading", ["classic", "dynamic_vram"])
def test_a_compute_dtype_set_on_the_model_computes_as_comfyui(
    comfy: SimpleNamespace, request: pytest.FixtureRequest, unstreamed: Unstreamed, loading: str, node: str
) -> None:
    """ModelComputeDtype (fp16 here, on fp32 weights) makes ComfyUI's load force every layer it loads to cast its
    weights to that dtype. The layers the node streams are hidden from that load: before, they computed with their
    fp32 weights against fp16 inputs and every node raised "mat1 and mat2 must have the same dtype, but got Half
    and Float", before or after the node, on both hosts."""
    if loading == "dynamic_vram" and HOST_VERSION.startswith("0.3."):
        pytest.skip(f"ComfyUI {HOST_VERSION} has no Dynamic VRAM")
    compute_dtype = importlib.import_module("comfy_extras.nodes_model_advanced").ModelComputeDtype().patch
    if loading == "classic":
        load, load_reference = (lambda: wan(comfy)), (lambda: wan(comfy))
    else:
        dynamic_vram = request.getfixturevalue("dynamic_vram")
        path = comfy.models["wan21"]
        load = lambda: dynamic_vram.load(path, torch.float32)  # noqa: E731
        load_reference = lambda: dynamic_vram.load_classic(path, torch.float32)  # noqa: E731
    # Each on a model of its own: ComfyUI leaves the forced casts on a model it loaded with them.
    reference = unstreamed.once(("fp16", loading), lambda: sample(comfy, compute_dtype(load_reference(), "fp16")[0]))
    plain = unstreamed.once(("plain", loading), lambda: sample(comfy, load_reference()))
    comfy.mm.unload_all_models()
    assert not torch.equal(reference, plain), "the compute dtype changes nothing: the test would prove nothing"
    before = offloaded(comfy, node, compute_dtype(load(), "fp16")[0])
    after = compute_dtype(offloaded(comfy, node, load()), "fp16")[0]
    for streaming in (before, after):
        assert torch.equal(sample(comfy, streaming), reference)
        assert streaming.offload_engine.runner.report().streamed
        comfy.mm.unload_all_models()


def flags_by_keyword(base: type) -> type:
    """A patcher class below the node's that forwards ``*args`` with its flags keyword-only, as ComfyUI-GGUF's
    ``GGUFModelPatcher`` does since 2026 (its ``partially_load`` and ``partially_unload`` force
    ``force_patch_weights``): a flag the node passed on by position would reach ComfyUI's method twice. Only
    flags ComfyUI itself passes by keyword can be keyword-only (it calls ``detach(unpatch_all)`` by position)."""

    class FlagsByKeyword(base):
        def partially_load(self, *args, force_patch_weights=False, **kwargs):
            return super().partially_load(*args, force_patch_weights=force_patch_weights, **kwargs)

        def partially_unload(self, *args, force_patch_weights=False, **kwargs):
            return super().partially_unload(*args, force_patch_weights=force_patch_weights, **kwargs)

        def unpatch_model(self, *args, unpatch_weights=True, **kwargs):
            return super().unpatch_model(*args, unpatch_weights=unpatch_weights, **kwargs)

        def patch_weight_to_device(self, key, *args, device_to=None, inplace_update=False, **kwargs):
            flags = {"device_to": device_to, "inplace_update": inplace_update}
            return super().patch_weight_to_device(key, *args, **flags, **kwargs)

    return FlagsByKeyword


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_a_patcher_class_that_takes_its_flags_by_keyword_streams(comfy: SimpleNamespace, node: str) -> None:
    model = wan(comfy).clone()
    model.__class__ = flags_by_keyword(type(model))  # as a loader's own patcher class is set (GGUF's clone)
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))
    with_lora = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]
    reference = sample(comfy, with_lora)
    comfy.mm.unload_all_models()
    streamed = offloaded(comfy, node, with_lora)
    for _ in range(2):  # a first load, then a load after ComfyUI's unload
        assert torch.equal(sample(comfy, streamed), reference)
        engine = streamed.offload_engine
        assert engine is not None and engine.runner.report().streamed, "the node did not stream"
        assert isinstance(streamed, type(model))
        comfy.mm.unload_all_models()
        assert streamed.offload_engine is None and streamed.loaded_size() == 0


def test_chained_nodes_last_one_wins(comfy: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    model = wan(comfy)
    reference = sample(comfy, model)
    first = async_offload(comfy, model, resident=4)
    with caplog.at_level(logging.INFO):
        second = async_offload(comfy, first, resident=1)
    assert any("replaces the earlier Async Block Offload" in r.getMessage() for r in caplog.records)
    assert torch.equal(sample(comfy, second), reference)
    assert len(second.offload_engine.plan.resident) == 1
    assert first.offload_request.resident_blocks == 4  # the first node's output is untouched
    comfy.mm.unload_all_models()


def test_a_load_walks_the_module_tree_once_for_blocks_and_once_for_comfyui_s_loader(
    comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The placement (budget, patch costs, summary) and the engine's start share one search of the model's module
    tree per load: each search weighs every weight, about 16 ms for a Wan 2.1 of 40 blocks on this CPU. The
    placement's loader need, the count of what ComfyUI is offered and ComfyUI's own load share one walk of
    ComfyUI's module list (``ModelPatcher._load_list``, 21 ms for a Wan 2.1 14B's 900 modules on this CPU; three
    walks before): 0.33 loads the model again at every sampler (it detaches a loaded model first)."""
    blocks = importlib.import_module("block_offload.nodes.blocks")
    model_patcher = importlib.import_module("comfy.model_patcher")
    searched: list[torch.nn.Module] = []
    walked: list[object] = []
    discover = blocks.discover
    walk = model_patcher.ModelPatcher._load_list

    def counted(root: torch.nn.Module):
        searched.append(root)
        return discover(root)

    def walk_counted(self, *args, **kwargs):
        walked.append(self)
        return walk(self, *args, **kwargs)

    monkeypatch.setattr(blocks, "discover", counted)
    monkeypatch.setattr(model_patcher.ModelPatcher, "_load_list", walk_counted)
    model = wan(comfy)
    reference = sample(comfy, model)
    patched = comfy.nodes.PartialGPUResidency.execute(
        model, vram_budget_gb=0.0005, policy="auto", prefetch_blocks=1, pin_memory=True
    ).result[0]
    for _ in range(2):  # the first load, then the same patcher's again (0.33 detaches a loaded model first)
        searched.clear()
        walked.clear()
        comfy.mm.load_models_gpu([patched])
        assert searched == [patched.model.diffusion_model]
        assert walked == [patched]
        assert patched.offload_engine is not None and patched.offload_engine.plan.streamed
    assert torch.equal(sample(comfy, patched), reference)
    comfy.mm.unload_all_models()


def test_inside_is_a_name_or_a_dotted_path_under_it(comfy: SimpleNamespace) -> None:
    inside = importlib.import_module("block_offload.nodes.blocks").inside
    blocks = frozenset({"diffusion_model.blocks.1", "diffusion_model.head"})
    assert inside("diffusion_model.blocks.1", blocks)
    assert inside("diffusion_model.blocks.1.ffn.0.weight", blocks)
    assert inside("diffusion_model.head.head.bias", blocks)
    assert not inside("diffusion_model.blocks.10.ffn.0.weight", blocks)  # a prefix, not at a dot
    assert not inside("diffusion_model.blocks", blocks)  # above one
    assert not inside("diffusion_model.blocks.1", frozenset())
    assert inside("x.y", frozenset({"x"})) and not inside("xy", frozenset({"x"}))


def test_bad_inputs_say_what_to_do(comfy: SimpleNamespace) -> None:
    model = wan(comfy)
    with pytest.raises(ValueError, match="resident_blocks is 9 but this model has 5 blocks; use 0 to 5"):
        async_offload(comfy, model, resident=9)


def test_cpu_without_opt_in_passes_the_model_through(
    comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("BLOCK_OFFLOAD_ALLOW_CPU")
    model = wan(comfy)
    with caplog.at_level(logging.WARNING):
        out = async_offload(comfy, model)
    assert out is model
    assert any("no GPU memory to save" in r.getMessage() for r in caplog.records)


def test_the_sequential_wrappers_buffers_are_in_comfyuis_books(comfy: SimpleNamespace) -> None:
    """ComfyUI counts the wrapper's slot pool as offload buffer memory, as it counts its own cast buffers,
    and the pool is what the engine really allocates."""
    model = wan(comfy)
    wrapped = comfy.nodes.SequentialOffloadWrapper.execute(
        model, storage_dtype="bf16", vram_limit_gb=0.0, prefetch_modules=2, pin_memory=True
    ).result[0]
    comfy.mm.load_models_gpu([wrapped])
    pool = wrapped.offload_engine.runner.report().device_buffer_bytes
    assert pool > 0 and wrapped.model.model_offload_buffer_memory == pool
    sample(comfy, wrapped)
    assert wrapped.offload_engine.runner.report().device_buffer_bytes == pool
    comfy.mm.unload_all_models()
    assert wrapped.model.model_offload_buffer_memory == 0


def test_weights_comfyui_pinned_are_unpinned_through_comfyui_before_packing(comfy: SimpleNamespace) -> None:
    """ComfyUI's partial unload registers the weights it moves to the host (``pin_weight_to_device``); when a
    later placement streams their block, ComfyUI must unpin them itself before the engine packs (frees) them.
    On the CPU ComfyUI pins nothing, so its set is seeded as its partial unload would leave it."""
    model = async_offload(comfy, wan(comfy), resident=1)
    streamed_key = "diffusion_model.blocks.3.ffn.0.weight"  # ComfyUI's loader never sees streamed blocks
    model.pinned.add(streamed_key)
    comfy.mm.load_models_gpu([model])
    assert any(streamed_key.startswith(block + ".") for block in model.offload_engine.placement.streamed)
    assert streamed_key not in model.pinned, "a streamed weight is still registered with ComfyUI"
    comfy.mm.unload_all_models()


def test_comfyui_loads_exactly_the_planned_resident_part_within_a_tight_budget(comfy: SimpleNamespace) -> None:
    """ComfyUI's loader keeps a module only while (offload streams + 1) x its cast size still fits after it;
    the plan leaves that room, so every module ComfyUI is offered gets loaded, none falls to its per-layer
    cast. A fixed placement that cannot fit says so (log and panel notice) instead of silently slowing."""
    model = wan(comfy)
    sizing = async_offload(comfy, model, resident=0)
    comfy.mm.load_models_gpu([sizing])
    block, slots = sizing.offload_engine.plan.block_bytes[0], sizing.offload_engine.plan.slot_bytes
    outside = sizing.model_size() - sum(sizing.offload_engine.plan.block_bytes)
    comfy.mm.unload_all_models()
    tight = outside + 2 * block + slots + 1  # two resident blocks fit, with no room for ComfyUI's lookahead

    partial = comfy.nodes.PartialGPUResidency.execute(
        model, vram_budget_gb=0.0, policy="leading", prefetch_blocks=1, pin_memory=True
    ).result[0]
    partial.partially_load(torch.device("cpu"), tight)
    offered = sum(comfy.patcher.LoadEntry.of(entry).module_mem for entry in load_list(partial))
    assert partial.loaded_size() == offered and not partial.offload_engine.notices
    assert len(partial.offload_engine.plan.resident) < 2  # the headroom cost a resident block
    comfy.mm.unload_all_models()
    partial.detach()

    forced = async_offload(comfy, model, resident=4)
    forced.partially_load(torch.device("cpu"), tight)
    assert forced.loaded_size() < sum(comfy.patcher.LoadEntry.of(entry).module_mem for entry in load_list(forced))
    (notice,) = forced.offload_engine.notices
    assert "planned resident; the rest is cast per layer by ComfyUI" in notice
    forced.detach()


def partial_residency(comfy: SimpleNamespace, model, budget_gb: float):
    return comfy.nodes.PartialGPUResidency.execute(
        model, vram_budget_gb=budget_gb, policy="leading", prefetch_blocks=1, pin_memory=True
    ).result[0]


def test_a_budget_below_every_block_streamed_says_what_the_device_holds_and_what_to_do(comfy: SimpleNamespace) -> None:
    """A budget that cannot hold even the stream buffers still streams every block (the buffers are allocated all
    the same), and the plan line says by how much: the device memory it takes, rounded up, which as the budget
    holds it; the same for a budget ComfyUI grants, where ComfyUI's loader then casts per layer what is outside
    the blocks and the notice points at the plan line, not at resident blocks there are none of."""
    model = wan(comfy)
    cpu = torch.device("cpu")
    small = partial_residency(comfy, model, 0.001)
    comfy.mm.load_models_gpu([small])
    engine = small.offload_engine
    assert not engine.plan.resident and engine.placement.over_budget
    found = re.search(r"; over the budget of 0\.00 GiB: every block streamed, the device holds ([\d.]+) GiB \(the "
                      r"stream buffers, and what ComfyUI loads outside the blocks\); give at least ([\d.]+) GiB, lower "
                      r"prefetch_blocks, or stream module by module", engine.placement.summary)  # fmt: skip
    assert found is not None, engine.placement.summary
    held, least = float(found[1]), float(found[2])
    outside = small.model_size() - sum(engine.plan.block_bytes)
    assert held == least and engine.placement.buffer_bytes + outside <= held * GIB
    offered = sum(comfy.patcher.LoadEntry.of(entry).module_mem for entry in load_list(small))
    assert (
        small.loaded_size() == offered and not engine.notices
    )  # the CPU's full load: ComfyUI loaded all it was offered
    comfy.mm.unload_all_models()

    enough = partial_residency(comfy, model, least)
    comfy.mm.load_models_gpu([enough])
    assert not enough.offload_engine.placement.over_budget, enough.offload_engine.placement.summary
    assert "over the budget" not in enough.offload_engine.placement.summary
    comfy.mm.unload_all_models()
    enough.detach()

    granted = partial_residency(comfy, model, 0.0)  # automatic: what ComfyUI grants
    granted.partially_load(cpu, engine.placement.buffer_bytes // 2)
    summary = granted.offload_engine.placement.summary
    assert "; over what ComfyUI grants this model of " in summary and "free device memory" in summary, summary
    (notice,) = granted.offload_engine.notices
    assert notice.startswith("ComfyUI loaded 0.00 of the ") and notice.endswith(
        "Streaming needs more device memory than the budget (see the plan line)."
    ), notice
    assert torch.equal(sample(comfy, granted), sample(comfy, model))
    granted.detach()


def test_the_sequential_wrapper_streams_every_module_with_and_without_a_lora(comfy: SimpleNamespace) -> None:
    """The wrapper needs no block list: it streams every module, bitwise, with and without a LoRA (as the block
    nodes stream a model without block lists: ``test_every_dit.py``)."""
    model = wan(comfy)
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))
    with_lora = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]
    references = [sample(comfy, model), sample(comfy, with_lora)]
    comfy.mm.unload_all_models()
    wrapped = comfy.nodes.SequentialOffloadWrapper.execute(
        model, storage_dtype="as loaded", vram_limit_gb=0.0, prefetch_modules=1, pin_memory=True
    ).result[0]
    patchers = [wrapped, comfy.sd.load_lora_for_models(wrapped, None, lora, 1.0, 0)[0]]
    for patcher, reference in zip(patchers, references, strict=True):
        assert torch.equal(sample(comfy, patcher), reference)
        assert patcher.offload_engine is not None and patcher.offload_engine.runner.report().streamed
    comfy.mm.unload_all_models()


def test_a_patch_that_resizes_a_streamed_weight_is_refused_before_anything_loads(comfy: SimpleNamespace) -> None:
    """A "diff" patch that pads a weight (``pad_weight``: how ComfyUI resizes a layer) on a block the node streams
    would compute with the stored shape: the load refuses it with what to do, nothing moved, and the MODEL
    still samples as before."""
    model = wan(comfy)
    reference = sample(comfy, model)
    key = "diffusion_model.blocks.1.ffn.0.weight"
    weight = comfy.utils.get_attr(model.model, key)
    wider = torch.zeros(weight.shape[0] + 32, weight.shape[1])
    patched = model.clone()
    patched.add_patches({key: ("diff", (wider, {"pad_weight": True}))}, 1.0)
    streaming = async_offload(comfy, patched, resident=0)
    with pytest.raises(
        ValueError, match=r"changes the shape of diffusion_model\.blocks\.1\.ffn\.0\.weight .*without the node"
    ):
        sample(comfy, streaming)
    assert streaming.offload_engine is None and comfy.utils.get_attr(model.model, key) is weight
    comfy.mm.unload_all_models()
    assert torch.equal(sample(comfy, model), reference)


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_a_patch_on_a_weight_stored_as_packed_integers_is_refused_before_anything_loads(
    comfy: SimpleNamespace, node: str
) -> None:
    """A layer that stores its weight as packed integers and applies its patches itself (ComfyUI-GGUF's
    Q4_CR_W4A4, 2026: int8 of half the input width) would be given its LoRA through a weight function, which
    reads the packed bytes as the weight (a shape error at the first step). The load refuses it, saying what to
    do, before anything moves."""
    model = wan(comfy)
    key = "diffusion_model.blocks.1.ffn.0.weight"
    layer = comfy.utils.get_attr(model.model, key.rpartition(".")[0])
    rows, columns = layer.weight.shape
    layer.weight = torch.nn.Parameter(torch.zeros(rows, columns // 2, dtype=torch.int8), requires_grad=False)
    packed = layer.weight
    patched = model.clone()
    patched.add_patches({key: ("diff", (torch.zeros(rows, columns),))}, 1.0)
    streaming = offloaded(comfy, node, patched)
    with pytest.raises(ValueError, match=rf"reaches {re.escape(key)}, .* packed as torch\.int8 .*without the node"):
        comfy.mm.load_models_gpu([streaming])
    assert streaming.offload_engine is None and streaming.loaded_size() == 0
    assert comfy.utils.get_attr(model.model, key) is packed
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_a_patch_resizing_a_weight_comfyui_never_patches_is_ignored_as_comfyui_ignores_it(
    comfy: SimpleNamespace, node: str
) -> None:
    """The same patch on a weight of a module whose submodules hold weights too (a Wan block's ``modulation``),
    which ComfyUI's load never patches: ComfyUI samples as without it, and so does every node. It was refused."""
    model = wan(comfy)
    key = "diffusion_model.blocks.1.modulation"
    weight = comfy.utils.get_attr(model.model, key)
    patched = model.clone()
    patched.add_patches({key: ("diff", (torch.ones(*weight.shape[:-1], weight.shape[-1] + 8), {"pad_weight": True}))})
    reference = sample(comfy, patched)
    comfy.mm.unload_all_models()
    assert torch.equal(reference, sample(comfy, model)), "ComfyUI applied the patch: the test would prove nothing"
    comfy.mm.unload_all_models()
    streaming = offloaded(comfy, node, patched)
    assert torch.equal(sample(comfy, streaming), reference)
    assert streaming.offload_engine.runner.report().streamed
    comfy.mm.unload_all_models()


def sample_with_a_hook_lora(comfy: SimpleNamespace, model, lora: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """``sample``'s run with ``lora`` as a hook (Create Hook LoRA) on the positive prompt only, at cfg 2: ComfyUI
    writes the hook's weights in before each positive call and takes them out before each negative one."""
    hooks = importlib.import_module("comfy.hooks")
    diffusion_model = model.model.diffusion_model
    generator = torch.Generator().manual_seed(1)
    width = diffusion_model.text_embedding[0].in_features
    positive, negative = ([[torch.randn(1, 7, width, generator=generator), {}]] for _ in range(2))
    if lora is not None:
        positive = hooks.set_hooks_for_conditioning(positive, hooks.create_hook_lora(lora, 1.0, 1.0))
    latent = torch.zeros(1, 16, 1, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(5))
    return comfy.sample.sample(
        model, noise, 2, 2.0, "euler", "normal", positive, negative, latent, seed=5, disable_pbar=True
    )


HOOK_REFUSED = r"hook LoRA .* patches \d+ weights of blocks this node streams .*Load LoRA \(LoraLoaderModelOnly\)"


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
@pytest.mark.parametrize("loading", ["classic", "dynamic_vram"])
def test_a_hook_lora_on_streamed_blocks_is_refused_before_it_samples(
    comfy: SimpleNamespace, request: pytest.FixtureRequest, loading: str, node: str
) -> None:
    """A hook LoRA is written into the weights between model calls (here: in for the positive prompt, out for the
    negative), which streamed blocks do not follow. Before this refusal, streamed, the classic model computed
    another latent (Async Block Offload and Partial GPU Residency on this CPU: all 1024 values differed, by up to
    6.7), and on a Dynamic VRAM twin ComfyUI's write into the checkpoint's read-only mapping killed the process.
    Refused with what to do, before a step, whether the sampling loads the model or finds it loaded with its
    engine; the streaming MODEL then samples without hooks as before, and the input MODEL with them as ComfyUI
    computes them."""
    if loading == "dynamic_vram" and HOST_VERSION.startswith("0.3."):
        pytest.skip(f"ComfyUI {HOST_VERSION} has no Dynamic VRAM")
    lora = load_file(comfy.models["wan21_lora"])
    if loading == "classic":
        model = reference = wan(comfy)
    else:
        dynamic_vram = request.getfixturevalue("dynamic_vram")
        model = dynamic_vram.load(comfy.models["wan21"], torch.float32)
        reference = dynamic_vram.load_classic(comfy.models["wan21"], torch.float32)
    plain, hooked = (sample_with_a_hook_lora(comfy, reference, hook) for hook in (None, lora))
    comfy.mm.unload_all_models()
    assert not torch.equal(plain, hooked), "the hook LoRA changes nothing: the refusal would prove nothing"

    streaming = offloaded(comfy, node, model)
    for attempt in ("first", "after a run that streamed"):
        # Registering the hook re-rolls the MODEL's patches, so ComfyUI loads it again: refused in that load.
        with pytest.raises(ValueError, match=HOOK_REFUSED):
            sample_with_a_hook_lora(comfy, streaming, lora)
        assert streaming.offload_engine is None, f"{attempt}: refused before anything was placed"
        assert torch.equal(sample_with_a_hook_lora(comfy, streaming, None), plain), attempt
        engine = streaming.offload_engine
        assert engine is not None and engine.runner.report().streamed, f"{attempt}: it streamed"
    # Hooks registered on the MODEL as ComfyUI loaded it, its engine running: refused before the first step.
    hooks = importlib.import_module("comfy.hooks")
    streaming.register_all_hook_patches(
        hooks.create_hook_lora(lora, 1.0, 1.0), hooks.create_target_dict(hooks.EnumWeightTarget.Model), {}
    )
    with pytest.raises(ValueError, match=HOOK_REFUSED) as refused:
        streaming.pre_run()
    assert "apply_to_conds" not in str(refused.value)
    streaming.restore_hook_patches()
    # A hook of model strength 0 (meant for the text encoder) is written into the weights all the same: refused,
    # saying how to keep it on the text encoder.
    streaming.register_all_hook_patches(
        hooks.create_hook_lora(lora, 0.0, 1.0), hooks.create_target_dict(hooks.EnumWeightTarget.Model), {}
    )
    with pytest.raises(ValueError, match=HOOK_REFUSED + r".*model strength is 0.*apply_to_conds to false"):
        streaming.pre_run()
    streaming.restore_hook_patches()
    assert streaming.offload_engine is engine and torch.equal(sample_with_a_hook_lora(comfy, streaming, None), plain)
    comfy.mm.unload_all_models()
    if loading == "classic":
        assert torch.equal(sample_with_a_hook_lora(comfy, model, lora), hooked), "the input MODEL with its hook"
