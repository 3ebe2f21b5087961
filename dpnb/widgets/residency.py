"""Memory held *during* the step, measured on the ranks (``%dp memory --during``).

``%dp memory --live`` compares what each rank holds between steps with the
exact prediction; there ZeRO-2 and ZeRO-3 look the same (1/N of
everything).  This view runs one ordinary training step with
:func:`dpnb.engine.metrics.residency.measure_step` on every rank and shows the peak
parameter and gradient bytes each rank held in its forward and in its
backward, beside the whole model's parameter bytes.  Each strategy measured
on this cluster (same model size) is kept, so wrapping with zero2, measuring,
re-wrapping with zero3 and measuring again shows both side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpnb.core.strategies import STRATEGIES
from dpnb.core.units import fmt_bytes
from dpnb.core.viewsource import ViewSource
from dpnb.ranks import rank_label

from dpnb.engine import entrypoints as ep
from . import _common as C

ORDER = STRATEGIES  # the strategies in ZeRO-stage order


@dataclass(frozen=True)
class Residency:
    """One measured step of one strategy; bytes, the same on the ``ranks`` listed."""

    strategy: str
    step: int | None
    ranks: tuple[int, ...]
    full_param_bytes: int
    forward_params: int  # peak parameter bytes while the forward ran
    backward_total: int  # peak parameter + gradient bytes while the backward ran
    backward_grads: int
    after_params: int  # once the step was over

    @property
    def label(self) -> str:
        return f"{self.strategy} ({rank_label(self.ranks)})"


def from_ranks(per_rank: list[dict]) -> tuple[Residency, ...]:
    """One :class:`Residency` per distinct measurement, ranks folded together."""
    if not per_rank:
        raise C.ViewError("no measurement came back: is a model wrapped and data bound?")
    groups: dict[tuple, list[int]] = {}
    for r in sorted(per_rank, key=lambda r: r["rank"]):
        pk = r["peak"]
        key = (r["strategy"], r["step"], r["full_param_bytes"], pk["forward"]["params"],
               pk["backward"]["total"], pk["backward"]["grads"], r["after"]["params"])
        groups.setdefault(key, []).append(r["rank"])
    return tuple(Residency(k[0], k[1], tuple(rs), *k[2:]) for k, rs in groups.items())


def remember(cluster: ViewSource, found: tuple[Residency, ...]) -> list[Residency]:
    """Have the session keep the latest measurement per strategy (forgetting any
    of another model size); return every kept one, in ZeRO-stage order."""
    kept = cluster.keep_residency(found[0].full_param_bytes, found[0].strategy, found)
    return [x for s in sorted(kept, key=lambda s: ORDER.index(s) if s in ORDER else 99) for x in kept[s]]


def measure(cluster: ViewSource, micro_batch: int = 8, grad_accum: int = 1) -> tuple[Residency, ...]:
    """Run one training step with the probe on every rank (collective)."""
    for name, v in (("micro-batch", micro_batch), ("grad-accum", grad_accum)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise C.ViewError(f"--{name} must be a whole number >= 1 (got {v!r})")
    return from_ranks(C.call_ok(cluster, ep.MEASURE_RESIDENCY, micro_batch=micro_batch, grad_accum=grad_accum))


HEADERS = ("strategy", "whole model", "forward: params", "backward: params + grads", "after the step")


def rows(runs: list[Residency]) -> list[list[str]]:
    return [[r.label, fmt_bytes(r.full_param_bytes), fmt_bytes(r.forward_params),
             fmt_bytes(r.backward_total), fmt_bytes(r.after_params)] for r in runs]


def summary(runs: list[Residency]) -> list[str]:
    lines = ["peak bytes of parameters and gradients each rank held during one training step "
             "(activations not counted)"]
    by = {r.strategy: r for r in runs}
    if "zero2" in by and "zero3" in by:
        z2, z3 = by["zero2"], by["zero3"]
        lines.append(f"forward peak: zero3 {fmt_bytes(z3.forward_params)} vs zero2 "
                     f"{fmt_bytes(z2.forward_params)} ({z3.forward_params / z2.forward_params:.0%}): "
                     "zero3 frees each unit's gathered parameters after its forward, "
                     "zero2 keeps them until its backward")
    return lines


def text(runs: list[Residency]) -> str:
    return "\n".join(summary(runs) + ["", C.text_table(HEADERS, rows(runs))])


def html(runs: list[Residency]) -> str:
    return C.html_lines(summary(runs)) + C.html_table(HEADERS, rows(runs))


def figure(runs: list[Residency]):
    fig = C.new_figure(1.0 + 0.55 * len(runs))
    ax = fig.add_subplot(1, 1, 1)
    labels = [r.label for r in runs]
    h = 0.26
    for i, r in enumerate(runs):
        y = len(runs) - 1 - i
        ax.barh(y + h, r.forward_params, h, color="#4c72b0", label="forward: params" if i == 0 else None)
        ax.barh(y, r.backward_total, h, color="#dd8452", label="backward: params + grads" if i == 0 else None)
        ax.barh(y - h, r.after_params, h, color="#999999", label="after the step" if i == 0 else None)
    ax.axvline(runs[0].full_param_bytes, color="k", ls="--", lw=1, label="whole model's parameters")
    ax.set_yticks(range(len(runs)), labels[::-1])
    ax.set_xlabel("bytes held by one rank (peak)")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def show(cluster: ViewSource, micro_batch: int = 8, grad_accum: int = 1) -> list[Residency]:
    """Measure one step of the wrapped strategy and show every strategy measured so far."""
    runs = remember(cluster, measure(cluster, micro_batch, grad_accum))
    C.show_static(runs, figure, html, text)
    return runs


def save(path: str, runs: list[Residency]) -> str:
    return C.save_figure(figure(runs), path)
