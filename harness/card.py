"""A card smaller than the CUDA device, for benchmarks: the VRAM sizes users own, on the GPU machine's one large device.

A filler allocation leaves exactly the card's bytes free (ComfyUI's loader and comfy-aimdo ask the driver what
is free), and ComfyUI's ``get_total_memory`` answers the device's memory less the filler, as a card that size
would (its ``maximum_vram_for_weights``, which the nodes' step-aside rule reads, counts the total). ComfyUI's
``total_vram``, read once at its import to pick a VRAM state, still counts the whole device.

``card`` holds one while a block runs (``bench/comfy_bench.py``'s rows, in process). A benchmark's server holds
one for its life through the custom node ``bench/support/block_offload_card``, which calls ``install_from_env``
when ``CARD_ENV`` gives the card's bytes (``bench/cold_prompt.py`` and ``bench/model_switch.py``, ``--card``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType

import torch

CARD_ENV = "BLOCK_OFFLOAD_BENCH_CARD_BYTES"
GIB = 1024**3


@contextlib.contextmanager
def card(mm: ModuleType, device: torch.device, nbytes: int) -> Iterator[int]:
    """A ``nbytes`` card on ``device`` while the block runs, for ComfyUI's ``model_management`` ``mm``; yields the
    filler's bytes."""
    free, _ = torch.cuda.mem_get_info(device)
    if free < nbytes:
        raise ValueError(f"a {nbytes / GIB:g} GiB card: only {free / GIB:.1f} GiB of the device are free")
    filler = torch.empty(free - nbytes, dtype=torch.uint8, device=device)
    filled, total_memory = filler.numel(), mm.get_total_memory

    def card_total(dev=None, torch_total_too=False):
        total = total_memory(dev, torch_total_too)
        return (total[0] - filled, total[1]) if torch_total_too else total - filled

    mm.get_total_memory = card_total
    try:
        yield filled
    finally:
        mm.get_total_memory = total_memory
        del filler
        torch.cuda.empty_cache()


def install_from_env() -> contextlib.ExitStack | None:
    """In a benchmark's server: the card ``CARD_ENV`` names, held until the returned stack closes (the server's
    end); None where the variable is unset. Raises where ComfyUI's device is not a CUDA device."""
    wanted = os.environ.get(CARD_ENV)
    if not wanted:
        return None
    import comfy.model_management as mm

    device = mm.get_torch_device()
    if device.type != "cuda":
        raise RuntimeError(f"{CARD_ENV}={wanted}: a card is carved out of a CUDA device; ComfyUI runs on {device}")
    held = contextlib.ExitStack()
    filled = held.enter_context(card(mm, device, int(wanted)))
    logging.info(f"Block Offload bench: a {int(wanted) / GIB:g} GiB card on {device} ({filled / GIB:.2f} GiB filled)")
    return held
