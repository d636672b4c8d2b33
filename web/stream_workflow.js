// "Stream this workflow's models": one action that puts a Block Offload node on every path from a diffusion model
// loader to what samples with it, in the root graph and inside every subgraph (ComfyUI's official templates keep
// their whole pipeline in one). Each path is walked from the loader through its chain of model patches (LoRA
// loaders, ModelSampling*, anything with one MODEL in and a MODEL out, linked to nothing else), into the subgraphs
// the model goes into and out of those it leaves, to what samples with it (schedulers, which only read it, are
// passed by), and the node goes where the chain ends, before it branches: LoRAs and patches stay upstream of the
// streaming clone, as ComfyUI applies them. The node sits in free space beside the chain. What the action cannot do
// safely (a model that reaches no sampler: a detector's) it leaves as it is and names. The whole edit is one undo
// step.

import { app } from "../../scripts/app.js";

export const COMMAND_ID = "BlockOffload.StreamWorkflowModels";
export const COMMAND_LABEL = "Stream this workflow's models";
export const NODE_SETTING_ID = "BlockOffload.StreamAction.Node";

const MODEL = "MODEL";
// Our nodes by display name, in the order the setting offers them (the first is the default: auto placement).
export const STREAM_NODES = Object.freeze({
  "Partial GPU Residency": "PartialGPUResidency",
  "Async Block Offload": "AsyncBlockOffload",
  "Sequential Offload Wrapper": "SequentialOffloadWrapper",
});
const OUR_TYPES = new Set(Object.values(STREAM_NODES));
// Paths from one loader to its samplers; past this the graph is not a workflow a person drew.
const MAX_PATHS = 4096;
// ComfyUI's group nodes (before subgraphs) register as "workflow>NAME" (older frontends: "workflow/NAME"); their
// inner graph is not editable from outside.
const GROUP_NODE_PREFIXES = ["workflow>", "workflow/"];

function describe(node) {
  return `${node.title || node.type} (#${node.id})`;
}

function linkById(graph, id) {
  if (id == null) return null;
  return (graph.links instanceof Map ? graph.links.get(id) : graph.links?.[id]) ?? null;
}

// A slot carries the model when it is typed MODEL, or when its link is (ComfySwitchNode and Reroute are typed "*").
function modelInputLinks(graph, node) {
  return (node.inputs ?? []).flatMap((input) => {
    const link = linkById(graph, input?.link);
    return input?.type === MODEL || link?.type === MODEL ? [link] : [];
  });
}

function modelOutputSlot(graph, node) {
  const slot = (node.outputs ?? []).findIndex(
    (output) => output?.type === MODEL || (output?.links ?? []).some((id) => linkById(graph, id)?.type === MODEL),
  );
  return slot < 0 ? null : slot;
}

// Where links ``ids`` of ``graph`` lead: {node, slot, graph} per link; node is null where a link leaves the graph
// (a subgraph's output).
function linkTargets(graph, ids) {
  return (ids ?? [])
    .map((id) => linkById(graph, id))
    .filter(Boolean)
    .map((link) => ({ node: graph.getNodeById(link.target_id) ?? null, slot: link.target_slot, graph }));
}

// What an output feeds.
function consumers(graph, node, slot) {
  return linkTargets(graph, node.outputs?.[slot]?.links);
}

// Links from a subgraph's input start at its input node, which has this id.
const SUBGRAPH_INPUT_ID = -10;

// What a subgraph node's input ``slot`` feeds inside its subgraph.
function innerConsumers(subgraphNode, slot) {
  const inner = subgraphNode.subgraph;
  return linkTargets(inner, inner.inputs?.[slot]?.linkIds);
}

function isSubgraphNode(node) {
  return Boolean(node.subgraph) || Boolean(node.isSubgraphNode?.());
}

function isGroupNode(node) {
  return GROUP_NODE_PREFIXES.some((prefix) => String(node.type).startsWith(prefix));
}

// A node that passes on whatever it is given (Reroute, a switch typed "*"): fed by a subgraph's input, its input
// link is typed "*" too, so it must not pass for a loader.
function passesOnItsInput(node) {
  return (node.inputs ?? []).some((input) => input?.type === "*" && input.link != null);
}

// A loader makes a MODEL from nothing upstream: Load Diffusion Model, Load Checkpoint, Unet Loader (GGUF) and any
// other pack's file loader alike.
function isLoader(graph, node) {
  return (
    !isSubgraphNode(node) &&
    modelOutputSlot(graph, node) !== null &&
    modelInputLinks(graph, node).length === 0 &&
    !passesOnItsInput(node)
  );
}

