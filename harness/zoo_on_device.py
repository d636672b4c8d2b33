"""Every tiny diffusion transformer of ``harness/tiny_dit.py`` through each node, on the device ComfyUI picks (a
GPU where there is one), every block streamed, against the same model fully resident on that device:

    python -m harness.zoo_on_device [--cpu] [--dtype float32|bfloat16|float16] [NAME ...]

``tests/test_every_dit.py`` proves the same on the CPU, where a tensor left on the wrong device goes unseen;
this is its GPU check (``scripts/gpu_campaign.sh``). One line per model and node: bitwise, or how far the
latent is from the resident one, or the error. Exits 1 if any model fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import torch

from harness.comfy_host import resolve_comfyui_path
from harness.pack import import_pack


def run(names: Sequence[str], cpu: bool, dtype: torch.dtype | None) -> int:
    sys.path.insert(0, str(resolve_comfyui_path()))
    if cpu:
        os.environ["BLOCK_OFFLOAD_ALLOW_CPU"] = "1"
    import_pack()
    from harness import tiny_dit
    from harness.inprocess import every_block_streamed, in_process_comfy
    from harness.prompts import NODES, differs

    comfy = in_process_comfy({}, cpu=cpu)
    print(f"device {comfy.mm.get_torch_device()}, weights stored as {dtype or 'float32'}", flush=True)
    failed = 0
    for spec in tiny_dit.zoo():
        if names and spec.name not in names and spec.config not in names:
            continue
        if not spec.available():
            print(f"{spec.name:32s} not in this ComfyUI ({spec.config})", flush=True)
            continue
        start = time.perf_counter()
        outcomes = []
        bad = False
        try:
            model = tiny_dit.build(spec, dtype)
            reference = tiny_dit.sample(spec, model)
            for node in NODES:
                patched = every_block_streamed(comfy, node, model)
                latent = tiny_dit.sample(spec, patched)
                engine = patched.offload_engine
                copied = sum(span.bytes_copied for span in engine.recorder.latest().spans) if engine else 0
                if engine is None or not copied:
                    outcomes.append(f"{node}: NOT STREAMED")
                    bad = True
                elif torch.equal(latent, reference):
                    outcomes.append(f"{node}: bitwise ({engine.runner.report().unit}s)")
                else:
                    outcomes.append(f"{node}: DIFFERS {differs(latent, reference)}")
                    bad = True
                comfy.mm.unload_all_models()
        except Exception as error:  # every model is reported, then the run fails
            outcomes.append(f"FAILED: {type(error).__name__}: {str(error)[:300]}")
            bad = True
            comfy.mm.unload_all_models()
        failed += bad
        print(f"{spec.name:32s} {time.perf_counter() - start:6.2f} s  {'; '.join(outcomes)}", flush=True)
    print(f"{failed} model(s) failed", flush=True)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (to check the script itself)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("names", nargs="*", help="models or ComfyUI config classes (all by default)")
    args = parser.parse_args(argv)
    dtype = None if args.dtype == "float32" else getattr(torch, args.dtype)
    return run(args.names, args.cpu, dtype)


if __name__ == "__main__":
    sys.exit(main())
