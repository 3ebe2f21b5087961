"""Global batch arithmetic: micro-batch × DP × grad-accum, LR scaling, DP × TP × PP.

The distributed story
---------------------
In one optimizer step each of the ``dp`` data-parallel ranks runs
``grad_accum`` forward/backward passes on micro-batches of ``micro_batch``
samples.  The gradients of those micro-batches are summed locally, with no
communication (under DDP the first ``grad_accum - 1`` backwards run inside
``model.no_sync()``); only the last backward triggers the gradient all-reduce
that averages over the ``dp`` ranks.  Then every rank applies the same update.
So one optimizer step sees::

    global batch (samples) = micro_batch × dp × grad_accum
    global batch (tokens)  = micro_batch × dp × grad_accum × seq_len

(the identity used throughout the literature, e.g. the Hugging Face "Ultra-Scale
Playbook" and Megatron-LM, Narayanan et al. 2021, arXiv:2104.04473, where
``dp`` is the data-parallel degree *after* tensor and pipeline parallelism
have taken their share of the GPUs: world size = DP × TP × PP).

Hyper-parameters that depend on the batch (the learning rate first of all)
key off the *global* batch, never the per-rank one; :func:`scale_lr` rescales
a learning rate tuned at a reference global batch.

Nothing here touches memory: whether ``micro_batch`` fits on a device is the
business of activations, which :mod:`dpnb.core.memory` does not count either.
"""

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from dpnb.core.errors import ConfigError

LRRule = Literal["linear", "sqrt", "none"]
BatchUnit = Literal["samples", "tokens"]


def _check_pos_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class BatchConfig:
    """One optimizer step's batch layout.

    Attributes:
        micro_batch: samples per forward/backward on one rank.
        dp: data-parallel degree (number of model replicas).
        grad_accum: micro-batches accumulated locally before the all-reduce.
        seq_len: tokens per sample (1 for non-sequence data).
    """

    micro_batch: int
    dp: int
    grad_accum: int = 1
    seq_len: int = 1

    def __post_init__(self) -> None:
        for name in ("micro_batch", "dp", "grad_accum", "seq_len"):
            _check_pos_int(name, getattr(self, name))

    @property
    def global_samples(self) -> int:
        """Samples per optimizer step: micro_batch × dp × grad_accum."""
        return self.micro_batch * self.dp * self.grad_accum

    @property
    def global_tokens(self) -> int:
        """Tokens per optimizer step: global_samples × seq_len."""
        return self.global_samples * self.seq_len

    @property
    def per_rank_samples(self) -> int:
        """Samples one rank processes per optimizer step: micro_batch × grad_accum."""
        return self.micro_batch * self.grad_accum

    @property
    def samples_per_micro_step(self) -> int:
        """Samples processed by all ranks together in one micro-step: micro_batch × dp."""
        return self.micro_batch * self.dp

    def global_batch(self, unit: BatchUnit = "samples") -> int:
        """The global batch in ``unit`` ("samples" or "tokens")."""
        return self.global_tokens if unit == "tokens" else self.global_samples

    def describe(self) -> str:
        """One line with every factor, e.g. ``4 × 8 × 32 = 1,024 samples × 4,096 = ...``."""
        s = (
            f"micro_batch {self.micro_batch} × DP {self.dp} × grad_accum "
            f"{self.grad_accum} = {self.global_samples:,} samples"
        )
        if self.seq_len != 1:
            s += f" × seq_len {self.seq_len:,} = {self.global_tokens:,} tokens"
        return s


