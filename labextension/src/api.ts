/**
 * What the dpnb server extension answers (GET /api/dpnb/clusters, see
 * dpnb/lab/clusters.py), and the two helpers every part of the extension uses:
 * the request (through JupyterLab's ServerConnection, which sends the server's
 * token / XSRF cookie: the browser never talks to a kernel or an engine) and
 * DOM elements whose text is always set as text, never as HTML.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IRank {
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
export interface IProfileSummary {
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

/** One step's gradient sync on each shown rank (dpnb/core/labviews.py SyncPanel): each
 * rank's timeline (dpnb/core/synctimeline.py RankTimeline), seconds from its step start. */
export interface ISyncPanel {
  step: number;
  strategy: string;
  world_size: number;
  more_ranks: number;
  ranks: {
    rank: number;
    step_s: number;
    comm_s: number;
    exposed_s: number;
    hidden_s: number;
    segments: { lane: string; start: number; end: number; label: string; queued: boolean }[];
  }[];
}

/** Model-state bytes per rank, measured beside the exact model (MemoryPanel). */
export interface IMemoryPanel {
  strategy: string;
  optimizer: string;
  world_size: number;
  phase: string;
  step: number | null;
  n_params: number;
  mixed_precision: string;
  parts: string[];
  ranks: { rank: number; measured: number[]; predicted: number[] }[];
  more_ranks: number;
}

export interface ICluster {
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
  progress: { step?: number; loss?: number; samples_per_s?: number; step_time_s?: number };
  last_error: string | null;
  last_profile: IProfileSummary | null;
  /** [step, loss, samples/s or null], steps rising */
  curve: [number, number, number | null][];
  gradsync: ISyncPanel | null;
  memory: IMemoryPanel | null;
}

export async function api(path: string, init: RequestInit = {}): Promise<any> {
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

export function el(tag: string, cls: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text !== undefined) {
    node.textContent = text; // never innerHTML: the records' text is data
  }
  return node;
}

export function progressText(c: ICluster): string {
  const p = c.progress || {};
  if (p.step === undefined || p.step === null) {
    return 'no training step yet';
  }
  const loss = typeof p.loss === 'number' ? p.loss.toFixed(4) : '-';
  const sps = typeof p.samples_per_s === 'number' ? p.samples_per_s.toFixed(1) : '-';
  return `step ${p.step} · loss ${loss} · ${sps} samples/s`;
}

/** Seconds as the cell's views write them. */
export function ms(s: number): string {
  return `${(s * 1e3).toFixed(2)} ms`;
}

/** Bytes in the largest unit that keeps the number readable. */
export function bytes(n: number): string {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  let x = n;
  while (Math.abs(x) >= 1024 && i < units.length - 1) {
    x /= 1024;
    i++;
  }
  return i === 0 ? `${n} B` : `${x.toFixed(2)} ${units[i]}`;
}
