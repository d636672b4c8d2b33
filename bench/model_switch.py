"""Two Wan experts in one prompt, as Wan 2.2 runs them, through a real ComfyUI server: the warm prompts (the
second onwards) with ComfyUI alone against both experts through Partial GPU Residency, and the server's host
memory at its peak.

    python -m bench.model_switch [--dim 1280 --ffn 3456 --layers 40] [--rounds 3] [--prompts 4] [--steps 4]
                                 [--budget 0.5] [--cuda [--card GIB] [--modes classic dynamic]]
                                 [--linked-experts] [--out DIR] [--folder DIR]

Two checkpoint files of ``bench/cold_prompt.py``'s Wan shape (a high-noise and a low-noise expert: the same
architecture, two files, each loaded by its own Load Diffusion Model) and the graph of ComfyUI's Wan 2.2
template: each expert through ModelSamplingSD3 (shift 8) into a KSamplerAdvanced, the high-noise one from step 0
to half of ``--steps`` with its leftover noise returned, the low-noise one from there to the end, then Save
Latent. With the node, each loader's model goes through Partial GPU Residency (policy auto, ``--budget`` of an
expert's bytes as the device holds them) before its ModelSamplingSD3.

Each side runs on a server of its own, started for it (so its memory is its own): ``--prompts`` prompts in a row,
each with a new seed, so ComfyUI's cache keeps the loaded experts (and the nodes' outputs) and samples again.
The first prompt loads both experts; the later ones are the warm prompts a user runs one after the other, each
switching from the low-noise expert back to the high-noise one and then to the low-noise one again. A round
runs both sides, in alternating order; the first round's node prompts are the automatic placement's measuring
load and its search (``offload/cost_cache.py``, one model shape for both experts), the later rounds' place from
the kept search.

Timed from just before ``POST /prompt`` (``bench/cold_prompt.py``'s client timing): to the end of each sampler's
first step (the low-noise one's is the switch) and to the end of the prompt, with each sampler's time from its
start to its first step (what loading its expert costs in that prompt). The server's ``RssAnon`` is sampled while
each prompt runs: its peak over the warm prompts, and over all of them with the first's load, against ComfyUI's
own. Printed, and written to ``--out`` (``model_switch.json``, ``model_switch.md``).

On a GPU (``--cuda``; campaign call 9 runs it at Wan 14B): ``--card`` gives each server a card that size
(``harness/card.py``), and the node's budget is then automatic (what ComfyUI's loader grants the weights);
``--modes`` runs the rounds once per way ComfyUI 0.33 loads models, each with its own table
(``model_switch-classic``, ``model_switch-dynamic``): ``classic`` with ``--disable-dynamic-vram`` on every server,
``dynamic`` as ComfyUI starts by default, each server's log checked for its mode. ``--linked-experts`` writes one
file and makes the low-noise expert a hard link to it: two models to ComfyUI, loaded twice, one file on the disk
and in the page cache (two 28.6 GB Wan 14B files would fill most of the GPU machine's 64 GiB disk).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from harness.comfy_host import interrupt_on_sigterm
from harness.workflows import SAMPLER, SCHEDULER

from bench.cold_prompt import (
    LOADER,
    NODE,
    QUIET_CORES,
    SEEDS_FROM,
    Models,
    Row,
    Timed,
    arguments,
    budget_said,
    builder,
    lay_out,
    median_of,
    node_budget_gib,
    parsed,
    run_meta,
    server,
    through_node,
    timed,
    undisturbed,
    write,
)
from bench.measure import progress
from bench.results import COMFYUI, GIB

HIGH, LOW = "high noise", "low noise"
EXPERTS = MappingProxyType({HIGH: "wan-high-noise", LOW: "wan-low-noise"})  # expert -> checkpoint name
SHIFT = 8.0  # ComfyUI's Wan 2.2 template's ModelSamplingSD3 shift for both experts
CLASSIC, DYNAMIC = "classic", "dynamic"
#: ComfyUI 0.33's flags for each way of loading models on an NVIDIA GPU (Dynamic VRAM is its default there).
MODE_FLAGS = MappingProxyType({CLASSIC: ("--disable-dynamic-vram",), DYNAMIC: (), None: ()})
MODE_SAID = MappingProxyType(
    {CLASSIC: "classic loading (--disable-dynamic-vram)", DYNAMIC: "Dynamic VRAM (its default)"}
)
DYNAMIC_VRAM_ON = "DynamicVRAM support detected and enabled"  # ComfyUI 0.33's main.py, as it starts
LINKED_NOTE = ("the two experts are one file (--linked-experts: the low-noise one a hard link to the high-noise one's, "
               "so that two 14B experts fit the GPU machine's disk): two models to ComfyUI, loaded twice, but one "
               "file in the page cache, where two real experts' files take twice its size")  # fmt: skip


def sampler_stage(expert: str) -> str:
    return f"KSamplerAdvanced ({expert})"


def switch_prompt(models: Models, args: argparse.Namespace, node: bool, seed: int) -> tuple[dict, dict[str, str]]:
    """The Wan 2.2 graph on the two experts; with the stages to time (node id -> name)."""
    made = builder(models, EXPERTS[HIGH], args.layers)
    loaded = {HIGH: made.model, LOW: made.add("UNETLoader", unet_name=models.files[EXPERTS[LOW]],
                                             weight_dtype="default")}  # fmt: skip
    stages = {loader[0]: f"{LOADER} ({expert})" for expert, loader in loaded.items()}
    if node:
        budget = node_budget_gib(models, args)
        loaded = {expert: through_node(made, model, budget) for expert, model in loaded.items()}
        stages.update({model[0]: f"{NODE} ({expert})" for expert, model in loaded.items()})
    shifted = {expert: made.add("ModelSamplingSD3", model=model, shift=SHIFT) for expert, model in loaded.items()}
    common = {"noise_seed": seed, "steps": args.steps, "cfg": 1.0, "sampler_name": SAMPLER, "scheduler": SCHEDULER,
              "positive": made.positive, "negative": made.negative}  # fmt: skip
    half = args.steps // 2
    high = made.add("KSamplerAdvanced", model=shifted[HIGH], add_noise="enable", latent_image=made.latent,
                    start_at_step=0, end_at_step=half, return_with_leftover_noise="enable", **common)  # fmt: skip
    low = made.add("KSamplerAdvanced", model=shifted[LOW], add_noise="disable", latent_image=high,
                   start_at_step=half, end_at_step=10_000, return_with_leftover_noise="disable", **common)  # fmt: skip
    made.add("SaveLatent", samples=low, filename_prefix="bench/model_switch")
    stages.update({high[0]: sampler_stage(HIGH), low[0]: sampler_stage(LOW)})
    return made.prompt, stages


def one_server(base: Path, models: Models, args: argparse.Namespace, mode: str | None, node: bool,
               seeds: Callable[[], int], prompts: int) -> tuple[list[Timed], dict[str, str]]:  # fmt: skip
    """``prompts`` prompts in a row on a server started for them in ComfyUI's ``mode``; with the run's meta (while
    the server runs)."""
    with server(base, args, MODE_FLAGS[mode] if args.cuda else ()) as host:
        dynamic = DYNAMIC_VRAM_ON in host.log_text()
        if mode is not None and dynamic != (mode == DYNAMIC):
            raise RuntimeError(f"asked for ComfyUI's {mode} mode, the server {'has' if dynamic else 'lacks'} Dynamic "
                               f"VRAM:\n{host.log_tail(60)}")  # fmt: skip
        done = [timed(host, *switch_prompt(models, args, node, seeds())) for _ in range(prompts)]
        return done, {**run_meta("model_switch", args, host, models), "Dynamic VRAM": "on" if dynamic else "off"}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """The node's warm prompt over ComfyUI's, and its host memory's peak over ComfyUI's, in each mode; returns those
    ratios (named after their mode where ``--modes`` gives them)."""
    parser = arguments(__doc__, steps=4)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per server: the first loads, the rest warm")
    modes = "ComfyUI's model loading, a table each (with --cuda; default: the host's own)"
    parser.add_argument("--modes", nargs="+", choices=(CLASSIC, DYNAMIC), default=[None], help=modes)
    linked = "one file on the disk: the low-noise expert a hard link to the high-noise one's"
    parser.add_argument("--linked-experts", action="store_true", help=linked)
    parser.set_defaults(rounds=3)
    args = parsed(parser, argv)
    if args.prompts < 2:
        parser.error("--prompts: at least 2, the first loads the experts")
    if DYNAMIC in args.modes and not args.cuda:
        parser.error("--modes dynamic: ComfyUI's Dynamic VRAM runs on an NVIDIA GPU (--cuda)")
    seeds = iter(range(SEEDS_FROM, SEEDS_FROM + 10_000)).__next__
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="model_switch_", dir=args.folder) as folder:
        base = Path(folder)
        models = lay_out(base, list(EXPERTS.values()), args, linked=args.linked_experts)
        progress(f"model_switch: two experts of {models.file_bytes / 1e9:.2f} GB written"
                 f"{' (one file, linked)' if args.linked_experts else ''}; the node's budget "
                 f"{budget_said(models, args)}")  # fmt: skip
        for mode in args.modes:
            said = one_mode(base, models, args, mode, seeds)
            ratios.update({f"{key}, {mode}" if mode else key: ratio for key, ratio in said.items()})
    return ratios


def one_mode(base: Path, models: Models, args: argparse.Namespace, mode: str | None,
             seeds: Callable[[], int]) -> dict[str, float]:  # fmt: skip
    """The rounds on servers in ComfyUI's ``mode`` and their table; returns the node's ratios to ComfyUI's."""
    # The automatic placement measures on its first load and searches on its second (for both experts: one
    # shape); a user's later prompts place from the kept search (the base directory's user folder keeps it).
    warmup, _ = one_server(base, models, args, mode, True, seeds, prompts=2)
    progress(f"warm-up, {NODE}: prompts done in {', '.join(f'{one.end_s:.2f}' for one in warmup)} s")
    first: dict[str, list[Timed]] = {COMFYUI: [], NODE: []}
    warm: dict[str, list[Timed]] = {COMFYUI: [], NODE: []}
    meta: dict[str, str] = {}
    for round_ in range(args.rounds):
        order = [COMFYUI, NODE] if round_ % 2 == 0 else [NODE, COMFYUI]
        for side in order:
            done, meta = one_server(base, models, args, mode, side == NODE, seeds, args.prompts)
            first[side].append(done[0])
            warm[side] += done[1:]
            ends = ", ".join(f"{one.end_s:.2f}" for one in done)
            peak = max(one.anon_peak_bytes for one in done) / GIB
            progress(f"round {round_ + 1}, {side}: prompts done in {ends} s; RssAnon peak {peak:.2f} GiB")
    rows = switch_rows(warm, first)
    # A warm prompt answers the loaders from ComfyUI's cache; its default cache drops outputs when free RAM runs low.
    again = {side: sum(any(s.startswith(LOADER) for s in one.stage_s) for one in done) for side, done in warm.items()}
    anon = {side: max(one.anon_peak_bytes for one in (*warm[side], *first[side])) for side in warm}
    holds = anon[NODE] <= anon[COMFYUI]
    # Each round's warm prompts, a side's median, paired round by round (the two servers of a round ran in turn).
    per_round = args.prompts - 1
    by_round = {side: [statistics.median(t.end_s for t in done[i : i + per_round]) for i in range(0, len(done),
                per_round)] for side, done in warm.items()}  # fmt: skip
    paired = statistics.median(ours / theirs for theirs, ours in zip(by_round[COMFYUI], by_round[NODE], strict=True))
    calm = {side: [t.end_s for t in done if undisturbed(t)] for side, done in warm.items()}
    calm_said = ", ".join(f"{side} {len(ends)}" + (f", median {statistics.median(ends):.2f} s" if ends else "")
                          for side, ends in calm.items())  # fmt: skip
    notes = [
        f"warm prompts that other processes left alone (under {QUIET_CORES} of a core): {calm_said}",
        f"the median of the rounds' own ratios of the warm prompt (the rounds' two servers ran in turn, so that "
        f"what else ran on the machine touched both alike): {paired:.2f}x",
        f"medians of the warm prompts (2 to {args.prompts} of each server: {len(warm[NODE])} a side) over "
        f"{args.rounds} rounds, each side on a server of its own; the first prompts (the experts' load) and a "
        "server of the node's before the rounds (its placement's measuring load and search) in the JSON",
        f"host memory: the node's RssAnon peak {anon[NODE] / GIB:.2f} GiB against ComfyUI's {anon[COMFYUI] / GIB:.2f} "
        f"GiB: {'at or below' if holds else '**above**'} ComfyUI's",
        f"warm prompts that loaded an expert again (ComfyUI's cache dropped it, short of RAM): {again[COMFYUI]} of "
        f"ComfyUI's, {again[NODE]} of the node's",
        "seconds from just before POST /prompt, as the websocket client received each message",
    ]
    if args.linked_experts:
        notes.append(LINKED_NOTE)
    loading = "" if mode is None else f", ComfyUI's {MODE_SAID[mode]}"
    title = f"Two Wan experts in a warm prompt (Wan 2.2's switch), through a ComfyUI server ({meta['device']}{loading})"
    prompts = {**warm, **{f"first prompt, {side}": done for side, done in first.items()}, f"warm-up, {NODE}": warmup}
    data, table = write(args.out, "model_switch" + (f"-{mode}" if mode else ""), title, rows, meta, notes, prompts)
    progress(f"wrote {data}, {table}")
    return {"warm prompt": rows[0].values[NODE] / rows[0].values[COMFYUI], "RssAnon peak": anon[NODE] / anon[COMFYUI]}


