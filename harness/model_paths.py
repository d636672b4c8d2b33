"""The paths a diffusion model takes through a UI workflow, read from the graph JSON the frontend serializes (root
graph, its subgraph definitions, the same subgraph used twice counted twice): what tests/test_stream_action.py
checks the action "Stream this workflow's models" against, written apart from the action's own code.

A path starts at a loader (a node that gives a MODEL and takes none) and follows the MODEL through patches (nodes
that give a MODEL back), into the subgraphs it goes into and out of those it leaves, to a node that does something
else with it: a sampler (it gives a LATENT or a GUIDER, or ``/object_info`` files it under sampling), or anything
else (a detector, a pose model). Schedulers (they give only SIGMAS) read the model without sampling: no path ends
there, and they part no path.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

MODEL = "MODEL"
SUBGRAPH_INPUT = -10
SUBGRAPH_OUTPUT = -20
#: Pass-through nodes typed "*": the model goes through them as through a patch.
PASS_THROUGH = {"Reroute", "ComfySwitchNode"}
#: LiteGraph's title bar, drawn above a node's ``pos``.
TITLE_HEIGHT = 30

SAMPLER = "sampler"
SCHEDULER = "scheduler"
ELSEWHERE = "elsewhere"


@dataclass(frozen=True)
class Link:
    id: int
    origin: int
    origin_slot: int
    target: int
    target_slot: int
    type: str


@dataclass
class Graph:
    """One graph of the workflow: its nodes by id, its links by id, and (a subgraph) its inputs' links."""

    id: str
    nodes: dict[int, dict[str, Any]]
    links: dict[int, Link]
    input_links: list[list[int]] = field(default_factory=list)


