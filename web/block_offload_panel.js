// Block Offload live panel: a bottom-panel tab of ComfyUI's frontend.
//
// It shows what the pack's engine does while a prompt runs: device memory split into resident
// weights, streaming buffers and the rest; the last step's per-block copy and compute spans on two
// lanes, stalls in a warning colour; the share of copy time hidden behind compute; the effective
// host-to-device bandwidth; which blocks stay on the device. Data comes from the server's
// "block_offload.status" websocket messages (at most four a second) and, when the panel opens or
// the socket reconnects, from GET /block_offload/report (nodes/panel.py documents both).
//
// Cost: a message only replaces the latest state. Drawing happens in an animation frame, only while
// the tab is open and visible, at most once per message; a closed tab does no work at all.
//
// The messages' fields are declared in status_schema.json, beside this file. This file reads them by
// name, on variables named for the message they hold: a status `status` (or `report`), its memory
// `memory`, a step `step` (or `state.lastStep`), a models entry `model`, a span `span`, a read `read`.
// tests/test_panel_schema.py reads the fields used on those names and checks them against the schema:
// keep to these names.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const TAB_ID = "block-offload";
const STATUS_EVENT = "block_offload.status";
const REPORT_PATH = "/block_offload/report";
const TIMELINE_PATH = "/block_offload/timeline?download=1";
const RESIDENT = "R";
const FROM_FILE = "F"; // streamed, read from the checkpoint file at every step (no host buffer)
// The status schema this panel reads (status_schema.json's version); another one is not drawn.
const SCHEMA_VERSION = 1;
// The command web/stream_workflow.js registers (by id, not imported: ComfyUI loads that file as an extension of
// its own, and a second import under another URL would register it twice).
const STREAM_COMMAND_ID = "BlockOffload.StreamWorkflowModels";

const COLORS = {
  resident: "#4f8fd6",
  streaming: "#3fb68b",
  other: "#a77bd8",
  file: "#c77d4f",
  copy: "#d6a23f",
  read: "#8d6e63",
  compute: "#4f8fd6",
  computeStreamed: "#3fb68b",
  stall: "#e5533d",
};

// The latest state, kept whether or not the tab is open: cheap to keep, ready when it opens.
const state = {
  status: null, // the last status message or report
  lastStep: null, // the last step timeline received (messages carry one only when a step finished)
  lastStepPrompt: null, // the prompt that step belongs to
  seq: -1,
  messages: 0, // websocket messages received
  stepsReceived: 0, // of which carried a finished step
  reports: 0, // reports fetched
  connected: true,
  error: null,
};

let view = null; // the mounted panel, or null while the tab is closed

function applyStatus(status) {
  if (status.v !== SCHEMA_VERSION) {
    state.error =
      `The server sends status version ${status.v}; this panel reads version ${SCHEMA_VERSION}. ` +
      "Reload the page to get the panel of the pack the server runs.";
    view?.schedule();
    return;
  }
  state.status = status;
  state.seq = status.seq;
  if (status.last_step) {
    state.lastStep = status.last_step;
    state.lastStepPrompt = status.prompt_id;
  }
  view?.schedule();
}

async function fetchReport() {
  try {
    const response = await api.fetchApi(REPORT_PATH, { cache: "no-store" });
    if (!response.ok) throw new Error(`GET ${REPORT_PATH} answered ${response.status}`);
    const report = await response.json();
    state.error = null;
    state.reports += 1;
    if (report.seq >= state.seq) applyStatus(report); // else a message overtook it
  } catch (error) {
    state.error = String(error.message ?? error);
  }
  view?.schedule();
}

api.addEventListener(STATUS_EVENT, (event) => {
  const status = event.detail;
  state.messages += 1;
  if (status.last_step) state.stepsReceived += 1;
  applyStatus(status);
});
api.addEventListener("reconnecting", () => {
  state.connected = false;
  view?.schedule();
});
api.addEventListener("reconnected", () => {
  // The server may have restarted: its message counter starts over.
  state.connected = true;
  state.seq = -1;
  fetchReport();
});