// A model patch takes the model and gives it back changed (LoRA loaders, ModelSampling*, attention patches); a
// switch between the patched and the plain model (the templates' LoRA toggle) and the old Reroute node too.
function isModelPatch(graph, node) {
  return !isSubgraphNode(node) && modelInputLinks(graph, node).length > 0 && modelOutputSlot(graph, node) !== null;
}

// The types a node gives, as the server defines it (``/object_info``), else as its slots say (a node the server
// does not know keeps the slots it was saved with).
function outputTypes(node) {
  return node.constructor?.nodeData?.output ?? (node.outputs ?? []).map((output) => output?.type);
}

// A scheduler reads the model's sampling settings and gives sigmas (BasicScheduler and its kind): it neither
// samples nor parts the model's path, so the node goes past it.
function isScheduler(node) {
  const types = outputTypes(node);
  return types.length > 0 && types.every((type) => type === "SIGMAS");
}

// What samples with the model gives a latent (KSampler, SamplerCustom), or a guider the custom samplers run
// (CFGGuider, BasicGuider, DualCFGGuider and the models' own), or is filed under sampling by the server. A detector
// or a pose model loaded the same way gives masks, boxes or keypoints.
function samples(node) {
  const types = outputTypes(node);
  const category = String(node.constructor?.nodeData?.category ?? "");
  return types.includes("LATENT") || types.includes("GUIDER") || category.split("/").includes("sampling");
}

// Why the model cannot go on to ``consumer``, a node that takes it and gives no MODEL back; null for a sampler.
// (The subgraphs the model goes into or leaves are followed before this is asked.)
function whyNotASampler(consumer) {
  const node = consumer.node;
  if (isSubgraphNode(node)) return `goes into the subgraph ${describe(node)}`;
  if (isGroupNode(node)) return `goes into the group node ${describe(node)}`;
  if (samples(node)) return null;
  if (node.constructor?.nodeData?.output_node) return `goes to ${describe(node)}, which saves the model`;
  return ELSEWHERE;
}
const ELSEWHERE = "elsewhere";

function loaderFile(node) {
  const named = (node.widgets ?? []).find((widget) => /_name$/.test(widget.name) && typeof widget.value === "string");
  return named?.value ?? describe(node);
}

// The loader at the top of a chain of patches ending in ``link``, each of them (the loader too) feeding nothing but
// the next; null where the chain branches, starts elsewhere or mixes models.
function chainLoader(graph, link) {
  let node = link ? graph.getNodeById(link.origin_id) : null;
  while (node) {
    if (consumers(graph, node, modelOutputSlot(graph, node)).length !== 1) return null;
    if (isLoader(graph, node)) return node;
    const inputs = modelInputLinks(graph, node);
    if (!isModelPatch(graph, node) || inputs.length !== 1) return null;
    node = inputs[0] ? graph.getNodeById(inputs[0].origin_id) : null;
  }
  return null;
}

// A merge (ModelMergeSimple and its kind) mixes models into one: where each of its model inputs is such a chain
// from a loader, the node goes after it, on the merged model, which ComfyUI patches with the other models' weights
// as it patches a LoRA's. Its loaders, or null where it is no such merge.
function mergedLoaders(graph, node) {
  const links = modelInputLinks(graph, node);
  if (links.length < 2 || isSubgraphNode(node) || modelOutputSlot(graph, node) === null) return null;
  const loaders = links.map((link) => chainLoader(graph, link));
  return loaders.every(Boolean) ? loaders : null;
}

// Everything downstream of a loader (or a merge of loaders) that still carries its model, into the subgraphs it goes
// into and out of the subgraphs it leaves: the patches (its region's members: a node, a subgraph input the model
// enters, or a subgraph node's output it leaves by), the edges between them (SINK: a sampler), the merges of loaders
// it meets (``merges``), and what stops the action (a model mixed in from elsewhere, a saver).
//
// Each member knows ``via``: the subgraph nodes ({node, graph}) the model went in by, outermost first, so that it
// leaves a subgraph by the node it came in by; a model loaded inside a subgraph leaves by every node using it. Keys
// hold that path, so the same subgraph used twice gives two sets of members and the node goes before both.
const SINK = "sink";

const frames = (via) => via.map((frame) => frame.node.id).join("/");
const nodeKey = (via, graph, id) => `${frames(via)}|${graph.id}:${id}`;
const inputKey = (via, graph, slot) => `${frames(via)}|${graph.id}:input ${slot}`;