@dataclass(frozen=True)
class BatchSolution:
    """Result of solving for grad-accum or DP to reach a target global batch.

    Attributes:
        solve_for: which knob was solved ("grad_accum" or "dp").
        target: the requested global batch, in ``unit``.
        unit: "samples" or "tokens".
        exact: True when ``config`` reaches ``target`` exactly.
        config: the exact solution, or else the nearest achievable one
            (ties go to the smaller batch).
        lower: the largest achievable config at or below the target (None when
            even a value of 1 overshoots).
        upper: the smallest achievable config at or above the target.
        message: the arithmetic, every factor shown, and what to do if inexact.
    """

    solve_for: Literal["grad_accum", "dp"]
    target: int
    unit: BatchUnit
    exact: bool
    config: BatchConfig
    lower: BatchConfig | None
    upper: BatchConfig
    message: str

    @property
    def value(self) -> int:
        """The solved knob's value in ``config``."""
        return self.config.grad_accum if self.solve_for == "grad_accum" else self.config.dp

    @property
    def grad_accum(self) -> int:
        """``config.grad_accum``."""
        return self.config.grad_accum

    @property
    def dp(self) -> int:
        """``config.dp``."""
        return self.config.dp

    @property
    def achieved(self) -> int:
        """The global batch ``config`` reaches, in ``unit``."""
        return self.config.global_batch(self.unit)

    def require_exact(self) -> BatchConfig:
        """Return ``config`` if exact, else raise :class:`ConfigError` with ``message``."""
        if not self.exact:
            raise ConfigError(self.message)
        return self.config


def _signed_pct(diff: int, target: int) -> str:
    return f"{diff:+,} = {100.0 * diff / target:+.2f}%"


def _solve(
    solve_for: Literal["grad_accum", "dp"],
    micro_batch: int,
    other: int,
    target_samples: int | None,
    target_tokens: int | None,
    seq_len: int,
) -> BatchSolution:
    _check_pos_int("micro_batch", micro_batch)
    other_name = "DP" if solve_for == "grad_accum" else "grad_accum"
    _check_pos_int("dp" if solve_for == "grad_accum" else "grad_accum", other)
    _check_pos_int("seq_len", seq_len)
    if (target_samples is None) == (target_tokens is None):
        raise ConfigError(
            "give exactly one of target_samples or target_tokens "
            f"(got target_samples={target_samples!r}, target_tokens={target_tokens!r})"
        )
    unit: BatchUnit = "samples" if target_tokens is None else "tokens"
    target = target_samples if target_tokens is None else target_tokens
    assert target is not None
    _check_pos_int(f"target_{unit}", target)

    def make(k: int) -> BatchConfig:
        if solve_for == "grad_accum":
            return BatchConfig(micro_batch, other, k, seq_len)
        return BatchConfig(micro_batch, k, other, seq_len)

    # Size of one unit of the free knob, in the target's unit.
    per_unit = micro_batch * other * (seq_len if unit == "tokens" else 1)
    q = Fraction(target, per_unit)
    factors = f"micro_batch {micro_batch} × {other_name} {other}"
    if unit == "tokens":
        factors += f" × seq_len {seq_len:,}"
    head = (
        f"target {target:,} {unit}: {factors} = {per_unit:,} {unit} per unit of "
        f"{solve_for}; {target:,} / {per_unit:,} = {float(q):g}"
    )
    if unit == "tokens" and target % seq_len == 0:
        head = (
            f"target {target:,} tokens = {target // seq_len:,} samples × seq_len "
            f"{seq_len:,}; " + head.split(": ", 1)[1]
        )

    if q.denominator == 1 and q >= 1:
        cfg = make(int(q))
        msg = f"{head} → {solve_for} = {int(q)} reaches it exactly ({cfg.describe()})"
        return BatchSolution(solve_for, target, unit, True, cfg, cfg, cfg, msg)

    lo_k = math.floor(q)
    hi_k = max(1, math.ceil(q))
    lower = make(lo_k) if lo_k >= 1 else None
    upper = make(hi_k)
    if lower is None:
        nearest = upper
    else:
        d_lo = target - lower.global_batch(unit)
        d_hi = upper.global_batch(unit) - target
        nearest = lower if d_lo <= d_hi else upper

    options = []
    for side in (lower, upper):
        if side is not None:
            got = side.global_batch(unit)
            k = side.grad_accum if solve_for == "grad_accum" else side.dp
            options.append(f"{solve_for}={k} → {got:,} {unit} ({_signed_pct(got - target, target)})")
    why = "is below 1" if q < 1 else "is not a whole number"
    msg = (
        f"{head} {why}; nearest achievable: " + ", ".join(options)
        + f". To hit {target:,} {unit} exactly, choose micro_batch × {other_name}"
        + (" × seq_len" if unit == "tokens" else "")
        + f" dividing {target:,}"
    )
    alts = _exact_alternatives(solve_for, micro_batch, other, target, unit, seq_len)
    if alts:
        msg += ", e.g. " + ", or ".join(alts)
    elif unit == "tokens" and target % seq_len != 0:
        msg += f" (it is not even a whole number of {seq_len:,}-token sequences)"
    return BatchSolution(solve_for, target, unit, False, nearest, lower, upper, msg)


