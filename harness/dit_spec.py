"""What a tiny diffusion model is, as data: ``TinyDiT`` and its default callables.

The families are listed in ``dits_*.py`` as ``TinyDiT`` values; ``tiny_dit.py`` gathers them (``zoo()``), builds
and samples them. This module imports nothing of the harness, so that the ``dits_*`` files import it and not the
builder that imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch


def no_extra(generator: torch.Generator) -> dict[str, Any]:
    return {}


def no_fill(diffusion_model: torch.nn.Module) -> None:
    return None


@dataclass(frozen=True)
class TinyDiT:
    """One of ComfyUI's diffusion models at tiny width.

    ``config``: the ``comfy.supported_models`` class ComfyUI detects for it; ``unet_config``: the whole config
    that detection would give (the model class's keyword arguments, ``image_model`` included), tiny;
    ``latent``: the shape of the latent the sampler starts from; ``context``: (tokens, width) of the text
    conditioning; ``extra``: the conditioning's
    other entries (``pooled_output``, ``guidance``, ...), made from the generator given; ``fill``: sets what a
    checkpoint holds and random parameters do not (a buffer ComfyUI makes with ``torch.empty``); ``building``: a
    context the model is built in (for sizes no config key reaches).
    """

    name: str
    config: str
    unet_config: Mapping[str, Any]
    latent: tuple[int, ...]
    context: tuple[int, int]
    extra: Callable[[torch.Generator], dict[str, Any]] = field(default=no_extra)
    fill: Callable[[torch.nn.Module], None] = field(default=no_fill)
    building: Callable[[], AbstractContextManager[Any]] = field(default=nullcontext)

    def available(self) -> bool:
        """Whether this ComfyUI has the model's class."""
        import comfy.supported_models

        return hasattr(comfy.supported_models, self.config)