// The subgraph nodes ({node, graph}) in the whole workflow that use the subgraph ``definition``.
function usesOf(root, definition) {
  return graphsOf(root).flatMap((graph) =>
    graph.nodes.filter((node) => node.subgraph === definition).map((node) => ({ node, graph })),
  );
}

// LiteGraph's node modes ComfyUI runs nothing in: 2, muted ("never"); 4, bypassed.
const SWITCHED_OFF_MODES = new Set([2, 4]);

// Whether ``node`` of ``graph`` is switched off: muted or bypassed itself, or inside a subgraph whose every use is
// (the templates ship their 4-step variants and second pipelines so).
function switchedOff(root, graph, node) {
  if (SWITCHED_OFF_MODES.has(node.mode)) return true;
  const uses = graph === root ? [] : usesOf(root, graph);
  return uses.length > 0 && uses.every((use) => switchedOff(root, use.graph, use.node));
}

// Whether ``link`` (into a member) comes from the region: a member, or a subgraph input the region enters.
function fromRegion(region, member, link) {
  const { via, graph } = member;
  const fromInput = String(link.origin_id) === String(SUBGRAPH_INPUT_ID);
  return region.members.has(fromInput ? inputKey(via, graph, link.origin_slot) : nodeKey(via, graph, link.origin_id));
}

// What a member's model goes to: {node, slot, graph} per link, node null where it leaves the member's graph.
function fedBy(member) {
  if (member.node) return consumers(member.graph, member.node, modelOutputSlot(member.graph, member.node));
  if (member.input !== undefined) return innerConsumers(member.subgraphNode, member.input);
  return consumers(member.graph, member.subgraphNode, member.output);
}

function traceRegion(root, graph, loader) {
  const start = nodeKey([], graph, loader.id);
  const members = new Map([[start, { graph, node: loader, via: [] }]]);
  const region = { members, edges: new Map(), problems: [], merges: new Map(), streamedBy: null, elsewhere: [] };
  const queue = [start];
  const join = (key, member, next, consumer) => {
    next.push({ key, consumer });
    if (!region.members.has(key)) {
      region.members.set(key, member);
      queue.push(key);
    }
  };
  while (queue.length) {
    const key = queue.shift();
    const member = region.members.get(key);
    const { via } = member;
    const next = [];
    region.edges.set(key, next);
    for (const consumer of fedBy(member)) {
      const node = consumer.node;
      if (!node) {
        // It leaves the subgraph: on by the node it came in by, or by every node using the subgraph it was loaded in.
        const leaves = via.length ? [via[via.length - 1]] : usesOf(root, consumer.graph);
        const outer = via.slice(0, -1);
        for (const use of leaves) {
          const out = { graph: use.graph, subgraphNode: use.node, output: consumer.slot, via: outer };
          join(nodeKey(outer, use.graph, use.node.id), out, next, consumer);
        }
      } else if (OUR_TYPES.has(node.type)) {
        region.streamedBy = node;
      } else if (node.subgraph && isSubgraphNode(node)) {
        const inside = [...via, { node, graph: consumer.graph }];
        const entered = { graph: node.subgraph, input: consumer.slot, subgraphNode: node, via: inside };
        join(inputKey(inside, node.subgraph, consumer.slot), entered, next, consumer);
      } else if (!isSubgraphNode(node) && modelOutputSlot(consumer.graph, node) !== null) {
        // It takes the model and gives a MODEL back: a patch (its input may be typed "*", a Reroute in a subgraph).
        join(nodeKey(via, consumer.graph, node.id), { graph: consumer.graph, node, via }, next, consumer);
      } else if (!isScheduler(node)) {
        const why = whyNotASampler(consumer);
        if (why === ELSEWHERE) region.elsewhere.push(node);
        else if (why) region.problems.push(why);
        else next.push({ key: SINK, consumer });
      }
    }
  }
  for (const [key, member] of region.members) {
    const { graph: where, node } = member;
    const foreign = node && modelInputLinks(where, node).find((link) => link && !fromRegion(region, member, link));
    if (!foreign || key === start) continue;  // a merge traced from itself mixes its inputs, as it should
    if (mergedLoaders(where, node)) region.merges.set(key, { graph: where, node });
    else region.problems.push(`meets another model in ${describe(node)}`);
  }
  return region;
}