def switch_rows(warm: Mapping[str, Sequence[Timed]], first: Mapping[str, Sequence[Timed]]) -> list[Row]:
    """The table: the warm prompt's times first, then where they went, then the host memory."""

    def figure(pick: Callable[[Timed], float | None], prompts: Mapping[str, Sequence[Timed]] = warm) -> dict:
        return {side: median_of(done, pick) for side, done in prompts.items()}

    def to_first_step(expert: str) -> Callable[[Timed], float]:
        stage = sampler_stage(expert)
        return lambda t: t.first_step_s(stage) - t.started_s[stage]

    def peak(prompts: Mapping[str, Sequence[Timed]]) -> dict[str, float | None]:
        return {side: max(one.anon_peak_bytes for one in done) / GIB for side, done in prompts.items()}

    both = {side: [*warm[side], *first[side]] for side in warm}
    high, low = sampler_stage(HIGH), sampler_stage(LOW)
    return [
        Row("warm prompt: POST /prompt -> prompt done", figure(lambda t: t.end_s), "s"),
        Row(f"warm prompt: POST /prompt -> {HIGH}'s 1st step done", figure(lambda t: t.first_step_s(high)), "s"),
        Row(f"warm prompt: POST /prompt -> {LOW}'s 1st step done", figure(lambda t: t.first_step_s(low)), "s"),
        Row(f"warm prompt: {HIGH} sampler's start -> its 1st step", figure(to_first_step(HIGH)), "s", ratio=False),
        Row(
            f"warm prompt: {LOW} sampler's start -> its 1st step (the switch)",
            figure(to_first_step(LOW)),
            "s",
            ratio=False,
        ),
        Row("warm prompt: steps after each sampler's 1st, each", figure(later_steps), "s", ratio=False),
        Row("warm prompt: server CPU time (user + system, every thread)", figure(lambda t: t.cpu_s), "s"),
        Row("warm prompt: other processes' CPU use meanwhile", figure(lambda t: t.others_cores), "cores", ratio=False),
        Row("first prompt (both experts loaded): POST /prompt -> prompt done", figure(lambda t: t.end_s, first), "s"),
        Row("server RssAnon, peak over the warm prompts", peak(warm), "GiB", ratio=False),
        Row("server RssAnon, peak with the first prompt's load", peak(both), "GiB", ratio=False),
    ]


def later_steps(t: Timed) -> float | None:
    """The mean step after each sampler's first (None where each sampler ran one step)."""
    found = [t.later_step_s(stage) for stage, steps in t.steps_s.items() if len(steps) > 1]
    return statistics.mean(found) if found else None


if __name__ == "__main__":
    interrupt_on_sigterm()
    main()
