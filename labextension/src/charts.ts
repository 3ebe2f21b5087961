/**
 * Charts drawn by JupyterLab's own Vega-Lite renderer (the one that shows
 * Altair's output in notebooks), reached through the rendermime registry: the
 * extension builds a Vega-Lite spec from the data the kernel published and
 * hands it over; it draws no chart itself.  SVG, so the axes' titles are
 * text in the page (and in a screenshot's accessibility tree).
 */
import { IRenderMimeRegistry, MimeModel } from '@jupyterlab/rendermime';

export const VEGALITE = 'application/vnd.vegalite.v5+json';
const SCHEMA = 'https://vega.github.io/schema/vega-lite/v5.json';

/** True where this JupyterLab has a Vega-Lite renderer (its Vega extension enabled). */
export function canChart(rendermime: IRenderMimeRegistry | null): rendermime is IRenderMimeRegistry {
  return !!rendermime && rendermime.mimeTypes.indexOf(VEGALITE) >= 0;
}

/** ``spec`` drawn as SVG in a node of its own (null without a renderer: the caller
 * shows the numbers as text instead). */
export function chart(spec: any, rendermime: IRenderMimeRegistry | null, what: string): HTMLElement | null {
  if (!canChart(rendermime)) {
    return null;
  }
  const renderer = rendermime.createRenderer(VEGALITE);
  const model = new MimeModel({
    data: { [VEGALITE]: { $schema: SCHEMA, ...spec } } as any,
    metadata: { [VEGALITE]: { embed_options: { renderer: 'svg', actions: false } } } as any
  });
  renderer.renderModel(model).catch(e => console.warn(`dpnb: ${what} chart not drawn:`, e));
  renderer.node.classList.add('dpnb-chart');
  return renderer.node;
}

/** A line over the training steps: x titled "step", y titled ``yTitle``. */
export function stepLine(points: { step: number; y: number }[], yTitle: string): any {
  return {
    width: 340,
    height: 130,
    data: { values: points },
    mark: { type: 'line', point: points.length <= 50, tooltip: true },
    encoding: {
      x: { field: 'step', type: 'quantitative', title: 'step', axis: { tickMinStep: 1 } },
      y: { field: 'y', type: 'quantitative', title: yTitle, scale: { zero: false } }
    }
  };
}

/** Bars side by side per group (``xOffset``), stacked by ``color`` where several share a
 * slot; ``dim``: a Vega expression, the bars it holds for drawn lighter (the prediction
 * beside the measurement, told apart even when they are equal). */
export function groupedBars(values: any[], x: string, offset: string, y: string, color: string,
  titles: { x: string; y: string; color: string }, dim?: string): any {
  return {
    width: { step: 28 },
    height: 150,
    data: { values },
    mark: { type: 'bar', tooltip: true },
    encoding: {
      x: { field: x, type: 'nominal', title: titles.x, sort: null },
      xOffset: { field: offset, type: 'nominal', sort: null },
      y: { field: y, type: 'quantitative', title: titles.y, stack: 'zero' },
      color: { field: color, type: 'nominal', title: titles.color, sort: null },
      ...(dim ? { opacity: { condition: { test: dim, value: 0.45 }, value: 1 } } : {})
    }
  };
}

/** Bars on a time axis, one row per ``row`` (a Gantt chart of a step). */
export function timeline(values: any[], titles: { x: string; y: string }): any {
  return {
    width: 420,
    height: { step: 14 },
    data: { values },
    mark: { type: 'bar', tooltip: true },
    encoding: {
      y: { field: 'row', type: 'ordinal', title: titles.y, sort: null },
      x: { field: 'start', type: 'quantitative', title: titles.x },
      x2: { field: 'end' },
      color: { field: 'lane', type: 'nominal', title: 'lane', sort: null },
      opacity: { condition: { test: 'datum.queued', value: 0.35 }, value: 1 }
    }
  };
}