// The last place every path from the loader to a sampler passes through: a patch, or a subgraph node's output the
// model leaves by. The node goes right after it, so every patch before it applies to the streamed clone and nothing
// after it branches. A subgraph input is no place to put one after: where the paths part right inside a subgraph,
// the node goes before it, outside. Returns {graph, node, slot, targets}, targets being what the place feeds on the
// way to a sampler (a scheduler or a detector fed there keeps the model as it is), or null.
function lastSharedPlace(region, loaderKey) {
  const paths = [];
  const walk = (key, path) => {
    if (paths.length > MAX_PATHS) return;
    if (key === SINK) {
      paths.push(path);
      return;
    }
    for (const next of region.edges.get(key) ?? []) if (!path.includes(next.key)) walk(next.key, [...path, key]);
  };
  walk(loaderKey, []);
  if (!paths.length || paths.length > MAX_PATHS) return null;
  const isPlace = (key) => region.members.get(key).input === undefined;
  const shared = paths[0].filter((key) => isPlace(key) && paths.every((path) => path.includes(key)));
  const key = shared[shared.length - 1];
  const onward = new Set(paths.map((path) => path[path.indexOf(key) + 1] ?? SINK));
  const targets = region.edges.get(key).filter((next) => onward.has(next.key)).map((next) => next.consumer);
  const member = region.members.get(key);
  return member.node
    ? { graph: member.graph, node: member.node, slot: modelOutputSlot(member.graph, member.node), targets }
    : { graph: member.graph, node: member.subgraphNode, slot: member.output, targets };
}

// Space kept between the node and its neighbours, and the title bar LiteGraph draws above a node's ``pos``.
const GAP = 30;
const titleHeight = () => globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;

// The rectangle ``node`` covers, its title bar included: [left, top, right, bottom].
function boxOf(node, pos = node.pos) {
  const [width, height] = node.size ?? [0, 0];
  return [pos[0], pos[1] - titleHeight(), pos[0] + width, pos[1] + height];
}

function overlaps(a, b) {
  return a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3];
}

function isFree(graph, node, pos) {
  const box = boxOf(node, pos);
  return graph.nodes.every((other) => other === node || !overlaps(box, boxOf(other)));
}

// Where ``node`` goes between ``end`` and what it feeds (``targets``): beside the chain, in free space, where a
// person would put it: right of the end, under or over it, left of the first target, under or over that.
function freeSpotBeside(graph, node, end, targets) {
  const [width, height] = node.size ?? [0, 0];
  const [, top, right, bottom] = boxOf(end);
  const spots = [
    [right + GAP, end.pos[1]],
    [end.pos[0], bottom + GAP + titleHeight()],
    [end.pos[0], top - GAP - height],
  ];
  const first = targets.map((target) => target.node).find((target) => target?.pos);
  if (first) {
    const [targetLeft, targetTop, , targetBottom] = boxOf(first);
    spots.push(
      [targetLeft - GAP - width, first.pos[1]],
      [first.pos[0], targetBottom + GAP + titleHeight()],
      [first.pos[0], targetTop - GAP - height],
    );
  }
  return spots.find((spot) => isFree(graph, node, spot)) ?? null;
}

// No room beside the chain: the node goes right of the end, and whatever lies right of the end (nodes and groups)
// moves over by the node's width, as a person makes room. A group the end sits in widens with it.
function makeRoomRightOf(graph, node, end) {
  const [, , right] = boxOf(end);
  const shift = (node.size?.[0] ?? 0) + 2 * GAP;
  for (const other of graph.nodes) {
    if (other !== node && other.pos[0] >= right) other.pos = [other.pos[0] + shift, other.pos[1]];
  }
  for (const group of graph.groups ?? graph._groups ?? []) {
    const [x, y, width, height] = group._bounding ?? [...group.pos, ...group.size];
    if (x >= right) group.pos = [x + shift, y];
    else if (x + width > right) group.size = [width + shift, height];
  }
  return [right + GAP, end.pos[1]];
}

// A free spot at last (a node spanning the place made room in stays): the nearest on a grid around the end.
function nearestFreeSpot(graph, node, end) {
  const [x, y] = end.pos;
  const step = 2 * GAP;
  for (let ring = 1; ; ring++) {
    for (let along = -ring; along <= ring; along++) {
      for (const side of [-ring, ring]) {
        for (const spot of [[x + along * step, y + side * step], [x + side * step, y + along * step]]) {
          if (isFree(graph, node, spot)) return spot;
        }
      }
    }
  }
}

