"""torch.compile through ComfyUI's own TorchCompileModel helper (``set_torch_compile_wrapper``), in-process.

The engine's hooks run outside the compiled graphs (``offload.calls.eager``), so a model compiled with
inductor streams: the compiler breaks its graph at each block's hooks and compiles the code between.
The cudagraphs backend cannot replay weights that move between buffers, and is refused before any work.
On the CPU inductor compiles C++ kernels: the first compilation takes a minute or so on two cores.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.inprocess import async_offload, sample, wan

pytestmark = [
    pytest.mark.usefixtures("allow_cpu_streaming"),  # the nodes stream on the CPU too
    # ComfyUI's set_torch_compile_wrapper wraps the model alike on every host; what is tested is torch's compiler
    # around the engine's hooks, and inductor's C++ build takes minutes on two cores.
    pytest.mark.one_host(reason="the compiler under test is torch's; ComfyUI's wrapper is the same on every host"),
]


def compiled(model, backend: str):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    model = model.clone()
    set_torch_compile_wrapper(model=model, backend=backend)
    return model


@pytest.mark.timeout(900)
def test_a_model_compiled_with_inductor_streams_and_matches_the_compiled_model(comfy: SimpleNamespace) -> None:
    model = wan(comfy)
    reference = sample(comfy, compiled(model, "inductor"))
    # Compiled after the node (TorchCompileModel downstream) and before it (upstream).
    for streaming in (compiled(async_offload(comfy, model, resident=1), "inductor"),
                      async_offload(comfy, compiled(model, "inductor"), resident=2)):  # fmt: skip
        assert torch.equal(sample(comfy, streaming), reference)
        step = streaming.offload_engine.recorder.latest()
        assert [span.block for span in step.spans] == list(range(5)), "the engine did not see every block"
        assert sum(span.bytes_copied > 0 for span in step.spans) == len(streaming.offload_engine.plan.streamed)
    comfy.mm.unload_all_models()


def test_cudagraphs_is_refused_with_what_to_use_instead(comfy: SimpleNamespace) -> None:
    model = wan(comfy)
    message = r"compiled with the cudagraphs backend.*Use the inductor backend"
    with pytest.raises(ValueError, match=message):  # compiled before the node: refused by the node
        async_offload(comfy, compiled(model, "cudagraphs"))
    after = compiled(async_offload(comfy, model), "cudagraphs")  # after the node: refused when loaded
    with pytest.raises(ValueError, match=message):
        comfy.mm.load_models_gpu([after])
    assert after.offload_engine is None
    assert torch.equal(sample(comfy, async_offload(comfy, model)), sample(comfy, model))  # still usable
    comfy.mm.unload_all_models()
