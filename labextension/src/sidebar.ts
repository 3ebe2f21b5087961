/**
 * The sidebar (every dpnb cluster of this user on this server: ranks, training
 * progress, last error, actions, the Start form, buttons that open each live
 * view) and the status bar item (ranks alive / total, step, a red mark on
 * failure).  Both render what the plugin's poll of the server extension
 * returns; actions go to the server extension, which acts on the cluster's
 * processes or answers the line to run in the notebook.
 */
import { JupyterFrontEnd } from '@jupyterlab/application';
import { Dialog, WidgetTracker, showDialog } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { api, el, ICluster, progressText } from './api';
import { panelId, View, ViewPanel, VIEWS } from './panel';

/** Asked about first when the setting confirmStop is on (the default). */
export const CONFIRM_DEFAULT = true;
/** Actions that end what the ranks hold: asked about first (setting confirmStop). */
const CONFIRM: { [action: string]: string } = {
  stop: 'Stop',
  restart: 'Restart',
  'restart-resume': 'Restart --resume'
};

export const icon = new LabIcon({
  name: 'dpnb:clusters',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
    '<circle cx="6" cy="6" r="3"/><circle cx="18" cy="6" r="3"/><circle cx="6" cy="18" r="3"/>' +
    '<circle cx="18" cy="18" r="3"/><rect x="11" y="3" width="2" height="18"/>' +
    '<rect x="3" y="11" width="18" height="2"/></g></svg>'
});

export class Sidebar extends Widget {
  constructor(
    private tracker: INotebookTracker | null,
    private app: JupyterFrontEnd,
    private panelTracker: WidgetTracker<ViewPanel>,
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
  confirm = CONFIRM_DEFAULT;
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
    for (const panel of this.panels.values()) {
      const c = clusters.find(x => x.id === panel.clusterId);
      panel.render(c, c && panel.view === 'dashboard' ? this.card(c, false) : null);
    }
  }

  /** Open (or show) cluster ``id``'s ``view`` in the main area, split beside the notebook;
   * the layout restorer opens it again after a reload (the tracker remembers it). */
  openPanel(id: string, view: View = 'dashboard'): ViewPanel {
    const key = panelId(view, id);
    let panel = this.panels.get(key);
    if (!panel || panel.isDisposed) {
      panel = new ViewPanel(id, view, this.rendermime);
      this.panels.set(key, panel);
      panel.disposed.connect(() => this.panels.delete(key));
      // the first panel splits the notebook's area; the others join it as tabs
      const open = [...this.panels.values()].find(p => p !== panel && !p.isDisposed && p.isAttached);
      const nb = this.tracker ? this.tracker.currentWidget : null;
      this.app.shell.add(panel, 'main', open ? { mode: 'tab-after', ref: open.id }
        : nb ? { mode: 'split-right', ref: nb.id } : {});
      void this.panelTracker.add(panel);
      const c = this.clusters.find(x => x.id === id);
      if (c) {
        panel.render(c, view === 'dashboard' ? this.card(c, false) : null);
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
    if (action in VIEWS) {
      this.openPanel(c.id, action as View);
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
    box.appendChild(actions);
    // the live views, each a panel beside the notebook
    const views = el('div', 'dpnb-actions dpnb-views');
    views.appendChild(this.button('Panel', () => this.openPanel(c.id, 'dashboard')));
    views.appendChild(this.button('Grad sync', () => this.openPanel(c.id, 'gradsync'), 'gradsync'));
    views.appendChild(this.button('Memory', () => this.openPanel(c.id, 'memory'), 'memory'));
    views.appendChild(this.button('Profile', () => this.openPanel(c.id, 'profile'), 'profile'));
    box.appendChild(views);
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

  private button(label: string, onClick: () => void, action?: string): HTMLElement {
    const b = el('button', 'jp-mod-styled', label) as HTMLButtonElement;
    b.dataset.action = action || label.toLowerCase().replace(' --', '-');
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
  private panels = new Map<string, ViewPanel>();
  private last = '';
}

export class StatusItem extends Widget {
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

