// "Stream this workflow's models": one action that puts a Block Offload node on every path from a diffusion model
// loader to what samples with it, in the root graph and inside every subgraph (ComfyUI's official templates keep
// their whole pipeline in one). Each path is walked from the loader through its chain of model patches (LoRA
// loaders, ModelSampling*, anything with one MODEL in and a MODEL out, linked to nothing else), into the subgraphs
// the model goes into and out of those it leaves, and the node goes where the chain ends, before it branches: LoRAs
// and patches stay upstream of the streaming clone, as ComfyUI applies them. What the action cannot do safely it
// leaves as it is and names. The whole edit is one undo step.

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

// What samples with the model uses it and gives something else (a latent, a guider, sigmas). A node that saves the
// model or sits in another graph is not that (the subgraphs the model goes into or leaves are followed before this
// is asked).
function whyNotASampler(consumer) {
  const node = consumer.node;
  if (isSubgraphNode(node)) return `goes into the subgraph ${describe(node)}`;
  if (isGroupNode(node)) return `goes into the group node ${describe(node)}`;
  if (node.constructor?.nodeData?.output_node) return `goes to ${describe(node)}, which saves the model`;
  return null;
}

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
  const region = { members, edges: new Map(), problems: [], merges: new Map(), streamedBy: null };
  const queue = [start];
  const join = (key, member, next) => {
    next.push(key);
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
          join(nodeKey(outer, use.graph, use.node.id), out, next);
        }
      } else if (OUR_TYPES.has(node.type)) {
        region.streamedBy = node;
      } else if (node.subgraph && isSubgraphNode(node)) {
        const inside = [...via, { node, graph: consumer.graph }];
        const entered = { graph: node.subgraph, input: consumer.slot, subgraphNode: node, via: inside };
        join(inputKey(inside, node.subgraph, consumer.slot), entered, next);
      } else if (!isSubgraphNode(node) && modelOutputSlot(consumer.graph, node) !== null) {
        // It takes the model and gives a MODEL back: a patch (its input may be typed "*", a Reroute in a subgraph).
        join(nodeKey(via, consumer.graph, node.id), { graph: consumer.graph, node, via }, next);
      } else {
        const why = whyNotASampler(consumer);
        if (why) region.problems.push(why);
        else next.push(SINK);
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
// the node goes before it, outside. Returns {graph, node, slot}, or null.
function lastSharedPlace(region, loaderKey) {
  const paths = [];
  const walk = (key, path) => {
    if (paths.length > MAX_PATHS) return;
    if (key === SINK) {
      paths.push(path);
      return;
    }
    for (const next of region.edges.get(key) ?? []) if (!path.includes(next)) walk(next, [...path, key]);
  };
  walk(loaderKey, []);
  if (!paths.length || paths.length > MAX_PATHS) return null;
  const isPlace = (key) => region.members.get(key).input === undefined;
  const shared = paths[0].filter((key) => isPlace(key) && paths.every((path) => path.includes(key)));
  const member = region.members.get(shared[shared.length - 1]);
  return member.node
    ? { graph: member.graph, node: member.node, slot: modelOutputSlot(member.graph, member.node) }
    : { graph: member.graph, node: member.subgraphNode, slot: member.output };
}

function placeBelow(node, end) {
  const [x, y] = end.pos ?? [0, 0];
  const height = end.size?.[1] ?? 80;
  node.pos = [x, y + height + 60];
}

function insertAfter({ graph, node: end, slot }, nodeType) {
  const node = globalThis.LiteGraph.createNode(nodeType);
  if (!node) throw new Error(`ComfyUI does not know the node type ${nodeType}: is Block Offload loaded on the server?`);
  const targets = consumers(graph, end, slot);
  graph.add(node);
  placeBelow(node, end);
  // Each consumer's input is re-linked to the node (connecting an input replaces its old link), then the end feeds
  // the node.
  for (const target of targets) node.connect(0, target.node, target.slot);
  end.connect(slot, node, 0);
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
      report.leftAlone.push({ what, why: "feeds no sampler" });
      return;
    }
    report.inserted.push(insertAfter(place, nodeType));
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