def _link(raw: Any) -> Link:
    if isinstance(raw, dict):
        values = [raw[k] for k in ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")]
    else:
        values = list(raw[:6])
    return Link(*(int(v) for v in values[:5]), str(values[5]))


def graphs_of(workflow: Mapping[str, Any]) -> dict[str, Graph]:
    """The root graph ("root") and every subgraph definition, by id."""
    found = {"root": Graph("root", _nodes(workflow), _links(workflow))}
    pending = list(workflow.get("definitions", {}).get("subgraphs", []))
    while pending:
        raw = pending.pop()
        found[raw["id"]] = Graph(
            raw["id"], _nodes(raw), _links(raw), [list(i.get("linkIds") or []) for i in raw.get("inputs", [])]
        )
        pending += raw.get("definitions", {}).get("subgraphs", [])
    return found


def _nodes(raw: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(node["id"]): node for node in raw.get("nodes", [])}


def _links(raw: Mapping[str, Any]) -> dict[int, Link]:
    return {link.id: link for link in map(_link, raw.get("links") or [])}


@dataclass(frozen=True)
class Step:
    """A real node on a path: ``frame`` is the subgraph nodes it sits in (ids, outermost first), ``graph`` its
    graph's id."""

    frame: tuple[int, ...]
    graph: str
    node: int


class ModelPaths:
    """A workflow's model paths. ``object_info`` is the server's node definitions (category, outputs)."""

    def __init__(self, workflow: Mapping[str, Any], object_info: Mapping[str, Any]) -> None:
        self.graphs = graphs_of(workflow)
        self.info = object_info
        # Each frame (the subgraph nodes entered, from the root) and the graph it shows.
        self.frames: dict[tuple[int, ...], str] = {}
        pending: list[tuple[tuple[int, ...], str]] = [((), "root")]
        while pending:
            frame, graph_id = pending.pop()
            self.frames[frame] = graph_id
            for node_id, node in self.graphs[graph_id].nodes.items():
                if node["type"] in self.graphs and node["type"] != "root" and len(frame) < 16:
                    pending.append(((*frame, node_id), node["type"]))

    def node(self, step: Step) -> dict[str, Any]:
        return self.graphs[step.graph].nodes[step.node]

    def model_outputs(self, graph: Graph, node: dict[str, Any]) -> list[int]:
        """The output slots of ``node`` that carry a model: typed MODEL, or linked by a MODEL link."""
        return [
            slot
            for slot, output in enumerate(node.get("outputs") or [])
            if output.get("type") == MODEL
            or any(graph.links[i].type == MODEL for i in output.get("links") or [] if i in graph.links)
        ]

    def takes_a_model(self, graph: Graph, node: dict[str, Any]) -> bool:
        return any(
            i.get("link") is not None
            and i["link"] in graph.links
            and (i.get("type") == MODEL or graph.links[i["link"]].type == MODEL)
            for i in node.get("inputs") or []
        )

    def is_subgraph(self, node: dict[str, Any]) -> bool:
        return node["type"] in self.graphs

    def loaders(self) -> list[Step]:
        """Every loader in every frame."""
        found = []
        for frame, graph_id in self.frames.items():
            graph = self.graphs[graph_id]
            for node_id, node in graph.nodes.items():
                passes_on = node["type"] in PASS_THROUGH or any(
                    i.get("type") == "*" and i.get("link") is not None for i in node.get("inputs") or []
                )
                if (
                    not self.is_subgraph(node)
                    and not passes_on
                    and self.model_outputs(graph, node)
                    and not self.takes_a_model(graph, node)
                ):
                    found.append(Step(frame, graph_id, node_id))
        return found

    def kind(self, step: Step) -> str:
        """What a node that takes the model does with it: "patch" (gives a model back), SCHEDULER, SAMPLER or
        ELSEWHERE."""
        graph, node = self.graphs[step.graph], self.node(step)
        if node["type"] in PASS_THROUGH or self.model_outputs(graph, node):
            return "patch"
        info = self.info.get(node["type"], {})
        outputs = set(info.get("output") or [o.get("type") for o in node.get("outputs") or []])
        if outputs == {"SIGMAS"}:
            return SCHEDULER
        if outputs & {"LATENT", "GUIDER"} or "sampling" in str(info.get("category", "")):
            return SAMPLER
        return ELSEWHERE

    def consumers(self, step: Step) -> list[Step]:
        """The real nodes the model of ``step`` goes to next, through the subgraph inputs and outputs between."""
        graph = self.graphs[step.graph]
        ids = [
            i
            for slot in self.model_outputs(graph, self.node(step))
            for i in self.node(step)["outputs"][slot].get("links") or []
        ]
        return self._follow(step.frame, graph, ids)

    def _follow(self, frame: tuple[int, ...], graph: Graph, ids: list[int]) -> list[Step]:
        found: list[Step] = []
        for link in (graph.links[i] for i in ids if i in graph.links):
            if link.target == SUBGRAPH_OUTPUT:
                if not frame:
                    continue
                outer_frame, outer = frame[:-1], self.graphs[self.frames[frame[:-1]]]
                out = outer.nodes[frame[-1]]["outputs"][link.target_slot]
                found += self._follow(outer_frame, outer, list(out.get("links") or []))
                continue
            target = graph.nodes.get(link.target)
            if target is None:
                continue
            if self.is_subgraph(target):
                inner = self.graphs[target["type"]]
                inner_ids = inner.input_links[link.target_slot] if link.target_slot < len(inner.input_links) else []
                found += self._follow((*frame, link.target), inner, inner_ids)
            else:
                found.append(Step(frame, graph.id, link.target))
        return found

    def paths(self, loader: Step, limit: int = 10_000) -> Iterator[list[Step]]:
        """Every path from ``loader``: its steps, loader first, the node that ends it last (schedulers left out)."""

        def walk(path: list[Step]) -> Iterator[list[Step]]:
            nexts = [c for c in self.consumers(path[-1]) if self.kind(c) != SCHEDULER and c not in path]
            for consumer in nexts:
                if self.kind(consumer) == "patch":
                    yield from walk([*path, consumer])
                else:
                    yield [*path, consumer]

        for count, path in enumerate(walk([loader])):
            if count >= limit:
                raise AssertionError(f"more than {limit} model paths from {loader}")
            yield path

    def parts(self, step: Step) -> bool:
        """Whether the paths part right after ``step``: its model goes to more than one node (schedulers not
        counted)."""
        return len([c for c in self.consumers(step) if self.kind(c) != SCHEDULER]) > 1


def box(node: Mapping[str, Any]) -> tuple[float, float, float, float]:
    """The rectangle a node covers on the canvas, its title bar included: left, top, right, bottom."""
    x, y = node["pos"][0], node["pos"][1]
    width, height = node.get("size", [0, 0])[:2] if not node.get("flags", {}).get("collapsed") else (80, 0)
    return x, y - TITLE_HEIGHT, x + width, y + height


def overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