function place(graph, node, end, targets) {
  let spot = freeSpotBeside(graph, node, end, targets);
  if (!spot) {
    spot = makeRoomRightOf(graph, node, end);
    if (!isFree(graph, node, spot)) spot = nearestFreeSpot(graph, node, end);
  }
  node.pos = spot;
}

// Every node and link id in the workflow, subgraphs included.
function idsInUse(root) {
  const nodes = new Set();
  const links = new Set();
  for (const graph of graphsOf(root)) {
    for (const node of graph.nodes) nodes.add(Number(node.id));
    const all = graph.links instanceof Map ? graph.links.keys() : Object.keys(graph.links ?? {});
    for (const id of all) links.add(Number(id));
    for (const node of graph.nodes) {
      for (const input of node.inputs ?? []) if (input?.link != null) links.add(Number(input.link));
    }
  }
  return { nodes, links };
}

// The ids the next node and link get come from the graph's counters, which a graph saved by another tool can leave
// below ids in use (a new link then takes an old one's id and replaces it): they are raised past every id in use
// first, in the root graph and every subgraph (which share the root's counters where the frontend has subgraphs).
function raiseIdCounters(root) {
  const { nodes, links } = idsInUse(root);
  const highest = (ids) => Math.max(0, ...[...ids].filter(Number.isFinite));
  for (const graph of graphsOf(root)) {
    const state = graph.state;
    if (state) {
      state.lastNodeId = Math.max(Number(state.lastNodeId) || 0, highest(nodes));
      state.lastLinkId = Math.max(Number(state.lastLinkId) || 0, highest(links));
    } else {
      graph.last_node_id = Math.max(Number(graph.last_node_id) || 0, highest(nodes));
      graph.last_link_id = Math.max(Number(graph.last_link_id) || 0, highest(links));
    }
  }
  return { nodes, links };
}

// What each link of the place's graph connects, by id: to check that the insertion changed nothing else.
function linkEnds(graph) {
  const ends = new Map();
  const all = graph.links instanceof Map ? graph.links.values() : Object.values(graph.links ?? {});
  for (const link of all) {
    if (link) ends.set(link.id, `${link.origin_id}:${link.origin_slot}>${link.target_id}:${link.target_slot}`);
  }
  return ends;
}

// Puts a node of ``nodeType`` after ``end``'s output ``slot``, feeding ``targets``. Returns the node, or a reason
// (and nothing changed) where the frontend did not link it as asked.
function insertAfter({ graph, node: end, slot, targets }, nodeType, root) {
  const node = globalThis.LiteGraph.createNode(nodeType);
  if (!node) throw new Error(`ComfyUI does not know the node type ${nodeType}: is Block Offload loaded on the server?`);
  const inUse = raiseIdCounters(root);
  const before = linkEnds(graph);
  graph.add(node);
  place(graph, node, end, targets);
  // Each consumer's input is re-linked to the node (connecting an input replaces its old link), then the end feeds
  // the node.
  const replaced = new Set(targets.map((target) => target.node.inputs?.[target.slot]?.link));
  for (const target of targets) node.connect(0, target.node, target.slot);
  end.connect(slot, node, 0);
  const after = linkEnds(graph);
  const lost = [...before].filter(([id, ends]) => !replaced.has(id) && after.get(id) !== ends);
  const fresh = [...after.keys()].filter((id) => !before.has(id));
  if (inUse.nodes.has(Number(node.id)) || lost.length || fresh.some((id) => inUse.links.has(Number(id)))) {
    graph.remove(node);
    for (const target of targets) end.connect(slot, target.node, target.slot);
    return null;
  }
  return node;
}

function graphsOf(root) {
  return [root, ...(root.subgraphs ? root.subgraphs.values() : [])];
}