def _exact_alternatives(
    solve_for: Literal["grad_accum", "dp"],
    micro_batch: int,
    other: int,
    target: int,
    unit: BatchUnit,
    seq_len: int,
) -> list[str]:
    """Up to three micro-batch sizes near the requested one that make the target exact."""
    samples = target
    if unit == "tokens":
        if target % seq_len:
            return []
        samples = target // seq_len
    if samples % other:
        return []
    rest = samples // other  # must equal micro_batch × free knob
    cands = [m for m in range(1, 4 * micro_batch + 1) if rest % m == 0 and m != micro_batch]
    cands.sort(key=lambda m: (abs(m - micro_batch), m))
    other_name = "DP" if solve_for == "grad_accum" else "grad_accum"
    return [f"micro_batch={m} {other_name}={other} {solve_for}={rest // m}" for m in cands[:3]]


def solve_grad_accum(
    micro_batch: int,
    dp: int,
    *,
    target_samples: int | None = None,
    target_tokens: int | None = None,
    seq_len: int = 1,
) -> BatchSolution:
    """Gradient-accumulation steps that reach a target global batch.

    grad_accum = target_samples / (micro_batch × dp), or with a token target
    target_tokens / (micro_batch × dp × seq_len).  When that is not a whole
    number ≥ 1 the result is marked inexact and carries the nearest achievable
    configs on either side (``lower``/``upper``); ``config`` is the nearer one.
    Example (Tazi et al., "Data Parallelism" chapter; checked from the identity):
    4 Mi tokens (4 × 2**20) at seq_len 4096 is 1024 samples; with DP=8 and
    micro_batch 4 that is grad_accum = 1024 / 32 = 32.
    """
    return _solve("grad_accum", micro_batch, dp, target_samples, target_tokens, seq_len)


def solve_dp(
    micro_batch: int,
    grad_accum: int,
    *,
    target_samples: int | None = None,
    target_tokens: int | None = None,
    seq_len: int = 1,
) -> BatchSolution:
    """Data-parallel degree that reaches a target global batch.

    dp = target_samples / (micro_batch × grad_accum) (or the token version);
    inexact results are reported as in :func:`solve_grad_accum`.  The DP
    degree found here is the number of *model replicas*; with tensor/pipeline
    parallelism each replica uses TP × PP GPUs (see :func:`factor_world`).
    """
    return _solve("dp", micro_batch, grad_accum, target_samples, target_tokens, seq_len)


