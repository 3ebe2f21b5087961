"""``%dp export DIR``: the notebook session as a batch job (train.py, run.sh, job.sbatch).

What the ranks hold was built by three kinds of things, and the job needs
each again:

* the cells marked ``%%dp --setup`` (the notebook's own record of what built
  the model and the data; ``restart --resume`` replays the same list) -- they
  are copied into ``train.py`` as plain module-level code, in order;
* the wrap and the data choice -- written as the same engine calls
  (``dpnb.engine.train.training.wrap`` / ``.set_data``) with the same arguments;
* the state reached by training -- saved now, with every rank writing its
  shard (``torch.distributed.checkpoint``), and loaded by the job, which
  DCP reshards for whatever number of ranks it runs on.

The notebook's ``%dp train`` calls since the wrap become the job's schedule:
the job skips what the checkpoint already holds, runs the rest, and
``--steps N`` goes on with the last call's settings.  Under ``torchrun`` each
process is one rank (:mod:`dpnb.engine.train.job`), communicating exactly as the
engines did.

Whatever cannot be carried over is listed with its reason, never dropped
silently: cells not marked ``--setup``, cells run on some ranks only,
values pushed from the notebook, cells in IPython syntax.
"""

from __future__ import annotations

import ast
import datetime
import os
import shlex
import stat

from ..cluster.types import EntryKind
from ..core.cellgraph import cell_summary
from dpnb.engine import entrypoints as ep
from ..errors import DpnbError
from .record import LoadStep, SetupCell, WatchStep
from .results import ExportResult

#: setup steps the job does not need: they serve notebook views only
NOTEBOOK_ONLY_STEPS = (WatchStep,)


def _short(code: str) -> str:
    return cell_summary(code) or "(empty)"


def _doc_safe(text: str, limit: int = 300) -> str:
    """``text`` as it may stand inside the script's docstring."""
    return text[:limit].replace("\\", "/").replace('"""', "'''")


def _names_used(code: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}


def _setup_cell_problem(code: str, pushed: set[str]) -> str | None:
    try:
        names = _names_used(code)
    except SyntaxError:
        return ("uses IPython syntax (a %magic or !shell line), which plain Python cannot run: "
                "write it in Python (subprocess.run for a shell command)")
    from_notebook = sorted(names & pushed)
    if from_notebook:
        return (f"uses {', '.join(from_notebook)}, sent from the notebook with %dp push: build "
                f"it in a --setup cell, or save it to a file the job reads")
    return None


def skipped_cells(cluster) -> list[tuple[str, str]]:
    """``(what, why)`` for every cell and push the job leaves out."""
    out = []
    pushed: set[str] = set()
    for rec in cluster.history:
        if rec.kind == EntryKind.PUSH:
            pushed |= set(rec.names)
            out.append((f"%dp push {' '.join(rec.names)}",
                        "the value lives in the notebook; the job cannot receive it"))
            continue
        what = f"cell: {_short(rec.code)}"
        if not rec.ok:
            out.append((what, "failed on a rank"))
        elif rec.ranks is not None:
            out.append((what, f"ran on rank{'s' if len(rec.ranks) > 1 else ''} "
                              f"{','.join(map(str, rec.ranks))} only (rank-selected)"))
        elif not cluster.setup_log.marks(rec):
            out.append((what, "not marked %%dp --setup (run it again with --setup to include it)"))
        else:
            why = _setup_cell_problem(rec.code, pushed)
            if why:
                out.append((what, why))
    return out


