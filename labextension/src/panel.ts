/**
 * A cluster's live view as a dockable main-area panel (class ``dpnb-panel``),
 * beside the notebook: it stays when the cell's output is cleared or another
 * notebook is active, because it draws from what the kernel published, polled
 * by the sidebar, not from any cell.  One panel per cluster and view:
 *
 * - ``dashboard``: the cluster's card, loss and samples/s over the steps, the
 *   last step's time, the last profile;
 * - ``gradsync``: the last train call's last recorded step on a timeline;
 * - ``memory``: model-state bytes per rank, measured beside the exact model;
 * - ``profile``: the last profiled cell (stragglers, exposed communication).
 */
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { Widget } from '@lumino/widgets';

import { el, ICluster } from './api';
import { curveSection, memorySection, profileSection, syncSection, throughputSection } from './views';

export type View = 'dashboard' | 'gradsync' | 'memory' | 'profile';
export const VIEWS: { [view in View]: string } = {
  dashboard: 'training dashboard',
  gradsync: 'gradient sync',
  memory: 'memory per rank',
  profile: 'last profile'
};

/** The panel's DOM id (the dashboard's is the one dpnb's first panel had). */
export function panelId(view: View, clusterId: string): string {
  return view === 'dashboard' ? `dpnb-panel-${clusterId}` : `dpnb-panel-${view}-${clusterId}`;
}

type Section = (c: ICluster, rm: IRenderMimeRegistry | null) => HTMLElement;

/** Each view's sections, and the part of the record each one draws (its cache key). */
const SECTIONS: { [view in View]: [string, (c: ICluster) => unknown, Section][] } = {
  dashboard: [
    ['curve', c => c.curve, curveSection],
    ['throughput', c => [c.curve, c.progress && c.progress.step_time_s], throughputSection],
    ['profile', c => c.last_profile, (c, rm) => profileSection(c.last_profile, rm)]
  ],
  gradsync: [['gradsync', c => c.gradsync, (c, rm) => syncSection(c.gradsync, rm)]],
  memory: [['memory', c => c.memory, (c, rm) => memorySection(c.memory, rm)]],
  profile: [['profile', c => c.last_profile, (c, rm) => profileSection(c.last_profile, rm)]]
};

export class ViewPanel extends Widget {
  constructor(readonly clusterId: string, readonly view: View, private rendermime: IRenderMimeRegistry | null) {
    super();
    this.id = panelId(view, clusterId);
    this.title.label = view === 'dashboard' ? `dpnb ${clusterId}` : `dpnb ${VIEWS[view]} · ${clusterId}`;
    this.title.closable = true;
    this.addClass('dpnb-panel');
    this.addClass(`dpnb-panel-${view}`);
  }

  /** Closing the tab ends the panel (a closed Lumino widget is only detached, and
   * the buttons or the palette could not bring it back). */
  protected onCloseRequest(msg: any): void {
    super.onCloseRequest(msg);
    this.dispose();
  }

  /** Draw ``c`` (undefined: the cluster is gone); ``card``: its sidebar card, without
   * buttons, for the dashboard.  A section is built again only when its data changed,
   * not at every poll (a chart redrawn each second would flicker and lose its tooltip). */
  render(c: ICluster | undefined, card: HTMLElement | null): void {
    // unchanged since the last poll: the DOM stays as it is (no churn each second)
    const key = JSON.stringify(c ?? null);
    if (key === this.lastKey) {
      return;
    }
    this.lastKey = key;
    this.node.textContent = '';
    if (!c) {
      this.node.appendChild(el('div', '', `cluster ${this.clusterId} is gone`));
      return;
    }
    if (this.view === 'dashboard' && card) {
      this.node.appendChild(card);
    } else {
      this.node.appendChild(el('h2', '', `${VIEWS[this.view]} · ${c.id} · ${c.world_size} ranks`));
    }
    for (const [name, part, section] of SECTIONS[this.view]) {
      const key = JSON.stringify(part(c) ?? null);
      let drawn = this.drawn.get(name);
      if (!drawn || drawn[0] !== key) {
        drawn = [key, section(c, this.rendermime)];
        this.drawn.set(name, drawn);
      }
      this.node.appendChild(drawn[1]);
    }
  }

  private drawn = new Map<string, [string, HTMLElement]>();
  private lastKey = '';
}
