"""A plain LoRA computed in the engine's scratch (``nodes/loaded_patch.py``) is ComfyUI's ``calculate_weight``, bit
for bit, in every dtype mix a streamed weight meets: the weight patched in place or through a working copy, the
products in another dtype than the weight's, adapters stored in another dtype, two LoRAs and a model strength;
and what is not a plain LoRA is left to ComfyUI's code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

OUT, IN, RANK = 48, 40, 8


def adapter(comfy_weight_adapter, dtype: torch.dtype, seed: int, alpha: float | None, mid: bool = False):
    generator = torch.Generator().manual_seed(seed)
    up = torch.randn(OUT, RANK, generator=generator).to(dtype)
    down = torch.randn(RANK, IN, generator=generator).to(dtype)
    middle = torch.randn(RANK, RANK, 1, 1, generator=generator) if mid else None
    return comfy_weight_adapter.LoRAAdapter(set(), (up, down, alpha, middle, None, None))


@pytest.mark.parametrize(
    ("weight_dtype", "work_dtype", "intermediate", "adapter_dtype"),
    [
        (torch.float32, torch.float32, torch.float32, torch.float32),  # in place, nothing cast
        (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16),  # a working copy; adapters cast
        (torch.float16, torch.float16, torch.float32, torch.float16),  # products in fp32, cast to the weight's
        (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32),  # Dynamic VRAM: all in the compute dtype
    ],
)
def test_a_plain_lora_in_the_scratch_is_calculate_weight_bit_for_bit(
    comfy: SimpleNamespace,
    weight_dtype: torch.dtype,
    work_dtype: torch.dtype,
    intermediate: torch.dtype,
    adapter_dtype: torch.dtype,
) -> None:
    import comfy.lora
    import comfy.weight_adapter

    from block_offload.nodes.loaded_patch import ScratchLayout, layout_in, patch_plain_loras, plain_loras

    weight = (torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)) * 0.1).to(weight_dtype)
    patches = [
        (0.8, adapter(comfy.weight_adapter, adapter_dtype, 2, 4.0), 1.0, None, None),
        (0.5, adapter(comfy.weight_adapter, adapter_dtype, 3, None), 0.9, None, None),
    ]
    reference = comfy.lora.calculate_weight(
        patches, weight.to(work_dtype, copy=True), "w", intermediate_dtype=intermediate
    )
    loras = plain_loras(patches, weight.shape)
    assert loras is not None and len(loras) == 2
    in_place = weight.dtype == work_dtype
    nbytes = ScratchLayout.of(weight, loras, work_dtype, intermediate, in_place).nbytes
    scratch = torch.empty(nbytes, dtype=torch.uint8)
    layout = layout_in(scratch, weight, loras, work_dtype, intermediate)
    assert layout is not None and layout.nbytes == nbytes
    assert layout_in(scratch[:-1], weight, loras, work_dtype, intermediate) is None  # counted to the byte
    current = weight.clone()
    patched = patch_plain_loras(current, loras, layout, scratch)
    assert patched.dtype == work_dtype and torch.equal(patched, reference)
    assert (patched.data_ptr() == current.data_ptr()) == in_place  # else a view of the scratch
    if not in_place:
        assert scratch.data_ptr() <= patched.data_ptr() < scratch.data_ptr() + nbytes


def test_what_is_not_a_plain_lora_is_left_to_comfyuis_code(comfy: SimpleNamespace) -> None:
    import comfy.weight_adapter

    from block_offload.nodes.loaded_patch import plain_loras

    shape = torch.Size((OUT, IN))
    plain = (1.0, adapter(comfy.weight_adapter, torch.float32, 2, None), 1.0, None, None)
    assert plain_loras([plain], shape) is not None
    with_mid = (1.0, adapter(comfy.weight_adapter, torch.float32, 2, None, mid=True), 1.0, None, None)
    with_offset = (1.0, plain[1], 1.0, (0, 0, OUT // 2), None)
    with_function = (1.0, plain[1], 1.0, None, torch.tanh)
    diff = (1.0, (torch.zeros(shape),), 1.0, None, None)
    for patch in (with_mid, with_offset, with_function, diff):
        assert plain_loras([plain, patch], shape) is None
    assert plain_loras([plain], torch.Size((OUT, IN + 1))) is None  # a shape the product does not make
