/**
 * dpnb in JupyterLab: a sidebar listing every dpnb cluster of this user on this
 * server (ranks, training progress, last error, actions), a status bar item
 * (ranks alive / total, step, a red mark on failure), and each cluster's live
 * views as dockable panels beside the notebook (training dashboard, gradient
 * sync, memory per rank, last profile), with every action in the command
 * palette under "dpnb", the sidebar and panels restored after a reload, and
 * settings (poll interval, confirm before Stop / Restart).
 *
 * All of it polls the dpnb server extension (GET /api/dpnb/clusters, once a
 * second by default) through JupyterLab's ServerConnection, which sends the
 * server's token / XSRF cookie: the browser never talks to a kernel or an
 * engine for this.  The server reads the records the kernels publish (see
 * dpnb/lab/clusters.py and dpnb/cluster/publish.py).
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, WidgetTracker } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Poll } from '@lumino/polling';

import { api } from './api';
import { View, ViewPanel, VIEWS } from './panel';
import { Sidebar, StatusItem } from './sidebar';

const PLUGIN_ID = 'dpnb:plugin';
/** Polling when the settings say nothing (schema/plugin.json's default). */
const POLL_MS = 1000;

/** The palette's dpnb commands: [id, label, action on the current cluster]. */
const ACTIONS: [string, string, string][] = [
  ['dpnb:open-panel', 'Open the training dashboard', 'dashboard'],
  ['dpnb:open-gradsync', 'Open the gradient sync of the last step', 'gradsync'],
  ['dpnb:open-memory', 'Open the memory per rank', 'memory'],
  ['dpnb:open-profile', 'Open the last profile', 'profile'],
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
    const panels = new WidgetTracker<ViewPanel>({ namespace: 'dpnb-panel' });
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
          if (action in VIEWS && args.id) {
            return sidebar.openPanel(String(args.id), (args.view as View) || (action as View));
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
        args: panel => ({ id: panel.clusterId, view: panel.view }),
        // the dashboard's name is the one dpnb's first panel saved (a workspace keeps it)
        name: panel => (panel.view === 'dashboard' ? panel.clusterId : `${panel.view}-${panel.clusterId}`)
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
      frequency: { interval: POLL_MS, backoff: true, max: 30 * 1000 },
      name: 'dpnb:clusters',
      standby: 'when-hidden'
    });
    if (settings) {
      const apply = (s: ISettingRegistry.ISettings) => {
        const interval = Number(s.get('pollInterval').composite) || POLL_MS;
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
