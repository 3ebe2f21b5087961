/**
 * The sections of dpnb's panels, each from what one kernel published about its
 * cluster (dpnb/cluster/publish.py) and nothing else: the loss and throughput
 * over the steps, the last step's gradient sync on a timeline, model-state
 * memory per rank against the exact model, the last profile.  Numbers are
 * always written as text too; charts come from ./charts (Vega-Lite).
 */
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';

import { bytes, el, ICluster, IMemoryPanel, IProfileSummary, ISyncPanel, ms } from './api';
import { chart, groupedBars, stepLine, timeline } from './charts';

type Rm = IRenderMimeRegistry | null;

const LANES: { [lane: string]: string } = {
  forward: 'forward',
  backward: 'backward',
  all_reduce: 'all-reduce',
  all_gather: 'all-gather',
  reduce_scatter: 'reduce-scatter',
  optimizer: 'optimizer'
};
const PART_LABELS: { [part: string]: string } = {
  params: 'parameters',
  grads: 'gradients',
  optimizer: 'optimizer state'
};

function empty(box: HTMLElement, text: string): HTMLElement {
  box.appendChild(el('div', 'dpnb-empty', text));
  return box;
}

/** The loss over the steps the kernel published (from the run's start, or the step it
 * resumed at), with its step and loss ranges as text. */
export function curveSection(c: ICluster, rendermime: Rm): HTMLElement {
  const box = el('div', 'dpnb-curve');
  const curve = c.curve || [];
  if (!curve.length) {
    return empty(box, 'no loss curve yet: train a few steps');
  }
  const steps = curve.map(p => p[0]);
  const losses = curve.map(p => p[1]);
  const [s0, s1] = [Math.min(...steps), Math.max(...steps)];
  const l0 = Math.min(...losses);
  box.appendChild(el('div', 'dpnb-curve-title',
    `loss, steps ${s0}–${s1} (${curve.length} points): ${losses[0].toFixed(4)} → ` +
    `${losses[losses.length - 1].toFixed(4)}, min ${l0.toFixed(4)}`));
  const drawn = chart(stepLine(curve.map(([step, y]) => ({ step, y })), 'loss'), rendermime, 'loss');
  if (drawn) {
    box.appendChild(drawn);
  }
  return box;
}

/** Samples per second over the steps, and the step time (the last step's while a call
 * runs, the call's mean once it ended). */
export function throughputSection(c: ICluster, rendermime: Rm): HTMLElement {
  const box = el('div', 'dpnb-throughput');
  const pts = (c.curve || []).filter(p => typeof p[2] === 'number').map(p => ({ step: p[0], y: p[2] as number }));
  const p = c.progress || {};
  const last = typeof p.step_time_s === 'number' ? `step time ${ms(p.step_time_s)}` : 'no step timed yet';
  if (!pts.length) {
    return empty(box, `throughput: ${last}`);
  }
  const ys = pts.map(x => x.y);
  box.appendChild(el('div', 'dpnb-throughput-title',
    `samples/s, steps ${pts[0].step}–${pts[pts.length - 1].step}: last ${ys[ys.length - 1].toFixed(1)}, ` +
    `median ${ys.slice().sort((a, b) => a - b)[Math.floor(ys.length / 2)].toFixed(1)} · ${last}`));
  const drawn = chart(stepLine(pts, 'samples/s'), rendermime, 'throughput');
  if (drawn) {
    box.appendChild(drawn);
  }
  return box;
}

/** The last train call's last recorded step: each shown rank's lanes on one time axis,
 * and per rank how much communication the step waited for. */
export function syncSection(s: ISyncPanel | null, rendermime: Rm): HTMLElement {
  const box = el('div', 'dpnb-gradsync');
  if (!s) {
    return empty(box, 'no recorded step yet: train a few steps (without --no-record)');
  }
  box.appendChild(el('h3', '', `Gradient sync, step ${s.step} (${s.strategy}, ${s.world_size} ranks)`));
  const values: any[] = [];
  for (const r of s.ranks) {
    for (const b of r.segments) {
      values.push({ row: `rank ${r.rank} · ${LANES[b.lane] || b.lane}`, lane: LANES[b.lane] || b.lane,
        start: b.start * 1e3, end: b.end * 1e3, label: b.label, queued: b.queued });
    }
  }
  const drawn = chart(timeline(values, { x: 'time from step start (ms)', y: 'rank · lane' }), rendermime,
    'gradient sync');
  if (drawn) {
    box.appendChild(drawn);
  }
  for (const r of s.ranks) {
    box.appendChild(el('div', 'dpnb-gradsync-rank',
      `rank ${r.rank}: step ${ms(r.step_s)} · communication ${ms(r.comm_s)}, ` +
      `exposed ${ms(r.exposed_s)}, hidden under backward ${ms(r.hidden_s)}`));
  }
  if (s.more_ranks) {
    box.appendChild(el('div', '', `and ${s.more_ranks} more ranks (%dp gradsync shows them)`));
  }
  return box;
}

/** Each shown rank's parameters, gradients and optimizer state: measured from the
 * tensors beside the exact model's bytes, with the difference. */