def _call_source(dotted: str, args: tuple, kwargs: dict) -> str:
    module, _, fn = dotted.rpartition(".")
    alias = {ep.TRAINING_MODULE: "training", ep.CHECKPOINT_MODULE: "checkpoint"}.get(module)
    parts = ["globals()"] + [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    call = f"{alias or module}.{fn}({', '.join(parts)})"
    return call if alias else f"import {module}\n{call}"


def init_call(seed: int | None) -> str:
    """The job's ``job.init`` line: the notebook's ``--seed``, if any, goes with it."""
    return ("job.init(globals(), backend=args.backend, timeout_s=args.timeout"
            + (f", seed={seed})" if seed is not None else ")"))


def script(cluster, *, checkpoint: str | None, skipped: list[tuple[str, str]],
           when: str) -> str:
    """The text of ``train.py``."""
    pushed = {n for rec in cluster.history if rec.kind == EntryKind.PUSH for n in rec.names}
    st = cluster.training
    steps_done = st.steps_done
    base = cluster.setup_log.base()
    doc = (f"Exported by dpnb from a notebook session on {when}: {cluster.world_size} ranks, "
           f"{cluster.backend}, {st.last_wrap.strategy if st.last_wrap else '?'}.")
    body = [
        "#!/usr/bin/env python3",
        f'"""{doc}',
        "",
        "Run with torchrun (./run.sh) or Slurm (sbatch job.sbatch).  It rebuilds what the",
        "notebook built -- the cells marked %%dp --setup, the wrap, the data --, loads the",
        "checkpoint saved at export, and replays the notebook's training calls from there;",
        "--steps N trains N more steps with the last call's settings.",
        *(["", "Left out (see EXPORT.txt): " + _doc_safe("; ".join(what for what, _ in skipped))]
          if skipped else []),
        '"""',
        "",
        f"from {ep.TRAIN_ROOM} import checkpoint, job, training  # noqa: F401",
        "",
        "# the checkpoint the notebook loaded after its wrap (path, step): its training",
        "# calls below start there (None: from the freshly built model)",
        f"BASE = {(base.path, base.step) if base else None!r}",
        "",
        "args = job.arg_parser(description=__doc__.splitlines()[0],",
        f"                      resume={checkpoint!r}, steps_done={steps_done},",
        "                      base=BASE).parse_args()",
        init_call(cluster.seed),
        "",
    ]
    n_cell = 0
    for e in cluster.setup_log.entries:
        if isinstance(e, SetupCell):
            n_cell += 1
            if _setup_cell_problem(e.code, pushed):
                body += [f"# setup cell {n_cell} left out (see EXPORT.txt): {_short(e.code)}", ""]
                continue
            body += [f"# ---- setup cell {n_cell} (%%dp --setup) ----", e.code.strip("\n"), ""]
        elif isinstance(e, LoadStep):
            body += [f"# ({e.label}: --from-scratch loads it, see BASE; otherwise the "
                     f"checkpoint taken at export)" if e is base else
                     f"# ({e.label}: superseded by a later load or wrap)", ""]
        elif isinstance(e, NOTEBOOK_ONLY_STEPS):
            body += [f"# ({e.label}: a notebook view's hooks, not needed here)", ""]
        else:
            body += [f"# ---- {e.label} ----", _call_source(*e.call()), ""]
    schedule = [t.schedule_entry() for t in st.train_log]
    body += ["# The notebook's %dp train calls since the wrap or BASE, in order (steps they ran).",
             "SCHEDULE = ["]
    body += [f"    {t!r}," for t in schedule]
    body += ["]", "", "job.run(globals(), SCHEDULE, args, base=BASE)", ""]
    return "\n".join(body)


def launch_files(cluster) -> dict[str, str]:
    """``run.sh`` (torchrun on this host, or one line per host) and ``job.sbatch``."""
    hosts = sorted({r.host for r in cluster.ranks}, key=lambda h: min(
        r.rank for r in cluster.ranks if r.host == h))
    per_host = max(r.local_world_size for r in cluster.ranks)
    env = dict(cluster.spec.env)
    env.setdefault("OMP_NUM_THREADS", str(cluster.threads))
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
    if len(hosts) == 1:
        # gloo binds to the address the hostname resolves to, which in many
        # containers is not routable from the host itself; one host: loopback
        lo = ("export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}\n"
              if cluster.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in env else "")
        run_cmd = lo + f"torchrun --standalone --nproc-per-node {per_host} train.py \"$@\""
    else:
        run_cmd = (f"# on each of {', '.join(hosts)} (NODE_RANK 0..{len(hosts) - 1}):\n"
                   f"torchrun --nnodes {len(hosts)} --nproc-per-node {per_host} "
                   f"--node-rank \"${{NODE_RANK:?set NODE_RANK}}\" --master-addr {hosts[0]} "
                   f"--master-port 29500 train.py \"$@\"")
    run_sh = ("#!/usr/bin/env bash\n# The exported job on this host's ranks (see train.py).\n"
              "set -euo pipefail\ncd \"$(dirname \"$0\")\"\n" + exports + run_cmd + "\n")
    gpus = f"#SBATCH --gpus-per-node={per_host}\n" if cluster.backend == "nccl" else ""
    sbatch = (
        "#!/usr/bin/env bash\n"
        "#SBATCH --job-name=dpnb-export\n"
        f"#SBATCH --nodes={len(hosts)}\n"
        "#SBATCH --ntasks-per-node=1\n"
        f"#SBATCH --cpus-per-task={max(1, per_host * int(cluster.threads))}\n"
        f"{gpus}"
        "#SBATCH --output=dpnb-export-%j.out\n"
        "# One torchrun per node; torchrun starts the node's ranks and meets the others\n"
        "# at the first node (c10d rendezvous).  Submit from this folder: sbatch job.sbatch\n"
        "set -euo pipefail\ncd \"${SLURM_SUBMIT_DIR:-.}\"\n" + exports +
        "head=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
        f"srun torchrun --nnodes \"$SLURM_NNODES\" --nproc-per-node {per_host} "
        "--rdzv-id \"$SLURM_JOB_ID\" --rdzv-backend c10d --rdzv-endpoint \"$head:29500\" "
        "train.py \"$@\"\n")
    return {"run.sh": run_sh, "job.sbatch": sbatch}


def export(cluster, out_dir: str) -> ExportResult:
    """Write ``train.py``, ``run.sh``, ``job.sbatch`` and ``EXPORT.txt`` into ``out_dir``,
    with a checkpoint of the current state (a collective: every rank writes its shard).

    Returns an :class:`~.results.ExportResult` (``dir``, ``files``, ``checkpoint``,
    ``step``, ``skipped``, ``command``).
    """
    cluster.require_running()
    if not cluster.setup_log.wrapped:
        raise DpnbError("nothing to export: no model is wrapped. Build it in %%dp --setup "
                        "cells, %dp wrap it and %dp data, then export")
    if not isinstance(out_dir, str) or not out_dir.strip():
        raise DpnbError("give the folder to write the job into: %dp export DIR")
    out = os.path.abspath(os.path.expanduser(out_dir))
    if os.path.exists(out) and not os.path.isdir(out):
        raise DpnbError(f"{out} is a file: give a folder for the job")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise DpnbError(f"cannot create {out} ({e.strerror}): give a folder you can write") from None
    skipped = skipped_cells(cluster)
    ck = os.path.join(out, "checkpoint")
    saved = cluster.call(ep.SAVE, ck).values[0]
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    files = {"train.py": script(cluster, checkpoint="checkpoint", skipped=skipped, when=when),
             **launch_files(cluster)}
    notes = [f"Exported {when}: step {saved.get('step')} saved in checkpoint/.", "",
             "Left out of train.py:" if skipped else "Every cell the ranks ran is in train.py."]
    notes += [f"  - {what}: {why}" for what, why in skipped]
    files["EXPORT.txt"] = "\n".join(notes) + "\n"
    for name, text in files.items():
        path = os.path.join(out, name)
        with open(path, "w") as f:
            f.write(text)
        if name.endswith((".sh", ".py")):
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return ExportResult(dir=out, files=sorted(files), checkpoint=ck, step=saved.get("step"),
                        skipped=skipped, command=f"cd {shlex.quote(out)} && ./run.sh")