// -- formatting ----------------------------------------------------------------------------------

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 ? 0 : value < 10 ? 2 : 1)} ${units[unit]}`;
}

function ms(value) {
  if (value === null || value === undefined) return "–";
  return value >= 100 ? `${value.toFixed(0)} ms` : `${value.toFixed(value >= 10 ? 1 : 2)} ms`;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const STYLE = `
.bo-panel { display: flex; flex-direction: column; gap: 6px; height: 100%; box-sizing: border-box; padding: 6px 10px;
  font: 12px/1.35 system-ui, sans-serif; color: var(--fg-color); overflow: hidden; }
.bo-head { display: flex; align-items: baseline; gap: 12px; flex-wrap: wrap; }
.bo-title { font-weight: 600; }
.bo-stream { font: inherit; padding: 1px 8px; cursor: pointer; }
.bo-dim { color: var(--descrip-text, #999); }
.bo-body { display: flex; gap: 14px; flex: 1; min-height: 0; }
.bo-side { width: 300px; flex: none; display: flex; flex-direction: column; gap: 6px; overflow-y: auto; }
.bo-main { flex: 1; min-width: 0; display: flex; flex-direction: column; gap: 4px; }
.bo-bar { display: flex; height: 14px; border-radius: 3px; overflow: hidden; background: var(--comfy-input-bg, #222);
  border: 1px solid var(--border-color, #4e4e4e); }
.bo-bar > div { height: 100%; }
.bo-legend { display: flex; flex-wrap: wrap; gap: 4px 10px; }
.bo-legend span::before { content: ""; display: inline-block; width: 9px; height: 9px; margin-right: 4px;
  border-radius: 2px; background: var(--swatch); vertical-align: -1px; }
.bo-figures { display: grid; grid-template-columns: repeat(4, auto); gap: 2px 12px; justify-content: start; }
.bo-figure b { display: block; font-size: 15px; font-weight: 600; }
.bo-notices { color: #e8a33d; }
.bo-notices div::before { content: "⚠ "; }
.bo-empty { padding: 8px 0; max-width: 70ch; }
.bo-timeline { flex: 1; min-height: 90px; width: 100%; }
.bo-placement { height: 16px; width: 100%; display: block; margin: 2px 0 4px; }
.bo-panel a { color: inherit; }
.bo-panel [hidden] { display: none !important; }
`;

// -- the panel -----------------------------------------------------------------------------------

class PanelView {
  constructor(container) {
    this.container = container;
    this.frame = 0;
    this.draws = 0;
    this.build();
    this.resize = new ResizeObserver(() => this.schedule());
    this.resize.observe(this.root);
    this.onVisibility = () => this.schedule();
    document.addEventListener("visibilitychange", this.onVisibility);
  }

  build() {
    if (!document.getElementById("bo-panel-style")) {
      const style = el("style");
      style.id = "bo-panel-style";
      style.textContent = STYLE;
      document.head.append(style);
    }
    const root = el("div", "bo-panel");
    root.dataset.testid = "block-offload-panel";
    const head = el("div", "bo-head");
    this.title = el("span", "bo-title", "Block Offload");
    this.headline = el("span");
    this.planLine = el("span", "bo-dim");
    this.streamButton = el("button", "bo-stream", "Stream this workflow's models");
    this.streamButton.dataset.testid = "block-offload-stream";
    this.streamButton.title = "Puts the streaming node on every model path of the open workflow (one Ctrl+Z undoes it)";
    this.streamButton.addEventListener("click", () => app.extensionManager.command.execute(STREAM_COMMAND_ID));
    head.append(this.title, this.streamButton, this.headline, this.planLine);

    this.empty = el("div", "bo-empty bo-dim");
    const body = el("div", "bo-body");
    const side = el("div", "bo-side");
    this.memoryTitle = el("div");
    this.bar = el("div", "bo-bar");
    this.memoryLegend = el("div", "bo-legend bo-dim");
    this.figures = el("div", "bo-figures");
    this.placements = el("div", "bo-placements");
    this.notices = el("div", "bo-notices");
    this.download = el("a", "bo-dim", "Download the run's timeline (JSON)");
    this.download.href = api.apiURL(TIMELINE_PATH);
    this.download.download = "block_offload_timeline.json";
    side.append(
      this.memoryTitle,
      this.bar,
      this.memoryLegend,
      this.figures,
      this.placements,
      this.notices,
      this.download,
    );
    const main = el("div", "bo-main");
    this.stepLine = el("div", "bo-dim");
    const legend = el("div", "bo-legend bo-dim");
    for (const [label, color] of [
      ["copy to device", COLORS.copy],
      ["compute, resident block", COLORS.compute],
      ["compute, streamed block", COLORS.computeStreamed],
      ["stall (compute waits for its copy)", COLORS.stall],
    ]) {
      const item = el("span", null, label);
      item.style.setProperty("--swatch", color);
      legend.append(item);
    }
    this.timeline = el("canvas", "bo-timeline");
    this.timeline.dataset.testid = "block-offload-timeline";
    main.append(this.stepLine, legend, this.timeline);
    body.append(side, main);
    this.body = body;
    root.append(head, this.empty, body);
    this.root = root;
    this.container.replaceChildren(root);
  }

  visible() {
    return !document.hidden && this.root.isConnected && this.root.offsetParent !== null;
  }

  schedule() {
    if (this.frame || !this.visible()) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      if (this.visible()) this.draw();
    });
  }

  destroy() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.resize.disconnect();
    document.removeEventListener("visibilitychange", this.onVisibility);
    this.root.remove();
  }

  draw() {
    const started = performance.now();
    this.draws += 1;
    const status = state.status;
    const data = this.root.dataset;
    data.draws = this.draws;
    data.messages = state.messages;
    data.stepsReceived = state.stepsReceived;
    data.reports = state.reports;
    data.prompt = status?.prompt_id ?? "";
    data.lastStep = state.lastStep?.step ?? "";
    const ran = Boolean(status?.node);
    data.state = !state.connected ? "disconnected" : !ran ? "empty" : status.running ? "running" : "idle";

    this.drawHeadline(status, ran);
    this.empty.hidden = ran;
    this.body.hidden = !ran && !status;
    if (!ran) this.drawEmpty(status);
    this.drawMemory(status);
    this.drawFigures(ran ? state.lastStep : null);
    this.drawPlacement(ran ? status : null);
    this.notices.replaceChildren(...(status?.notices ?? []).map((text) => el("div", null, text)));
    this.download.hidden = !ran;
    data.blocksDrawn = this.drawTimeline(ran ? state.lastStep : null, status);
    data.drawMs = (performance.now() - started).toFixed(2); // the main thread's cost of one draw
  }

  drawHeadline(status, ran) {
    if (!state.connected) {
      this.headline.textContent = "reconnecting to ComfyUI…";
    } else if (state.error) {
      this.headline.textContent = state.error;
    } else if (!ran) {
      this.headline.textContent = "";
    } else if (status.running) {
      const step = status.step === null ? "starting" : `step ${status.step + 1}`;
      const block = status.block === null ? "" : `, block ${status.block} of ${status.blocks}`;
      this.headline.textContent = `● running ${status.node}: ${step}${block}`;
    } else {
      this.headline.textContent = `last run: ${status.node}, ${status.steps_done} steps`;
    }
    this.planLine.textContent = ran ? status.plan : "";
    this.planLine.title = ran ? status.plan : "";
  }

  drawEmpty(status) {
    const device = status && !status.accelerator ? " No accelerator: this ComfyUI computes on the CPU." : "";
    this.empty.textContent =
      "Nothing has streamed yet. Queue a workflow with an Async Block Offload, Partial GPU Residency or " +
      "Sequential Offload Wrapper node: this panel then shows device memory, the copy and compute of every " +
      "block in each step, and which blocks stay on the device." +
      device;
  }

  drawMemory(status) {
    const memory = status?.memory;
    if (!memory) {
      this.memoryTitle.textContent = "";
      this.bar.replaceChildren();
      this.memoryLegend.replaceChildren();
      return;
    }
    let total;
    let parts;
    if (status.accelerator && memory.total) {
      total = memory.total;
      const reservedOnly = Math.max(0, (memory.reserved ?? 0) - (memory.allocated ?? 0));
      const outside = Math.max(0, total - (memory.free ?? 0) - (memory.reserved ?? 0));
      this.memoryTitle.textContent =
        `${status.device}: ${bytes(memory.allocated)} allocated, ${bytes(memory.reserved)} reserved, ` +
        `${bytes(memory.free)} free of ${bytes(total)}; ${bytes(memory.pinned_host)} of RAM pinned for streaming`;
      parts = [
        ["resident weights", memory.resident_weights, COLORS.resident],
        ["streaming buffers", memory.streaming_buffers, COLORS.streaming],
        ["activations & other", memory.other, COLORS.other],
        ["cached by torch", reservedOnly, "#6b6b6b"],
        ["other processes", outside, "#8a5a3a"],
      ];
    } else {
      total = memory.host_total;
      this.memoryTitle.textContent =
        `No accelerator: process memory ${bytes(memory.process_rss)} of ${bytes(total)} RAM` +
        (status.node ? `; the model's resident weights ${bytes(memory.resident_weights)}, ` +
          `streamed blocks ${bytes(status.streamed_host_bytes)} in host memory` : "");
      parts = [["process memory (RSS)", memory.process_rss, COLORS.other]];
    }
    this.bar.replaceChildren(
      ...parts
        .filter(([, value]) => value)
        .map(([label, value, color]) => {
          const segment = el("div");
          segment.style.width = `${Math.min(100, (100 * value) / total)}%`;
          segment.style.background = color;
          segment.title = `${label}: ${bytes(value)}`;
          return segment;
        }),
    );
    this.memoryLegend.replaceChildren(
      ...parts.map(([label, value, color]) => {
        const item = el("span", null, `${label} ${bytes(value)}`);
        item.style.setProperty("--swatch", color);
        return item;
      }),
    );
  }

  drawFigures(step) {
    const figure = (label, value, title) => {
      const node = el("div", "bo-figure bo-dim", label);
      node.prepend(el("b", null, value));
      node.title = title;
      return node;
    };
    if (!step) {
      this.figures.replaceChildren();
      return;
    }
    const overlap = step.copy_ms > 0 ? `${(100 * step.overlap).toFixed(0)}%` : "–";
    const bandwidth = step.bandwidth_gbps === null ? "–" : `${step.bandwidth_gbps.toFixed(1)} GB/s`;
    this.figures.replaceChildren(
      figure("overlap", overlap, "share of the copy time hidden behind compute"),
      figure("host→device", bandwidth, "bytes copied / time the copies took"),
      figure("step", ms(step.duration_ms), "the last step's duration"),
      figure("stall", ms(step.stall_ms), "time compute waited for copies"),
    );
  }

  drawPlacement(status) {
    // One strip per streaming model (per node); the run shown when its model is no longer loaded.
    let models = status?.models ?? [];
    if (!models.length && status?.placement) {
      const { node, placement, prefetch, ring_bytes, pinned, running } = status;
      models = [{ node, placement, prefetch, ring_bytes, pinned, running }];
    }
    const rows = models.map((model) => {
      const resident = [...model.placement].filter((p) => p === RESIDENT).length;
      const fromFile = [...model.placement].filter((p) => p === FROM_FILE).length;
      const title = el(
        "div",
        "bo-dim",
        `${model.node}: ${resident} of ${model.placement.length} blocks resident, ` +
          `${model.placement.length - resident} streamed ` +
          (fromFile ? `(${fromFile} read from the checkpoint file each step) ` : "") +
          `(${model.ring_bytes ? `through a ${bytes(model.ring_bytes)} ring` : `prefetch ${model.prefetch}`}` +
          `${model.pinned ? ", pinned" : ""})` +
          (model.pinning ? `; packing in the background: ${model.pinning}` : ""),
      );
      return [title, el("canvas", "bo-placement"), model];
    });
    this.placements.replaceChildren(...rows.flatMap(([title, canvas]) => [title, canvas]));
    for (const [, canvas, model] of rows) {
      const ctx = sized(canvas);
      if (!ctx) continue;
      const { width, height } = ctx.canvas.cssSize;
      const placement = model.placement;
      const cell = width / placement.length;
      for (let i = 0; i < placement.length; i++) {
        ctx.fillStyle =
          placement[i] === RESIDENT ? COLORS.resident : placement[i] === FROM_FILE ? COLORS.file : COLORS.streaming;
        ctx.fillRect(i * cell, 0, Math.max(1, cell - (cell > 4 ? 1 : 0)), height);
      }
      const current = model.running && status.running && model.node === status.node;
      if (current && status.block !== null && status.block < placement.length) {
        ctx.strokeStyle = getComputedStyle(this.root).color;
        ctx.lineWidth = 2;
        ctx.strokeRect(status.block * cell + 1, 1, Math.max(2, cell - 2), height - 2);
      }
    }
  }

  drawTimeline(step, status) {
    const ctx = sized(this.timeline);
    if (!ctx) return 0;
    const { width, height } = ctx.canvas.cssSize;
    const fg = getComputedStyle(this.root).color;
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    if (!step) {
      ctx.fillStyle = fg;
      ctx.globalAlpha = 0.6;
      ctx.fillText("The timeline of the last step appears here once a step has run.", 8, height / 2);
      ctx.globalAlpha = 1;
      this.stepLine.textContent = "";
      return 0;
    }
    const fields = Object.fromEntries(step.span_fields.map((name, i) => [name, i]));
    const spans = step.spans.map((row) => Object.fromEntries(Object.entries(fields).map(([k, i]) => [k, row[i]])));
    const placement = status?.placement ?? "";
    // The step's own time; a prefetch issued during the step before is cut at 0.
    const start = 0;
    let end = step.duration_ms;
    let early = false;
    for (const span of spans) {
      early ||= span.copy_start !== null && span.copy_start < 0;
      end = Math.max(end, span.compute_end, span.copy_end ?? 0);
    }
    const other = state.lastStepPrompt && status?.prompt_id !== state.lastStepPrompt ? " (an earlier prompt)" : "";
    // File-tier reads (timed on the host, from the host's start of the step) get a lane above the copies.
    const readFields = Object.fromEntries((step.read_fields ?? []).map((name, i) => [name, i]));
    const reads = (step.reads ?? []).map((row) =>
      Object.fromEntries(Object.entries(readFields).map(([k, i]) => [k, row[i]])),
    );
    for (const read of reads) end = Math.max(end, read.end);
    this.stepLine.textContent =
      `step ${step.step + 1}${other}: ${ms(step.duration_ms)}, ${spans.length} block calls, ` +
      `${bytes(step.bytes_copied)} copied in ${ms(step.copy_ms)}` +
      (reads.length ? `, ${bytes(step.bytes_read)} read from the file (${step.read_gbps} GB/s)` : "") +
      (early ? "; copies cut at 0 began during the step before (prefetch)" : "");

    const gutter = 62;
    const axis = 16;
    const laneCount = reads.length ? 3 : 2;
    const laneHeight = Math.max(14, Math.min(56, (height - axis - 12) / laneCount));
    const lanes = reads.length
      ? { read: 4, copy: 8 + laneHeight, compute: 12 + 2 * laneHeight }
      : { copy: 4, compute: 8 + laneHeight };
    const x = (t) => gutter + ((t - start) / (end - start || 1)) * (width - gutter - 6);
    ctx.fillStyle = fg;
    ctx.globalAlpha = 0.75;
    if (reads.length) ctx.fillText("read", 4, lanes.read + laneHeight / 2);
    ctx.fillText("copy", 4, lanes.copy + laneHeight / 2);
    ctx.fillText("compute", 4, lanes.compute + laneHeight / 2);
    ctx.globalAlpha = 1;

    const label = (text, x0, x1, y) => {
      if (x1 - x0 < 14) return;
      ctx.fillStyle = "#fff";
      ctx.textAlign = "center";
      ctx.fillText(text, (x0 + x1) / 2, y + laneHeight / 2);
      ctx.textAlign = "left";
    };
    for (const read of reads) {
      if (read.end <= start) continue;
      const x0 = x(Math.max(start, read.start));
      const x1 = Math.max(x0 + 1, x(read.end));
      ctx.fillStyle = COLORS.read;
      ctx.fillRect(x0, lanes.read, x1 - x0, laneHeight);
      label(String(read.block), x0, x1, lanes.read);
    }
    for (const span of spans) {
      if (span.copy_start !== null && span.copy_end > start) {
        const x0 = x(Math.max(start, span.copy_start));
        const x1 = Math.max(x0 + 1, x(span.copy_end));
        ctx.fillStyle = COLORS.copy;
        ctx.fillRect(x0, lanes.copy, x1 - x0, laneHeight);
        label(String(span.block), x0, x1, lanes.copy);
      }
      const streamed = placement[span.block] !== undefined && placement[span.block] !== RESIDENT;
      const x0 = x(span.compute_start);
      const x1 = Math.max(x0 + 1, x(span.compute_end));
      ctx.fillStyle = streamed ? COLORS.computeStreamed : COLORS.compute;
      ctx.fillRect(x0, lanes.compute, x1 - x0, laneHeight);
      label(String(span.block), x0, x1, lanes.compute);
      if (span.stall > 0) {
        const s0 = x(span.compute_start - span.stall);
        ctx.fillStyle = COLORS.stall;
        ctx.fillRect(s0, lanes.compute + laneHeight - 4, Math.max(2, x0 - s0), 4);
      }
    }

    // The time axis, with a tick at a round number of milliseconds.
    const top = lanes.compute + laneHeight + 4;
    ctx.strokeStyle = fg;
    ctx.globalAlpha = 0.5;
    ctx.beginPath();
    ctx.moveTo(gutter, top);
    ctx.lineTo(width - 6, top);
    const tick = niceStep((end - start) / 8);
    ctx.fillStyle = fg;
    ctx.textAlign = "center";
    for (let t = Math.ceil(start / tick) * tick; t <= end; t += tick) {
      ctx.moveTo(x(t), top);
      ctx.lineTo(x(t), top + 4);
      ctx.fillText(`${+t.toFixed(3)} ms`, x(t), top + 11);
    }
    ctx.stroke();
    ctx.textAlign = "left";
    ctx.globalAlpha = 1;
    return spans.length;
  }
}

function niceStep(rough) {
  const power = 10 ** Math.floor(Math.log10(rough || 1));
  for (const factor of [1, 2, 5, 10]) if (factor * power >= rough) return factor * power;
  return 10 * power;
}

// A 2D context scaled to the canvas's CSS size (sharp on high-DPI screens), cleared.
function sized(canvas) {
  const rect = canvas.getBoundingClientRect();
  if (rect.width < 2 || rect.height < 2) return null;
  const ratio = window.devicePixelRatio || 1;
  const width = Math.round(rect.width * ratio);
  const height = Math.round(rect.height * ratio);
  if (canvas.width !== width || canvas.height !== height) {
    canvas.width = width;
    canvas.height = height;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, rect.width, rect.height);
  canvas.cssSize = { width: rect.width, height: rect.height };
  return ctx;
}

app.registerExtension({
  name: "block_offload.panel",
  bottomPanelTabs: [
    {
      id: TAB_ID,
      title: "Block Offload",
      type: "custom",
      render(container) {
        view?.destroy();
        view = new PanelView(container);
        view.schedule();
        fetchReport();
      },
      destroy() {
        view?.destroy();
        view = null;
      },
    },
  ],
});
