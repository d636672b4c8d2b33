"""The patcher's load and unload protocol (``nodes/patcher.py``), one test per sequence of ComfyUI calls.

Each test drives a real ComfyUI ModelPatcher through the node, in-process on the CPU, as ComfyUI's prompts do
(``load_models_gpu``, the sampler, ``/free``), and reads back the calls ComfyUI made on the node's patchers, each
with the phase the model was left in: which ComfyUI call moves the weights where. Then what that phase means
for real: the engine running or stopped, the streamed blocks on the buffers they were parked on or freed,
nothing packed again, ComfyUI's ``model_loaded_weight_memory``, and every sampled result bit for bit the fully
resident model's.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import logging
import weakref
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from harness.device_limit import limited
from harness.inprocess import async_offload, count_packs, sample, wan
from harness.private_views import load_list

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")  # the nodes stream on the CPU too

# A call as read back: (the test's name for the patcher, the call, the model's phase as the call returned).
Call = tuple[str, str, str]
RECORDED = ("partially_load", "unpatch_model", "detach", "pre_run", "cleanup")
# ComfyUI's partially_load, for a clone carrying the patches the weights hold: its first unpatch leaves the
# weights (unpatch_weights=False), the pack's placement follows.
FIRST_UNPATCH = "unpatch_model(unpatch_weights=False)"
UNPATCH_WEIGHTS = "unpatch_model(unpatch_weights=True)"
HAND_OVER = "detach(unpatch_all=False)"


class ComfyCalls:
    """The calls ComfyUI makes on the patchers a test has named, each with the model's phase as it returned."""

    def __init__(self, comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
        self.comfy = comfy
        self.names: dict[int, str] = {}
        self.seen: list[Call] = []
        for method in RECORDED:
            self._record(monkeypatch, method)

    def named(self, patcher, name: str):
        self.names[patcher.patcher_id] = name
        return patcher

    def phase(self, patcher) -> str:
        return self.comfy.patcher.state_of(patcher.model).phase.name

    def take(self) -> list[Call]:
        """The calls since the last ``take``."""
        seen, self.seen = self.seen, []
        return seen

    def _record(self, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
        patcher_class = self.comfy.patcher.BlockOffloadPatcher
        original = getattr(patcher_class, method)
        signature = inspect.signature(original)

        def recorded(patcher, *args, **kwargs):
            try:
                return original(patcher, *args, **kwargs)
            finally:
                name = self.names.get(patcher.patcher_id)
                if name is not None:
                    label = self._label(signature, method, patcher, args, kwargs)
                    self.seen.append((name, label, self.phase(patcher)))

        monkeypatch.setattr(patcher_class, method, recorded)

    @staticmethod
    def _label(signature: inspect.Signature, method: str, patcher, args: tuple, kwargs: dict) -> str:
        bound = signature.bind(patcher, *args, **kwargs)
        bound.apply_defaults()
        flag = {"unpatch_model": "unpatch_weights", "detach": "unpatch_all"}.get(method)
        return f"{method}({flag}={bound.arguments[flag]})" if flag else method


@pytest.fixture
def calls(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[ComfyCalls]:
    recorder = ComfyCalls(comfy, monkeypatch)
    yield recorder
    comfy.mm.unload_all_models()  # a failed test leaves nothing loaded for the next


@pytest.fixture(scope="module")
def references(comfy: SimpleNamespace) -> dict[str, torch.Tensor]:
    """What the fully resident model samples, plain and with the LoRA, on a model of its own."""
    model = wan(comfy)
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))
    results = {
        "plain": sample(comfy, model),
        "lora": sample(comfy, comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]),
    }
    comfy.mm.unload_all_models()
    assert not torch.equal(results["plain"], results["lora"]), "the LoRA changes nothing; the tests would prove less"
    return results


