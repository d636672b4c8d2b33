"""A first load's packing, shown the ComfyUI way: a progress bar on the node that loads the model (the sampler).

Packing copies every streamed weight into host buffers once, and pins them: gigabytes, seconds on a GPU machine,
before ComfyUI's own progress bar starts counting steps. A model whose host buffers are taken over from the last
prompt packs nothing and shows no bar.
"""

from __future__ import annotations

from collections.abc import Callable

import comfy.utils

#: The most updates one packing sends: the sequential wrapper packs modules by the thousand, and ComfyUI 0.3.75
#: sends every update to every open browser tab.
UPDATES = 50


def pack_progress(packed_bytes: Callable[[], int]) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` for ``Runner.enable``: a progress bar over the units, from the first unit
    that ``packed_bytes`` (the runner's count of bytes copied) says was packed, at most ``UPDATES`` times."""
    bar: comfy.utils.ProgressBar | None = None
    shown = 0

    def progress(done: int, total: int) -> None:
        nonlocal bar, shown
        if bar is None:
            if not packed_bytes():
                return  # taken over, or left in its file, so far: nothing worth a bar yet
            bar = comfy.utils.ProgressBar(total)
        step = max(1, total // UPDATES)
        if done == total or done - shown >= step:
            bar.update_absolute(done, total)
            shown = done

    return progress
