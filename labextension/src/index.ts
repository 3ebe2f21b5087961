/**
 * dpnb in JupyterLab: a sidebar listing every dpnb cluster of this user on this
 * server (ranks, training progress, last error, actions) and a status bar item
 * (ranks alive / total, step, a red mark on failure).
 *
 * Both poll the dpnb server extension (GET /api/dpnb/clusters, about once a
 * second) through JupyterLab's ServerConnection, which sends the server's
 * token / XSRF cookie: the browser never talks to a kernel or an engine for
 * this.  The server reads the clusters' own records (see dpnb/lab/clusters.py).
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { Dialog, ICommandPalette, WidgetTracker, showDialog } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { IRenderMimeRegistry, MimeModel } from '@jupyterlab/rendermime';
import { ServerConnection } from '@jupyterlab/services';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

const PLUGIN_ID = 'dpnb:plugin';
/** Polling when the settings say nothing (schema/plugin.json's defaults). */
const DEFAULTS = { pollInterval: 1000, confirmStop: true };
/** Actions that end what the ranks hold: asked about first (setting confirmStop). */
const CONFIRM: { [action: string]: string } = {
  stop: 'Stop',
  restart: 'Restart',
  'restart-resume': 'Restart --resume'
};

interface IRank {
  rank: number;
  host: string;
  pid: number;
  device: string;
  alive: boolean;
  rss_mb: number | null;
  gpu_mb: number | null;
}

/** The last profiled cell, as the kernel published it (dpnb/core/profilesummary.py):
 * the sentences the cell's view prints, two numbers per rank, where the traces are. */
interface IProfileSummary {
  folder: string;
  merged: string;
  what: string;
  at: number;
  world_size: number;
  profiled_ranks: number;
  straggler: string | null;
  clock: string;
  failure: string;
  lines: string[];
  ranks: { rank: number; compute_s: number; exposed_s: number }[];
  more_ranks: number;
}

interface ICluster {
  id: string;
  source: string;
  kernel_id: string | null;
  kept: boolean;
  holder: number | null;
  stops_in_s: number | null;
  backend: string;
  ranks: IRank[];
  world_size: number;
  alive: number;
  progress: { step?: number; loss?: number; samples_per_s?: number };
  last_error: string | null;
  last_profile: IProfileSummary | null;
  curve: [number, number][];
}

const icon = new LabIcon({
  name: 'dpnb:clusters',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
    '<circle cx="6" cy="6" r="3"/><circle cx="18" cy="6" r="3"/><circle cx="6" cy="18" r="3"/>' +
    '<circle cx="18" cy="18" r="3"/><rect x="11" y="3" width="2" height="18"/>' +
    '<rect x="3" y="11" width="18" height="2"/></g></svg>'
});

async function api(path: string, init: RequestInit = {}): Promise<any> {
  const settings = ServerConnection.makeSettings();
  const base = URLExt.join(settings.baseUrl, 'api', 'dpnb', 'clusters');
  const url = path ? URLExt.join(base, path) : base;
  const response = await ServerConnection.makeRequest(url, init, settings);
  const text = await response.text();
  const data = text ? JSON.parse(text) : {};
  if (!response.ok) {
    throw new Error(data.message || `${response.status} ${response.statusText}`);
  }
  return data;
}

function el(tag: string, cls: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text !== undefined) {
    node.textContent = text; // never innerHTML: the records' text is data
  }
  return node;
}

function progressText(c: ICluster): string {
  const p = c.progress || {};
  if (p.step === undefined || p.step === null) {
    return 'no training step yet';
  }
  const loss = typeof p.loss === 'number' ? p.loss.toFixed(4) : '-';
  const sps = typeof p.samples_per_s === 'number' ? p.samples_per_s.toFixed(1) : '-';
  return `step ${p.step} · loss ${loss} · ${sps} samples/s`;
}

function ms(s: number): string {
  return `${(s * 1e3).toFixed(2)} ms`; // as the cell's view writes them
}

/** The last profile's summary: the view's sentences (the straggler's marked), each
 * rank's compute and exposed communication, the folder and the merged trace's name. */