// Plans and applies the insertion over the whole workflow. Returns what it did, for the message and the tests:
// streamed (files newly streamed), switchedOff (files given a node in a part of the workflow switched off, which
// stream once it is on), already (files already streamed by one of our nodes), leftAlone ({what, why}).
export function streamWorkflowModels(root, nodeType) {
  const report = { streamed: [], switchedOff: [], already: [], leftAlone: [], inserted: [] };
  const merges = new Map();  // the merges of loaders met, streamed once each after every loader
  const stream = (graph, source, what, off) => {
    const region = traceRegion(root, graph, source);
    if (region.merges.size) {
      for (const [key, merge] of region.merges) merges.set(key, merge);
      return;
    }
    const ours = region.streamedBy;
    if (ours && SWITCHED_OFF_MODES.has(ours.mode)) {
      // Switched off by the user (to compare, say): theirs to switch on, not "already streaming".
      const why = `passes through ${describe(ours)}, which is bypassed or muted: switch it on`;
      report.leftAlone.push({ what, why });
      return;
    }
    if (ours) {
      report.already.push(`${what} (${describe(ours)})`);
      return;
    }
    if (region.problems.length) {
      report.leftAlone.push({ what, why: region.problems[0] });
      return;
    }
    const place = lastSharedPlace(region, nodeKey([], graph, source.id));
    if (!place) {
      const others = [...new Set(region.elsewhere)].map(describe);
      const which = others.length > 1 ? "do" : "does";
      const why = others.length ? `goes only to ${others.join(", ")}, which ${which} not sample` : "feeds no sampler";
      report.leftAlone.push({ what, why });
      return;
    }
    const node = insertAfter(place, nodeType, root);
    if (!node) {
      report.leftAlone.push({ what, why: "could not be given a node without changing another link: left as it was" });
      return;
    }
    report.inserted.push(node);
    (off ? report.switchedOff : report.streamed).push(what);
  };
  for (const graph of graphsOf(root)) {
    for (const node of [...graph.nodes]) {
      if (isGroupNode(node)) {
        report.leftAlone.push({ what: describe(node), why: "is a group node: convert it to a subgraph to stream its model" });
      } else if (isLoader(graph, node)) {
        stream(graph, node, loaderFile(node), switchedOff(root, graph, node));
      }
    }
  }
  for (const { graph, node } of merges.values()) {
    const loaders = mergedLoaders(graph, node);
    const what = `${loaders.map(loaderFile).join(" + ")} (merged in ${describe(node)})`;
    stream(graph, node, what, [node, ...loaders].some((part) => switchedOff(root, graph, part)));
  }
  return report;
}

function message(report, displayName) {
  const lines = [];
  if (report.streamed.length) {
    const n = report.streamed.length;
    const files = [...report.streamed].sort().join(", ");
    lines.push(`${n} model${n > 1 ? "s" : ""} now stream${n > 1 ? "" : "s"} through ${displayName}: ${files}.`);
  }
  if (report.switchedOff.length) {
    const files = [...report.switchedOff].sort().join(", ");
    lines.push(`Switched off (bypassed or muted), given a node to stream once switched on: ${files}.`);
  }
  if (report.already.length) lines.push(`Already streaming, left as they are: ${report.already.join(", ")}.`);
  for (const { what, why } of report.leftAlone) lines.push(`Left as it is: ${what} ${why}.`);
  if (!lines.length) lines.push("This workflow loads no diffusion model: nothing to stream, nothing changed.");
  return lines.join("\n");
}

function chosenNode() {
  const chosen = app.extensionManager?.setting?.get(NODE_SETTING_ID);
  const displayName = chosen in STREAM_NODES ? chosen : Object.keys(STREAM_NODES)[0];
  return { displayName, nodeType: STREAM_NODES[displayName] };
}

// The command: one undo step (the change tracker records the graph once, after the whole edit), one message.
export function runStreamCommand() {
  const { displayName, nodeType } = chosenNode();
  const tracker = app.extensionManager?.workflow?.activeWorkflow?.changeTracker;
  tracker?.beforeChange();
  let report;
  try {
    report = streamWorkflowModels(app.rootGraph ?? app.graph, nodeType);
  } finally {
    tracker?.afterChange();
  }
  app.canvas?.setDirty(true, true);
  const placed = report.streamed.length + report.switchedOff.length;
  const severity = placed ? "success" : report.leftAlone.length ? "warn" : "info";
  app.extensionManager?.toast?.add({ severity, summary: COMMAND_LABEL, detail: message(report, displayName), life: 8000 });
  return report;
}

app.registerExtension({
  name: "block_offload.stream_workflow",
  settings: [
    {
      id: NODE_SETTING_ID,
      category: ["Block Offload", "Stream this workflow's models", "Node"],
      name: "Node that \"Stream this workflow's models\" inserts",
      type: "combo",
      options: Object.keys(STREAM_NODES),
      defaultValue: Object.keys(STREAM_NODES)[0],
    },
  ],
  commands: [{ id: COMMAND_ID, label: COMMAND_LABEL, icon: "pi pi-bolt", function: runStreamCommand }],
  menuCommands: [{ path: ["Extensions", "Block Offload"], commands: [COMMAND_ID] }],
  getCanvasMenuItems() {
    return [null, { content: COMMAND_LABEL, callback: () => runStreamCommand() }];
  },
});