def scale_lr(ref_lr: float, ref_batch: int, new_batch: int, rule: LRRule = "linear") -> float:
    """Rescale a learning rate tuned at global batch ``ref_batch`` to ``new_batch``.

    Rules (k = new_batch / ref_batch):

    * ``"linear"``: lr × k — Goyal et al. 2017, "Accurate, Large Minibatch SGD:
      Training ImageNet in 1 Hour", arXiv:1706.02677 (with warm-up; it breaks
      down beyond a critical batch size).
    * ``"sqrt"``: lr × √k — keeps the variance of the update constant;
      Krizhevsky 2014, "One weird trick for parallelizing convolutional neural
      networks", arXiv:1404.5997; Hoffer et al. 2017, "Train longer, generalize
      better", arXiv:1705.08741.  Often used with Adam.
    * ``"none"``: lr unchanged.

    Both batches must be *global* batches (micro_batch × dp × grad_accum) in the
    same unit.  These are heuristics, not guarantees of equal convergence.
    """
    if not (isinstance(ref_lr, (int, float)) and ref_lr > 0 and math.isfinite(ref_lr)):
        raise ConfigError(f"ref_lr must be a positive finite number, got {ref_lr!r}")
    _check_pos_int("ref_batch", ref_batch)
    _check_pos_int("new_batch", new_batch)
    k = new_batch / ref_batch
    if rule == "linear":
        return float(ref_lr) * k
    if rule == "sqrt":
        return float(ref_lr) * math.sqrt(k)
    if rule == "none":
        return float(ref_lr)
    raise ConfigError(f"unknown LR scaling rule {rule!r}; use 'linear', 'sqrt' or 'none'")


@dataclass(frozen=True)
class Parallelism:
    """A factorisation world_size = dp × tp × pp (Megatron-LM "3D" parallelism).

    Each of the ``dp`` model replicas spans tp × pp GPUs; the gradient
    all-reduce runs among the ``dp`` ranks that hold the same model shard.
    """

    dp: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            _check_pos_int(name, getattr(self, name))

    @property
    def world_size(self) -> int:
        """dp × tp × pp."""
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        """``DP=… × TP=… × PP=… = world``."""
        return f"DP={self.dp} × TP={self.tp} × PP={self.pp} = {self.world_size}"


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def factor_world(world_size: int, tp: int = 1, pp: int = 1) -> Parallelism:
    """DP degree for a world size and given tensor- and pipeline-parallel degrees.

    DP = world_size / (TP × PP) (Narayanan et al. 2021, "Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM",
    arXiv:2104.04473).  Raises :class:`ConfigError` when TP × PP does not divide
    the world size, printing the division and nearby factorisations that do
    work, e.g. 480 GPUs with TP=8, PP=8 gives 480 / 64 = 7.5.
    """
    _check_pos_int("world_size", world_size)
    _check_pos_int("tp", tp)
    _check_pos_int("pp", pp)
    model = tp * pp
    if world_size % model == 0:
        return Parallelism(world_size // model, tp, pp)
    q = world_size / model
    why = "is not a whole number" if q >= 1 else "is below 1 (TP × PP exceeds the world size)"
    # Keep TP first: it is usually pinned to the NVLink domain of one node.
    # Then prefer fewer pipeline stages (more DP), then more; finally keep PP
    # and try a smaller (power-of-two first) TP.
    alts: list[tuple[int, int]] = []
    if world_size % tp == 0:
        ds = _divisors(world_size // tp)
        alts += [(tp, p) for p in sorted((d for d in ds if d < pp), reverse=True)[:2]]
        alts += [(tp, p) for p in sorted(d for d in ds if d > pp)[:1]]
    if world_size % pp == 0:
        ds = [d for d in _divisors(world_size // pp) if d < tp]
        ds.sort(key=lambda t: (t & (t - 1) != 0, -t))
        alts += [(t, pp) for t in ds[:1]]
    if not alts:
        for t in sorted(_divisors(world_size), key=lambda t: (abs(t - tp), -t))[:2]:
            cp = sorted(_divisors(world_size // t), key=lambda p: (abs(p - pp), -p))
            alts.append((t, cp[0]))
    seen: list[tuple[int, int]] = []
    for a in alts:
        if a not in seen:
            seen.append(a)
    text = ", ".join(f"TP={t} PP={p} → DP={world_size // (t * p)}" for t, p in seen[:4])
    raise ConfigError(
        f"world size {world_size} does not factor as DP × TP × PP with TP={tp}, "
        f"PP={pp}: {world_size} / ({tp} × {pp}) = {q:g} {why}; choose TP × PP "
        f"dividing {world_size}, e.g. {text} (or change the number of GPUs to a "
        f"multiple of {model})"
    )