function profileSection(p: IProfileSummary): HTMLElement {
  const box = el('div', 'dpnb-profile');
  const when = new Date(p.at * 1000).toLocaleTimeString();
  box.appendChild(el('h3', '', `Last profile (${p.what}, ${when})`));
  if (p.failure) {
    box.appendChild(el('div', 'dpnb-error', p.failure));
  }
  for (const line of p.lines) {
    const cls = line === p.straggler ? 'dpnb-profile-straggler' : 'dpnb-profile-line';
    box.appendChild(el('div', cls, line));
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

const VEGALITE = 'application/vnd.vegalite.v5+json';

/** The loss curve as a Vega-Lite chart (axes titled "step" and "loss", drawn as SVG
 * by JupyterLab's own Vega renderer through the rendermime registry); null where
 * that renderer is not there (then the plain line below is drawn). */
function vegaCurve(curve: [number, number][], rendermime: IRenderMimeRegistry | null): HTMLElement | null {
  if (!rendermime || rendermime.mimeTypes.indexOf(VEGALITE) < 0) {
    return null;
  }
  const spec = {
    $schema: 'https://vega.github.io/schema/vega-lite/v5.json',
    width: 320,
    height: 140,
    data: { values: curve.map(([step, loss]) => ({ step, loss })) },
    mark: { type: 'line', point: curve.length <= 50, tooltip: true },
    encoding: {
      x: { field: 'step', type: 'quantitative', title: 'step', axis: { tickMinStep: 1 } },
      y: { field: 'loss', type: 'quantitative', title: 'loss', scale: { zero: false } }
    }
  };
  const renderer = rendermime.createRenderer(VEGALITE);
  const model = new MimeModel({
    data: { [VEGALITE]: spec } as any,
    metadata: { [VEGALITE]: { embed_options: { renderer: 'svg', actions: false } } } as any
  });
  renderer.renderModel(model).catch(e => console.warn('dpnb: loss chart not drawn:', e));
  return renderer.node;
}

/** The loss curve the kernel publishes (the latest steps, from the run's start or
 * the step it resumed at): a Vega-Lite chart, or an SVG line with its step and loss ranges. */
function curveSection(curve: [number, number][], rendermime: IRenderMimeRegistry | null = null): HTMLElement {
  const box = el('div', 'dpnb-curve');
  if (!curve.length) {
    box.appendChild(el('div', '', 'no loss curve yet: train a few steps'));
    return box;
  }
  const steps = curve.map(([s]) => s);
  const losses = curve.map(([, l]) => l);
  const [s0, s1] = [Math.min(...steps), Math.max(...steps)];
  const [l0, l1] = [Math.min(...losses), Math.max(...losses)];
  const title = `loss, steps ${s0}–${s1} (${curve.length} points): ${l1.toFixed(4)} → ${losses[losses.length - 1].toFixed(4)}, min ${l0.toFixed(4)}`;
  const chart = vegaCurve(curve, rendermime);
  if (chart) {
    box.appendChild(el('div', 'dpnb-curve-title', title));
    box.appendChild(chart);
    return box;
  }
  const W = 320;
  const H = 120;
  const x = (s: number) => (s1 > s0 ? ((s - s0) / (s1 - s0)) * W : W / 2);
  const y = (l: number) => (l1 > l0 ? H - ((l - l0) / (l1 - l0)) * H : H / 2);
  const ns = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(ns, 'svg');
  svg.setAttribute('viewBox', `-4 -4 ${W + 8} ${H + 8}`);
  svg.setAttribute('width', `${W + 8}`);
  svg.setAttribute('height', `${H + 8}`);
  const line = document.createElementNS(ns, 'polyline');
  line.setAttribute('points', curve.map(([s, l]) => `${x(s).toFixed(1)},${y(l).toFixed(1)}`).join(' '));
  line.setAttribute('fill', 'none');
  line.setAttribute('stroke', 'var(--jp-brand-color1, #1976d2)');
  line.setAttribute('stroke-width', '1.5');
  svg.appendChild(line);
  box.appendChild(el('div', 'dpnb-curve-title', title));
  box.appendChild(svg);
  return box;
}

/** A cluster's live view in the main area, beside the notebook: its card (ranks,
 * progress, last error), its loss curve and the last profile's summary. */
class ClusterPanel extends Widget {
  constructor(readonly clusterId: string, private rendermime: IRenderMimeRegistry | null = null) {
    super();
    this.id = `dpnb-panel-${clusterId}`;
    this.title.label = `dpnb ${clusterId}`;
    this.title.closable = true;
    this.addClass('dpnb-panel');
  }

  private curveKey = '';
  private curveBox: HTMLElement | null = null;

  /** Closing the tab ends the panel (a closed Lumino widget is only detached, and
   * Panel or the palette could not bring it back). */
  protected onCloseRequest(msg: any): void {
    super.onCloseRequest(msg);
    this.dispose();
  }

  render(c: ICluster | undefined, card: HTMLElement | null): void {
    this.node.textContent = '';
    if (!c || !card) {
      this.node.appendChild(el('div', '', `cluster ${this.clusterId} is gone`));
      return;
    }
    this.node.appendChild(card);
    // the chart is drawn again only when the curve changed (not at every poll)
    const key = JSON.stringify(c.curve || []);
    if (key !== this.curveKey || !this.curveBox) {
      this.curveKey = key;
      this.curveBox = curveSection(c.curve || [], this.rendermime);
    }
    this.node.appendChild(this.curveBox);
    if (c.last_profile) {
      this.node.appendChild(profileSection(c.last_profile));
    }
  }
}

class Sidebar extends Widget {
  constructor(
    private tracker: INotebookTracker | null,
    private app: JupyterFrontEnd,
    private panelTracker: WidgetTracker<ClusterPanel>,
    private rendermime: IRenderMimeRegistry | null = null
  ) {
    super();
    this.id = 'dpnb-sidebar';
    this.title.icon = icon;
    this.title.caption = 'dpnb clusters';
    this.addClass('dpnb-sidebar');
    this.node.appendChild(el('h2', '', 'dpnb clusters'));
    this.list = el('div', 'dpnb-list', 'loading...');
    this.message = el('div', 'dpnb-message');
    this.node.appendChild(this.startForm());
    this.node.appendChild(this.list);
    this.node.appendChild(this.message);
  }

  /** Ask before an action that ends what the ranks hold (setting confirmStop). */
  confirm = DEFAULTS.confirmStop;
  /** The clusters of the last poll. */
  clusters: ICluster[] = [];

  render(clusters: ICluster[]): void {
    this.clusters = clusters;
    const key = JSON.stringify(clusters);
    if (key === this.last) {
      return; // unchanged: keep the DOM (and a pressed button) as it is
    }
    this.last = key;
    this.list.textContent = '';
    if (!clusters.length) {
      this.list.appendChild(el('div', '', 'No dpnb cluster. Start one above, or in a notebook: %dp start -n 2'));
    }
    for (const c of clusters) {
      this.list.appendChild(this.card(c));
    }
    for (const [id, panel] of this.panels) {
      const c = clusters.find(x => x.id === id);
      panel.render(c, c ? this.card(c, false) : null);
    }
  }

  /** Open (or show) cluster ``id``'s panel in the main area, split beside the notebook;
   * the layout restorer opens it again after a reload (the tracker remembers it). */
  openPanel(id: string): ClusterPanel {
    let panel = this.panels.get(id);
    if (!panel || panel.isDisposed) {
      panel = new ClusterPanel(id, this.rendermime);
      this.panels.set(id, panel);
      panel.disposed.connect(() => this.panels.delete(id));
      const nb = this.tracker ? this.tracker.currentWidget : null;
      this.app.shell.add(panel, 'main', nb ? { mode: 'split-right', ref: nb.id } : {});
      void this.panelTracker.add(panel);
      const c = this.clusters.find(x => x.id === id);
      if (c) {
        panel.render(c, this.card(c, false));
      }
      this.last = ''; // render it again at the next poll
    }
    this.app.shell.activateById(panel.id);
    return panel;
  }

  /** The cluster a command without an id means: the current notebook's, else the only one. */
  current(id?: string): ICluster | null {
    if (id) {
      return this.clusters.find(c => c.id === id) || null;
    }
    const nb = this.tracker ? this.tracker.currentWidget : null;
    const kernel = nb && nb.sessionContext.session ? nb.sessionContext.session.kernel : null;
    const mine = kernel ? this.clusters.find(c => c.kernel_id === kernel.id) : undefined;
    if (mine) {
      return mine;
    }
    return this.clusters.length === 1 ? this.clusters[0] : null;
  }

  /** A command's action on the current cluster (see ``current``), or why there is none. */
  async command(action: string, id?: string): Promise<void> {
    const c = this.current(id);
    if (!c) {
      this.app.shell.activateById(this.id);
      this.message.textContent = this.clusters.length
        ? `${action}: which cluster? Use a card's buttons below`
        : `${action}: no dpnb cluster`;
      return;
    }
    if (action === 'attach') {
      return this.attach(c.id);
    }
    if (action === 'panel') {
      this.openPanel(c.id);
      return;
    }
    return this.act(c.id, action);
  }

  /** The sidebar's Start form, focused. */
  focusStart(): void {
    this.app.shell.activateById(this.id);
    const n = this.node.querySelector('.dpnb-start-n') as HTMLInputElement | null;
    if (n) {
      n.focus();
    }
  }

  private card(c: ICluster, withActions = true): HTMLElement {
    const box = el('div', 'dpnb-cluster');
    box.dataset.clusterId = c.id;
    box.appendChild(el('div', 'dpnb-cluster-head', `${c.id} · ${c.world_size} ranks`));
    const who = c.holder ? `kernel ${c.holder}` : `free, stops in ${Math.round(c.stops_in_s || 0)} s`;
    box.appendChild(
      el('div', 'dpnb-cluster-meta',
        `${c.backend} · ${c.alive}/${c.world_size} alive · ${c.kept ? 'kept, ' : ''}${who}`)
    );
    for (const r of c.ranks) {
      const gpu = typeof r.gpu_mb === 'number' ? ` · GPU ${Math.round(r.gpu_mb)} MB` : '';
      const mem = (typeof r.rss_mb === 'number' ? ` · ${Math.round(r.rss_mb)} MB` : '') + gpu;
      const state = (r.alive ? 'alive' : 'dead') + mem;
      const row = el('div', 'dpnb-rank' + (r.alive ? '' : ' dpnb-dead'),
        `rank ${r.rank} · ${r.host} · pid ${r.pid} · ${r.device} · ${state}`);
      box.appendChild(row);
    }
    box.appendChild(el('div', 'dpnb-progress', progressText(c)));
    if (c.last_error) {
      box.appendChild(el('div', 'dpnb-error', `last error: ${c.last_error}`));
    }
    if (!withActions) {
      return box;
    }
    const actions = el('div', 'dpnb-actions');
    actions.appendChild(this.button('Interrupt', () => this.act(c.id, 'interrupt')));
    actions.appendChild(this.button('Stop', () => this.act(c.id, 'stop')));
    actions.appendChild(this.button('Restart', () => this.act(c.id, 'restart')));
    actions.appendChild(this.button('Restart --resume', () => this.act(c.id, 'restart-resume')));
    actions.appendChild(this.button('Attach', () => this.attach(c.id)));
    actions.appendChild(this.button('Panel', () => this.openPanel(c.id)));
    box.appendChild(actions);
    return box;
  }

  /** Start: a kept cluster of N ranks (POST /api/dpnb/clusters/start), free for
   * any notebook's %dp attach; ssh hosts (HOST=N ...) or Slurm settings
   * (KEY=VALUE ...) are checked by the server as %dp start checks them and
   * started in the current notebook (the server answers the line to run). */
  private startForm(): HTMLElement {
    const form = el('form', 'dpnb-start') as HTMLFormElement;
    const n = el('input', 'dpnb-start-n') as HTMLInputElement;
    n.type = 'number';
    n.min = '1';
    n.value = '2';
    n.title = 'ranks';
    const launcher = el('select', 'dpnb-start-launcher') as HTMLSelectElement;
    for (const name of ['local', 'ssh', 'slurm']) {
      const opt = el('option', '', name) as HTMLOptionElement;
      opt.value = name;
      launcher.appendChild(opt);
    }
    const extra = el('input', 'dpnb-start-extra') as HTMLInputElement;
    extra.placeholder = 'ssh: node1=2 node2=2 · slurm: queue=gpu';
    const go = el('button', 'jp-mod-styled', 'Start') as HTMLButtonElement;
    go.type = 'submit';
    go.dataset.action = 'start';
    form.append(el('span', '', 'ranks '), n, launcher, extra, go);
    form.onsubmit = (ev: Event) => {
      ev.preventDefault();
      const body: any = { n: Number(n.value), launcher: launcher.value };
      if (launcher.value === 'ssh') {
        body.hosts = extra.value;
      } else if (launcher.value === 'slurm') {
        body.slurm = Object.fromEntries(
          extra.value.split(/\s+/).filter(kv => kv).map(kv => [kv.split('=')[0], kv.split('=').slice(1).join('=')])
        );
      }
      void this.start(body, go);
    };
    return form;
  }

  private async start(body: any, go: HTMLButtonElement): Promise<void> {
    go.disabled = true;
    this.message.textContent = `starting ${body.n} ranks (${body.launcher})...`;
    try {
      const out = await api('start', { method: 'POST', body: JSON.stringify(body) });
      if (out.in_kernel) {
        await this.runInNotebook(out.code, out.message);
      } else {
        this.message.textContent = out.message;
      }
    } catch (e) {
      this.message.textContent = `start: ${(e as Error).message}`;
    } finally {
      go.disabled = false;
    }
  }

  private button(label: string, onClick: () => void): HTMLElement {
    const b = el('button', 'jp-mod-styled', label) as HTMLButtonElement;
    b.dataset.action = label.toLowerCase().replace(' --', '-');
    b.onclick = onClick;
    return b;
  }

  async act(id: string, action: string): Promise<void> {
    if (this.confirm && CONFIRM[action]) {
      const c = this.clusters.find(x => x.id === id);
      const n = c ? `${c.world_size} ranks` : 'its ranks';
      const result = await showDialog({
        title: `${CONFIRM[action]} dpnb cluster ${id}?`,
        body: action === 'stop'
          ? `Its ${n} end, and what they hold (models, optimizer state) is lost.`
          : `Its ${n} are replaced; what they hold is lost unless --resume rebuilds it.`,
        buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: CONFIRM[action] })]
      });
      if (!result.button.accept) {
        this.message.textContent = `${action} ${id}: cancelled`;
        return;
      }
    }
    this.message.textContent = `${action} ${id}...`;
    try {
      const out = await api(`${id}/${action}`, { method: 'POST' });
      this.message.textContent = out.message || `${action} ${id}: done`;
    } catch (e) {
      this.message.textContent = `${action} ${id}: ${(e as Error).message}`;
    }
  }

  /** ssh or Slurm: the checked %dp start line, run in the current notebook (its
   * kernel holds the engines' connections; the cluster is that notebook's). */
  private async runInNotebook(code: string, message: string): Promise<void> {
    const panel = this.tracker ? this.tracker.currentWidget : null;
    if (!panel) {
      this.message.textContent = `open a notebook, then run: ${code}`;
      return;
    }
    NotebookActions.insertBelow(panel.content);
    const cell = panel.content.activeCell;
    if (cell) {
      cell.model.sharedModel.setSource(code);
    }
    this.message.textContent = message;
    await NotebookActions.run(panel.content, panel.sessionContext);
  }

  async attach(id: string): Promise<void> {
    try {
      const out = await api(`${id}/attach-code`, { method: 'POST' });
      const panel = this.tracker ? this.tracker.currentWidget : null;
      if (!panel) {
        this.message.textContent = `open a notebook, then run: ${out.code}`;
        return;
      }
      NotebookActions.insertBelow(panel.content);
      const cell = panel.content.activeCell;
      if (cell) {
        cell.model.sharedModel.setSource(out.code);
      }
      this.message.textContent = `inserted "${out.code}" in ${panel.title.label}`;
    } catch (e) {
      this.message.textContent = `attach ${id}: ${(e as Error).message}`;
    }
  }

  private list: HTMLElement;
  private message: HTMLElement;
  private panels = new Map<string, ClusterPanel>();
  private last = '';
}