export function memorySection(m: IMemoryPanel | null, rendermime: Rm): HTMLElement {
  const box = el('div', 'dpnb-memory');
  if (!m) {
    return empty(box, 'no model-state bytes yet: wrap a model and train a step');
  }
  const when = m.phase === 'after_step' ? `right after optimizer.step() of step ${m.step}` : 'between steps';
  box.appendChild(el('h3', '', `Memory per rank (${m.strategy}, ${m.optimizer}, ${m.world_size} ranks, ${when})`));
  // the axis in the unit of the largest rank's total (a course's model holds KiB, an LLM's GiB)
  const top = Math.max(1, ...m.ranks.map(r => Math.max(r.measured.reduce((a, b) => a + b, 0),
    r.predicted.reduce((a, b) => a + b, 0))));
  const [div, unit] = top >= 2 ** 30 ? [2 ** 30, 'GiB'] : top >= 2 ** 20 ? [2 ** 20, 'MiB'] : [2 ** 10, 'KiB'];
  const values: any[] = [];
  for (const r of m.ranks) {
    m.parts.forEach((part, i) => {
      for (const [kind, n] of [['measured', r.measured[i]], ['predicted', r.predicted[i]]] as [string, number][]) {
        values.push({ rank: `rank ${r.rank}`, kind, part: PART_LABELS[part] || part, size: n / div, bytes: n });
      }
    });
  }
  const drawn = chart(groupedBars(values, 'rank', 'kind', 'size', 'part',
    { x: 'rank (measured, predicted lighter)', y: `model states (${unit})`, color: 'part' },
    "datum.kind === 'predicted'"), rendermime, 'memory');
  if (drawn) {
    box.appendChild(drawn);
  }
  const table = el('table', 'dpnb-memory-ranks');
  const head = el('tr', '');
  head.append(el('th', '', 'rank'), el('th', '', 'part'), el('th', '', 'measured'), el('th', '', 'predicted'),
    el('th', '', 'difference'));
  table.appendChild(head);
  for (const r of m.ranks) {
    m.parts.forEach((part, i) => {
      const tr = el('tr', '');
      const d = r.measured[i] - r.predicted[i];
      tr.append(el('td', '', `rank ${r.rank}`), el('td', '', PART_LABELS[part] || part),
        el('td', '', bytes(r.measured[i])), el('td', '', bytes(r.predicted[i])),
        el('td', d === 0 ? '' : 'dpnb-error', d === 0 ? 'exact' : `${d > 0 ? '+' : ''}${d} B`));
      table.appendChild(tr);
    });
  }
  if (m.more_ranks) {
    table.appendChild(el('caption', '', `and ${m.more_ranks} more ranks (%dp memory shows them)`));
  }
  box.appendChild(table);
  return box;
}

/** The last profile's summary: the view's sentences (the straggler's marked), each
 * rank's compute and exposed communication (a chart and a table), where the traces are. */
export function profileSection(p: IProfileSummary | null, rendermime: Rm = null): HTMLElement {
  const box = el('div', 'dpnb-profile');
  if (!p) {
    return empty(box, 'no profiled cell yet: run a cell with %%dp --profile');
  }
  const when = new Date(p.at * 1000).toLocaleTimeString();
  box.appendChild(el('h3', '', `Last profile (${p.what}, ${when})`));
  if (p.failure) {
    box.appendChild(el('div', 'dpnb-error', p.failure));
  }
  for (const line of p.lines) {
    box.appendChild(el('div', line === p.straggler ? 'dpnb-profile-straggler' : 'dpnb-profile-line', line));
  }
  if (rendermime) {
    const values = p.ranks.flatMap(r => [
      { rank: `rank ${r.rank}`, what: 'compute', ms: r.compute_s * 1e3 },
      { rank: `rank ${r.rank}`, what: 'exposed communication', ms: r.exposed_s * 1e3 }]);
    const drawn = chart(groupedBars(values, 'rank', 'what', 'ms', 'what',
      { x: 'rank', y: 'time (ms)', color: 'per rank' }), rendermime, 'profile');
    if (drawn) {
      box.appendChild(drawn);
    }
  }
  const table = el('table', 'dpnb-profile-ranks');
  const head = el('tr', '');
  head.append(el('th', '', 'rank'), el('th', '', 'compute'), el('th', '', 'exposed comm'));
  table.appendChild(head);
  for (const r of p.ranks) {
    const tr = el('tr', '');
    tr.append(el('td', '', `rank ${r.rank}`), el('td', '', ms(r.compute_s)), el('td', '', ms(r.exposed_s)));
    table.appendChild(tr);
  }
  if (p.more_ranks) {
    table.appendChild(el('caption', '', `and ${p.more_ranks} more ranks (in the cell's view)`));
  }
  box.appendChild(table);
  const files = el('div', 'dpnb-profile-files');
  const perfetto = el('a', '', 'ui.perfetto.dev') as HTMLAnchorElement;
  perfetto.href = 'https://ui.perfetto.dev';
  perfetto.target = '_blank';
  perfetto.rel = 'noopener';
  files.append(el('span', '', `folder: ${p.folder} · merged trace: ${p.merged} (open it in `), perfetto,
    el('span', '', ')'));
  box.appendChild(files);
  return box;
}
