"""Weight hooks (``comfy.hooks``: Create Hook LoRA and the nodes that set hooks on a conditioning) on streamed blocks.

ComfyUI applies a hook LoRA by writing the patched weight into the model's parameter (``patch_hooks``:
``copy_to_param``) between two model calls, whenever the conditioning's hooks change: from the positive to the
negative prompt, at each keyframe. A streamed block is copied from the engine's host buffers, or from the
loader's tensors while the copy stream reads them ahead of the next call, so it would compute with weights that
are not the hook's (a wrong image, silently), and on a Dynamic VRAM twin ComfyUI would write into the read-only
mapping of the checkpoint file (a crash). The node refuses such a run before it samples, saying what to do.
"""

from __future__ import annotations

from comfy.model_patcher import ModelPatcher

from .blocks import inside


def hook_strengths(model: ModelPatcher, streamed: frozenset[str]) -> dict[str, set[float]]:
    """Each weight of ``streamed`` modules that the hooks registered on ``model`` patch, with those patches'
    strengths."""
    strengths: dict[str, set[float]] = {}
    for patches in model.hook_patches.values():
        for key, entries in patches.items():
            if inside(key, streamed):
                strengths.setdefault(key, set()).update(entry[0] for entry in entries)
    return strengths


def refuse_weight_hooks(model: ModelPatcher, streamed: frozenset[str], node: str) -> None:
    """Raises where the hooks registered for this sampling patch a weight of a ``streamed`` module. A hook of
    model strength 0 is refused too, since ComfyUI writes its weights all the same (into a Dynamic VRAM twin's
    file mapping, fatally), but told how to keep it on the text encoder only."""
    strengths = hook_strengths(model, streamed)
    if not strengths:
        return
    text_encoder_only = (
        " Its model strength is 0: to hook the text encoder only, set apply_to_conds to false on Set CLIP Hooks."
        if all(used == {0.0} for used in strengths.values())
        else ""
    )
    raise ValueError(
        f"{node}: a hook LoRA (Create Hook LoRA, or hooks set on a conditioning) patches {len(strengths)} weights "
        f"of blocks this node streams ({min(strengths)}, ...). ComfyUI writes hook patches into the weights between "
        "model calls, which streamed blocks do not follow, so the output would be wrong. Load the LoRA with "
        f"Load LoRA (LoraLoaderModelOnly) instead, or run this workflow without the node.{text_encoder_only}"
    )