class StatusItem extends Widget {
  constructor() {
    super();
    this.id = 'dpnb-status';
    this.node.title = 'dpnb: ranks alive / total, training step';
  }

  render(clusters: ICluster[]): void {
    this.node.textContent = '';
    if (!clusters.length) {
      this.node.textContent = 'dpnb: no cluster';
      return;
    }
    const alive = clusters.reduce((n, c) => n + c.alive, 0);
    const total = clusters.reduce((n, c) => n + c.world_size, 0);
    const steps = clusters.map(c => c.progress && c.progress.step).filter(s => typeof s === 'number');
    const step = steps.length ? ` · step ${Math.max(...(steps as number[]))}` : '';
    const failed = clusters.some(c => c.last_error || c.alive < c.world_size);
    if (failed) {
      this.node.appendChild(el('span', 'dpnb-status-fail', '● '));
    }
    this.node.appendChild(el('span', '', `dpnb ${alive}/${total} ranks${step}`));
    this.node.classList.toggle('dpnb-failed', failed);
  }
}

/** The palette's dpnb commands: [id, label, action on the current cluster]. */
const ACTIONS: [string, string, string][] = [
  ['dpnb:open-panel', 'Open the cluster panel (live view)', 'panel'],
  ['dpnb:interrupt', 'Interrupt the cluster', 'interrupt'],
  ['dpnb:stop', 'Stop the cluster', 'stop'],
  ['dpnb:restart', 'Restart the cluster', 'restart'],
  ['dpnb:restart-resume', 'Restart the cluster --resume', 'restart-resume'],
  ['dpnb:attach', 'Attach the cluster in this notebook', 'attach']
];

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'A sidebar and a status bar item for every dpnb cluster of this server',
  autoStart: true,
  optional: [INotebookTracker, IStatusBar, ICommandPalette, ILayoutRestorer, ISettingRegistry,
    IRenderMimeRegistry],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker | null,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    settings: ISettingRegistry | null,
    rendermime: IRenderMimeRegistry | null
  ) => {
    const panels = new WidgetTracker<ClusterPanel>({ namespace: 'dpnb-panel' });
    const sidebar = new Sidebar(tracker, app, panels, rendermime);
    app.shell.add(sidebar, 'left', { rank: 900 });
    const status = new StatusItem();
    if (statusBar) {
      statusBar.registerStatusItem('dpnb:status', { item: status, align: 'left', rank: 4 });
    }

    app.commands.addCommand('dpnb:show-clusters', {
      label: 'Show dpnb clusters',
      execute: () => app.shell.activateById(sidebar.id)
    });
    app.commands.addCommand('dpnb:start', {
      label: 'Start a dpnb cluster…',
      execute: () => sidebar.focusStart()
    });
    for (const [id, label, action] of ACTIONS) {
      app.commands.addCommand(id, {
        label: args => (args.id ? `${label} ${args.id}` : label),
        execute: args => {
          // the restorer opens a panel again before the first poll: by its id, as saved
          if (action === 'panel' && args.id) {
            return sidebar.openPanel(String(args.id));
          }
          return sidebar.command(action, args.id ? String(args.id) : undefined);
        }
      });
    }
    if (palette) {
      for (const id of ['dpnb:show-clusters', 'dpnb:start', ...ACTIONS.map(a => a[0])]) {
        palette.addItem({ command: id, category: 'dpnb' });
      }
    }
    if (restorer) {
      restorer.add(sidebar, 'dpnb-sidebar');
      void restorer.restore(panels, {
        command: 'dpnb:open-panel',
        args: panel => ({ id: panel.clusterId }),
        name: panel => panel.clusterId
      });
    }

    // Poll: standby while the tab is hidden; on errors it backs off (up to 30 s)
    const poll = new Poll({
      auto: true,
      factory: async () => {
        try {
          const data = await api('');
          sidebar.render(data.clusters);
          status.render(data.clusters);
        } catch (e) {
          status.node.textContent = 'dpnb: server extension not answering';
          throw e; // rejected: the next poll waits longer
        }
      },
      frequency: { interval: DEFAULTS.pollInterval, backoff: true, max: 30 * 1000 },
      name: 'dpnb:clusters',
      standby: 'when-hidden'
    });
    if (settings) {
      const apply = (s: ISettingRegistry.ISettings) => {
        const interval = Number(s.get('pollInterval').composite) || DEFAULTS.pollInterval;
        poll.frequency = { interval, backoff: true, max: 30 * 1000 };
        sidebar.confirm = s.get('confirmStop').composite !== false;
      };
      settings.load(PLUGIN_ID).then(s => {
        apply(s);
        s.changed.connect(apply);
      }).catch(e => console.warn('dpnb: settings not loaded, defaults kept:', e));
    }
  }
};

export default plugin;