def streaming_load(calls: ComfyCalls, name: str = "node"):
    """The node's MODEL (1 resident block of 5, 4 streamed) on a freshly loaded model, named ``name``."""
    return calls.named(async_offload(calls.comfy, wan(calls.comfy), resident=1), name)


def resident_part(comfy: SimpleNamespace, patcher) -> int:
    """What ComfyUI's loader was offered, the streamed blocks hidden: all it may count as loaded."""
    return sum(comfy.patcher.LoadEntry.of(entry).module_mem for entry in load_list(patcher))


def count_loads(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, each weight ComfyUI's loader loads (``patch_weight_to_device``, called for every weight of
    every module it loads): empty while the resident part stays loaded."""
    patcher_class = comfy.patcher.BlockOffloadPatcher
    load_weight = patcher_class.patch_weight_to_device
    loaded: list[str] = []

    def counting(self, key: str, *args, **kwargs):
        loaded.append(key)
        return load_weight(self, key, *args, **kwargs)

    monkeypatch.setattr(patcher_class, "patch_weight_to_device", counting)
    return loaded


def host_buffers(patcher) -> dict[int, tuple[int, ...]]:
    """Where each streamed block's weights are held on the host, once packing in the background is done (what a
    hand-over does to blocks still waiting is in ``tests/torch_only/test_background_packing.py``): the addresses
    of its host views, a host buffer's or, kept where they lie (pageable on the CPU), its own tensors'."""
    runner = patcher.offload_engine.runner
    runner.finish_packing()
    return {
        index: tuple(t.data_ptr() for t in runner.host.blocks[index].host_views) for index in runner.report().streamed
    }


def on_buffers(patcher, buffers: dict[int, tuple[int, ...]]) -> bool:
    """Whether every streamed block's weights are held where ``buffers`` says: parked there, or streaming from
    there."""
    blocks = patcher.model.diffusion_model.blocks
    return all(p.data_ptr() in held for index, held in buffers.items() for p in blocks[index].parameters())


def assert_streaming(comfy: SimpleNamespace, patcher) -> None:
    """An engine runs, no call left open, and ComfyUI counts exactly the resident part."""
    engine = patcher.offload_engine
    assert engine is not None and engine.runner.enabled and not engine.runner.calls.open
    loaded = patcher.model.model_loaded_weight_memory
    assert 0 < loaded == resident_part(comfy, patcher) < patcher.model_size()


def test_the_first_load_streams_samples_and_cleans_up(calls: ComfyCalls, references: dict[str, torch.Tensor]) -> None:
    """The first prompt: ``load_models_gpu`` (ComfyUI's partially_load: an unpatch that leaves the weights, then
    the pack's placement), the sampler's ``pre_run``, its steps, its ``cleanup``."""
    comfy = calls.comfy
    node = streaming_load(calls)
    assert calls.phase(node) == "UNPLACED"
    comfy.mm.load_models_gpu([node])
    assert calls.take() == [("node", FIRST_UNPATCH, "UNPLACED"), ("node", "partially_load", "STREAMING")]
    assert_streaming(comfy, node)
    assert torch.equal(sample(comfy, node), references["plain"])
    assert calls.take() == [
        ("node", HAND_OVER, "HANDED_OVER"),  # load_models_gpu hands a loaded model over to itself, too
        ("node", FIRST_UNPATCH, "PARKED"),
        ("node", "partially_load", "STREAMING"),
        ("node", "pre_run", "STREAMING"),
        ("node", "cleanup", "STREAMING"),
    ]
    assert_streaming(comfy, node)
    assert node.offload_engine.recorder.latest() is not None  # the steps ran through the engine


def test_the_next_prompts_clone_adopts_the_blocks_handed_over(
    calls: ComfyCalls, references: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next prompt loads a new clone of the same weights: ``load_models_gpu`` detaches the clone it had
    loaded without unpatching (the hand-over: its engine parks), then loads the new one, whose engine adopts the
    parked blocks. Nothing is packed again, and the resident part stays loaded."""
    comfy = calls.comfy
    first = streaming_load(calls, "first")
    assert torch.equal(sample(comfy, first), references["plain"])
    buffers, loaded = host_buffers(first), first.model.model_loaded_weight_memory
    calls.take()
    packed, loaded_again = count_packs(monkeypatch), count_loads(comfy, monkeypatch)
    second = calls.named(first.clone(), "second")
    comfy.mm.load_models_gpu([second])
    assert calls.take() == [
        ("first", HAND_OVER, "HANDED_OVER"),
        ("second", FIRST_UNPATCH, "PARKED"),  # the hand-over taken: ComfyUI's books are the first clone's
        ("second", "partially_load", "STREAMING"),
    ]
    assert_streaming(comfy, second)
    assert host_buffers(second) == buffers and packed == []
    assert second.model.model_loaded_weight_memory == loaded and loaded_again == []
    assert torch.equal(sample(comfy, second), references["plain"])


def test_a_lora_change_between_prompts_parks_the_blocks_it_does_not_free_them(
    calls: ComfyCalls, references: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA added (then removed) between prompts: ComfyUI's partially_load first unpatches the weights, as
    their patches change. That is no unload: the streamed blocks stay parked on their host buffers (they hold
    the weights unpatched; the patches are applied on the device), and the next engine adopts them."""
    comfy = calls.comfy
    node = streaming_load(calls)
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))
    assert torch.equal(sample(comfy, node), references["plain"])
    buffers = host_buffers(node)
    calls.take()
    packed = count_packs(monkeypatch)
    with_lora = calls.named(comfy.sd.load_lora_for_models(node, None, lora, 1.0, 0)[0], "lora")
    comfy.mm.load_models_gpu([with_lora])
    assert calls.take() == [
        ("node", HAND_OVER, "HANDED_OVER"),
        ("lora", UNPATCH_WEIGHTS, "PARKED"),  # the re-patch: parked, not freed
        ("lora", "partially_load", "STREAMING"),
    ]
    assert_streaming(comfy, with_lora)
    assert host_buffers(with_lora) == buffers and packed == []
    assert torch.equal(sample(comfy, with_lora), references["lora"])
    calls.take()
    comfy.mm.load_models_gpu([node])  # the LoRA removed
    assert calls.take() == [
        ("lora", HAND_OVER, "HANDED_OVER"),
        ("node", UNPATCH_WEIGHTS, "PARKED"),
        ("node", "partially_load", "STREAMING"),
    ]
    assert host_buffers(node) == buffers and packed == []
    assert torch.equal(sample(comfy, node), references["plain"])


@pytest.mark.parametrize("handed_over", [False, True], ids=["streaming", "handed-over"])
def test_a_real_unload_leaves_nothing_pinned_or_parked(calls: ComfyCalls, handed_over: bool) -> None:
    """``/free`` (``unload_all_models``): ComfyUI detaches the model unpatching it, ``unpatch_model`` outside a
    load. The engine stops and frees its buffers, parked blocks get memory of their own, ComfyUI counts nothing
    loaded: whether the model was streaming, or its engine parked for a hand-over (``load_models_gpu``'s detach
    of the loaded clone)."""
    comfy = calls.comfy
    node = streaming_load(calls)
    comfy.mm.load_models_gpu([node])
    runner, buffers = node.offload_engine.runner, host_buffers(node)
    engine = weakref.ref(node.offload_engine)
    in_place = all(runner.host.blocks[index].in_place for index in runner.report().streamed)
    calls.take()
    if handed_over:
        node.detach(unpatch_all=False)
        assert calls.take() == [("node", HAND_OVER, "HANDED_OVER")]
        assert not runner.enabled and on_buffers(node, buffers)  # parked
    comfy.mm.unload_all_models()
    assert calls.take() == [("node", UNPATCH_WEIGHTS, "UNPLACED"), ("node", "detach(unpatch_all=True)", "UNPLACED")]
    del runner
    gc.collect()
    assert engine() is None and node.offload_engine is None
    # Pageable on the CPU, the blocks streamed from their own tensors: they keep them, nothing copied.
    assert in_place and on_buffers(node, buffers)
    state = comfy.patcher.state_of(node.model)
    blocks = node.model.diffusion_model.blocks
    assert all(state.parking.take(block) is None for block in blocks) and state.hidden == frozenset()
    assert comfy.pinned.PINNED_MEMORY.used == 0
    assert node.model.model_loaded_weight_memory == 0 and node.model.model_offload_buffer_memory == 0


def test_another_clone_detached_or_deleted_while_the_owner_streams_hands_nothing_over(
    calls: ComfyCalls, references: dict[str, torch.Tensor]
) -> None:
    """``ModelPatcher.__del__`` detaches (unpatch_all=False) any clone as it is deleted, which the cycle collector
    may do at any time; a node after the pack's clones the MODEL too. Only the clone whose load placed the engine
    hands the weights over: a detach of any other changes nothing."""
    comfy = calls.comfy
    node = streaming_load(calls)
    owner = calls.named(node.clone(), "owner")  # what a node after the pack's returns
    assert torch.equal(sample(comfy, owner), references["plain"])
    engine = owner.offload_engine
    state = comfy.patcher.state_of(owner.model)
    assert state.owner == owner.patcher_id
    spare = calls.named(owner.clone(), "spare")  # never loaded
    calls.take()
    node.detach(unpatch_all=False)
    del spare
    gc.collect()
    assert calls.take() == [("node", HAND_OVER, "STREAMING"), ("spare", HAND_OVER, "STREAMING")]
    assert owner.offload_engine is engine and engine.runner.enabled and state.parked_load is None
    assert torch.equal(sample(comfy, owner), references["plain"])


def test_a_plain_clone_loading_after_the_hand_over_is_not_taken_for_the_parked_load(
    calls: ComfyCalls, references: dict[str, torch.Tensor]
) -> None:
    """A prompt without the node, on the same weights: ``load_models_gpu`` hands them over from the node's clone,
    and the plain clone (ComfyUI's own patcher) loads all of them its own way. An old clone of the node's output
    deleted then hands nothing over (0.33 used to take the plain load for the parked one, and the next prompt with
    the node sampled without streaming). The next load of the node starts from the host and streams again."""
    comfy = calls.comfy
    model = wan(comfy)
    node = calls.named(async_offload(comfy, model, resident=1), "node")
    old = calls.named(node.clone(), "old")  # an earlier prompt's clone, still in ComfyUI's cache
    assert torch.equal(sample(comfy, node), references["plain"])
    calls.take()
    assert torch.equal(sample(comfy, model), references["plain"])
    assert calls.take() == [("node", HAND_OVER, "HANDED_OVER")]  # the plain clone's own calls are ComfyUI's
    assert model.model.model_loaded_weight_memory == model.model_size()  # all of it, the parked blocks too
    del old
    gc.collect()
    assert calls.take() == [("old", HAND_OVER, "HANDED_OVER")]
    handed_over = comfy.patcher.state_of(model.model).parked_load
    assert handed_over is not None and handed_over != node.loaded_state()  # still the node's books
    assert torch.equal(sample(comfy, node), references["plain"])
    assert calls.take() == [
        ("node", FIRST_UNPATCH, "PARKED"),  # the books changed: ComfyUI's load undone first, from the host
        ("node", "partially_load", "STREAMING"),
        ("node", "pre_run", "STREAMING"),
        ("node", "cleanup", "STREAMING"),
    ]
    assert_streaming(comfy, node)


class Interrupted(BaseException):
    """What no ``except Exception`` catches (as ComfyUI 0.33's InterruptProcessingException, a BaseException)."""


@pytest.mark.parametrize("raise_in_block", ["comfyui-interrupt", "base-exception"])
def test_an_interrupted_run_cleans_up_and_the_next_run_streams(
    calls: ComfyCalls, references: dict[str, torch.Tensor], raise_in_block: str
) -> None:
    """A run stopped inside a streamed block (ComfyUI's interrupt, checked before every op, or any exception
    that is no ``Exception``): the sampler's ``cleanup`` still comes, the engine closes the open step and keeps
    streaming, and the next run is the fully resident model's."""
    comfy = calls.comfy
    node = streaming_load(calls)
    assert torch.equal(sample(comfy, node), references["plain"])
    calls.take()

    def stop(*_: object) -> None:
        if raise_in_block == "comfyui-interrupt":
            comfy.mm.interrupt_current_processing()  # raises at ComfyUI's next check, inside the block
        else:
            raise Interrupted

    hook = node.model.diffusion_model.blocks[3].register_forward_pre_hook(stop)
    try:
        with pytest.raises((comfy.mm.InterruptProcessingException, Interrupted)):
            sample(comfy, node, seed=6)
    finally:
        hook.remove()
    assert calls.take() == [
        ("node", HAND_OVER, "HANDED_OVER"),
        ("node", FIRST_UNPATCH, "PARKED"),
        ("node", "partially_load", "STREAMING"),
        ("node", "pre_run", "STREAMING"),
        ("node", "cleanup", "STREAMING"),
    ]
    assert_streaming(comfy, node)
    assert torch.equal(sample(comfy, node), references["plain"])
    assert calls.phase(node) == "STREAMING"


def test_a_placement_that_streams_nothing_samples_without_an_engine_and_says_nothing(
    calls: ComfyCalls, references: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    """Every block resident: the node leaves the whole model to ComfyUI's loader; no engine, and none missed."""
    comfy = calls.comfy
    node = calls.named(async_offload(comfy, wan(comfy), resident=5), "node")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert torch.equal(sample(comfy, node), references["plain"])
    assert calls.take()[-3:] == [
        ("node", "partially_load", "UNPLACED"),
        ("node", "pre_run", "UNPLACED"),
        ("node", "cleanup", "UNPLACED"),
    ]
    assert node.offload_engine is None and node.model.model_loaded_weight_memory == resident_part(comfy, node)
    assert not node.model.model_lowvram  # all ComfyUI's
    assert not [r for r in caplog.records if "Block Offload" in r.getMessage()]


def test_the_next_prompts_clone_keeps_a_placement_that_streams_nothing_loaded(
    calls: ComfyCalls, references: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every block resident, the next prompt's clone of the same request keeps the whole model loaded, as ComfyUI
    keeps a plain model (its partially_load returns without loading when it holds the model whole): no weight
    loaded again. A clone of another request (the node run again with other settings) places anew and streams,
    and a LoRA added goes on."""
    comfy = calls.comfy
    model = wan(comfy)
    node = calls.named(async_offload(comfy, model, resident=5), "node")
    assert torch.equal(sample(comfy, node), references["plain"])
    calls.take()
    loaded_again = count_loads(comfy, monkeypatch)
    second = calls.named(node.clone(), "second")
    with pytest.MonkeyPatch.context() as warned:
        said: list[str] = []
        warned.setattr(comfy.panel_feed, "node_not_streaming", lambda node, notice: said.append(notice))
        comfy.mm.load_models_gpu([second])
        assert calls.take() == [
            ("node", HAND_OVER, "HANDED_OVER"),  # nothing parks: ComfyUI's books alone are handed over
            ("second", FIRST_UNPATCH, "UNPLACED"),  # kept, and the second clone's
            ("second", "partially_load", "UNPLACED"),
        ]
        assert loaded_again == [] and not second.model.model_lowvram
        assert second.model.model_loaded_weight_memory == resident_part(comfy, second)  # all of it
        assert torch.equal(sample(comfy, second), references["plain"])
        assert said == []  # sampling without an engine is what this placement is
    streaming = calls.named(async_offload(comfy, model, resident=1), "streaming")
    comfy.mm.load_models_gpu([streaming])
    assert calls.take()[-2:] == [
        ("streaming", FIRST_UNPATCH, "PARKED"),
        ("streaming", "partially_load", "STREAMING"),
    ]
    assert_streaming(comfy, streaming)
    assert torch.equal(sample(comfy, streaming), references["plain"])
    resident_again = calls.named(async_offload(comfy, model, resident=5), "resident again")
    assert torch.equal(sample(comfy, resident_again), references["plain"])
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))
    with_lora = calls.named(comfy.sd.load_lora_for_models(resident_again, None, lora, 1.0, 0)[0], "lora")
    assert torch.equal(sample(comfy, with_lora), references["lora"])
    assert with_lora.offload_engine is None


def test_a_load_out_of_memory_after_a_hand_over_is_undone_as_an_unload(
    calls: ComfyCalls, references: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next prompt asks for more resident blocks than the device holds: inside its partially_load, after
    ComfyUI's own first unpatch, the pack's placement runs out of memory and is undone. The undo is an unload
    (the parked blocks get memory of their own, nothing of the failed placement stays), not a re-patch, and the
    placement that fits streams."""
    comfy = calls.comfy
    first = streaming_load(calls, "first")
    assert torch.equal(sample(comfy, first), references["plain"])
    engine = first.offload_engine
    fits = (
        first.model.model_loaded_weight_memory
        + engine.runner.report().device_buffer_bytes
        + engine.plan.block_bytes[0] // 2
    )
    monkeypatch.setattr(comfy.patcher, "start_engine", limited(comfy.patcher.start_engine, fits))
    more = calls.named(async_offload(comfy, first, resident=3), "more")
    calls.take()
    comfy.mm.load_models_gpu([more])
    assert calls.take() == [
        ("first", HAND_OVER, "HANDED_OVER"),
        ("more", FIRST_UNPATCH, "PARKED"),
        ("more", UNPATCH_WEIGHTS, "UNPLACED"),  # 3 resident blocks placed, out of memory, undone
        ("more", "partially_load", "STREAMING"),
    ]
    assert_streaming(comfy, more)
    assert more.offload_engine.plan.resident == frozenset({0})
    assert torch.equal(sample(comfy, more), references["plain"])


def test_an_unexpected_call_is_logged_never_taken_silently(
    comfy: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    """Calls no sequence of ComfyUI 0.3.75 or 0.33 makes, should another ComfyUI make them: each says so."""
    protocol = importlib.import_module("block_offload.nodes.patcher")
    books = protocol.LoadedBooks(0, False, None, torch.device("cpu"))
    state = protocol.LoadProtocol()
    running, other = SimpleNamespace(name="running"), SimpleNamespace(name="other")  # engines, as far as it sees
    with caplog.at_level(logging.WARNING):
        state.begin_load(1, books, "request")
        state.begin_load(2, books, "request")  # while patcher 1's partially_load is open
        state.end_load(2)  # no unpatch_model in it
        state.handed_over(books)  # no engine parked
        state.placed(1, running, "request")
        state.placed(2, other, "request")  # another engine already streams
        state.unloaded()  # the engine not stopped
    warnings = [r.getMessage() for r in caplog.records]
    assert [w.split(": ", 2)[1] for w in warnings] == [
        "unexpected partially_load while the model is unplaced",
        "unexpected partially_load while the model is unplaced",
        "unexpected detach while the model is unplaced",
        "unexpected load while the model is streaming",
        "unexpected unpatch_model while the model is streaming",
    ]
    assert state.phase is protocol.Phase.UNPLACED and state.parked_load is None
