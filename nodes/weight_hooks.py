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


def hooked_streamed_keys(model: ModelPatcher, streamed: frozenset[str]) -> list[str]:
    """The weights of ``streamed`` modules that the hooks registered on ``model`` patch, sorted."""
    keys = {key for patches in model.hook_patches.values() for key in patches}
    return sorted(key for key in keys if inside(key.rpartition(".")[0], streamed))


def refuse_weight_hooks(model: ModelPatcher, streamed: frozenset[str], node: str) -> None:
    """Raises where the hooks registered for this sampling patch a weight of a ``streamed`` module. A hook of
    model strength 0 is refused too, since ComfyUI writes its weights all the same (into a Dynamic VRAM twin's
    file mapping, fatally), but told how to keep it on the text encoder only."""
    hooked = hooked_streamed_keys(model, streamed)
    if not hooked:
        return
    strengths = {
        patch[0] for patches in model.hook_patches.values() for key in hooked for patch in patches.get(key, ())
    }
    text_encoder_only = (
        " Its model strength is 0: to hook the text encoder only, set apply_to_conds to false on Set CLIP Hooks."
        if strengths == {0.0}
        else ""
    )
    raise ValueError(
        f"{node}: a hook LoRA (Create Hook LoRA, or hooks set on a conditioning) patches {len(hooked)} weights "
        f"of blocks this node streams ({hooked[0]}, ...). ComfyUI writes hook patches into the weights between "
        "model calls, which streamed blocks do not follow, so the output would be wrong. Load the LoRA with "
        f"Load LoRA (LoraLoaderModelOnly) instead, or run this workflow without the node.{text_encoder_only}"
    )
