"""The strict runner behind ``tests/break_on_purpose.py``.

An entry is one deliberate break of dpnb and the tests that must catch it.  It
counts as *caught* only when, with the break applied, pytest exits 1 and at
least one of the entry's own named tests is reported **failed** (its call
failed, or its setup errored) -- read from each test's outcome, which
``tests/conftest.py`` writes to ``$DPNB_TEST_OUTCOMES``, never from the exit
code alone.  Before any break, the named ids are collected (each must exist:
a renamed test, or a module skipped at import, names nothing) and must have
passed unbroken -- read from the outcomes of a run given with ``--baseline``
(CI passes its own pytest run's) or, without one, from one unbroken run here.
Anything else makes the entry INVALID, which fails the run like MISSED.

Breaks run side by side (``--jobs``), each in its own copy of the checkout,
so the checkout itself is never changed; entries of the namespace tiers
(multihost, shared) never run beside each other, as in the pytest run.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from helpers.zygote import Zygote

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTCOMES_ENV = "DPNB_TEST_OUTCOMES"  # tests/conftest.py writes it
#: tiers whose tests make network namespaces and unix users: one at a time
TOGETHER = {"multihost", "shared"}
#: tiers this machine cannot run, with the reason (said, never counted caught)
NEEDS = {"gpu": "needs a CUDA GPU (CI has none)"}
#: copied with the tree: not the virtualenv, not Node's packages, not caches
_NOT_COPIED = shutil.ignore_patterns(".venv", "node_modules", "__pycache__", "*.egg-info",
                                     ".pytest_cache", ".hypothesis", "demo-out", "dpnb-profiles",
                                     "test-artifacts", "site")


@dataclass(frozen=True)
class Entry:
    """One deliberate break: what the tests claim, where to break it, and who must catch it."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]

    @property
    def tiers(self) -> frozenset[str]:
        return frozenset(t.split("/")[1] for t in self.tests)

    @property
    def fast(self) -> bool:
        """Every named test is in the unit tier (no cluster, no kernel)."""
        return self.tiers == {"unit"}

    @property
    def cannot_run_here(self) -> str | None:
        why = [NEEDS[t] for t in sorted(self.tiers) if t in NEEDS and not _has(t)]
        return "; ".join(why) or None


def _has(tier: str) -> bool:
    """Whether this machine can run ``tier`` after all (a lent GPU machine can run gpu)."""
    if tier != "gpu":
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@dataclass(frozen=True)
class Verdict:
    entry: Entry
    word: str  # caught | MISSED | INVALID | NOT RUN
    detail: str
    seconds: float = 0.0

    @property
    def bad(self) -> bool:
        return self.word != "caught"

    def line(self) -> str:
        took = f" ({self.seconds:.0f} s)" if self.seconds else ""
        return f"{self.word}  {self.entry.name}{took}: {self.detail}"


def entries(mutations) -> list[Entry]:
    return [Entry(n, f, o, w, tuple(t)) for n, f, o, w, t in mutations]


def slice_of(e: Entry, slices: int) -> int:
    """The slice entry ``e`` belongs to: a digest of its name, so an entry keeps its
    slice when others are added or removed around it (a slice by position in the
    list moved every entry after an insertion, and one could miss its turn)."""
    h = hashlib.blake2b(e.name.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % slices


def share(chosen: list[Entry], k: int, slices: int) -> list[Entry]:
    """Slice ``k`` of ``slices`` of the entries: any ``slices`` consecutive values of
    ``k`` together hold every entry exactly once."""
    return [e for e in chosen if slice_of(e, slices) == k % slices]


def head(root: str = ROOT) -> str:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def ledger_slice(path: str, slices: int, root: str = ROOT) -> int:
    """The slice this run takes from the rotation ledger ``path`` (JSON kept by CI on
    its machine, ``{"next", "ran", "commit", "slices"}``): the ledger's ``next``; the
    slice already run when this commit ran one before (a re-run does not skip a
    slice); ``commit_count() % slices`` when there is no ledger yet (a fresh machine)
    or it was kept for another number of slices."""
    try:
        with open(path) as f:
            led = json.load(f)
        if led.get("slices") == slices:
            return int(led["ran"] if led.get("commit") == head(root) else led["next"]) % slices
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"rotation ledger {path} not read ({type(e).__name__}: {e}): "
              f"starting from the number of commits", flush=True)
    return commit_count(root) % slices


def ledger_advance(path: str, ran: int, slices: int, root: str = ROOT) -> None:
    """Slice ``ran`` was run and every entry of it caught: the next run takes the next."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"next": (ran + 1) % slices, "ran": ran, "commit": head(root),
                   "slices": slices, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)
    os.replace(tmp, path)


def commit_count(root: str = ROOT) -> int:
    r = subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=root, capture_output=True,
                       text=True)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else 0


# -- what pytest says ---------------------------------------------------------------------------

def _env(root: str, outcomes: str | None = None) -> dict:
    """The tests' environment with ``root`` first on the path: a process the
    tests start (``dpnb mcp``, ``dpnb grade``, the engines) imports the broken
    copy, not the checkout an editable install points at."""
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop(OUTCOMES_ENV, None)
    # run from inside an xdist worker (the checker's own tests), the child is no worker
    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        env.pop(var, None)
    if outcomes:
        env[OUTCOMES_ENV] = outcomes
    return env


#: the variable that marks every process one break's tests start (their children inherit it)
LEFT_MARK = "DPNB_BREAK_RUN"


def reap(mark: str) -> list[int]:
    """Stop what one break's run left running (a broken cleanup leaves what the
    cleanup would have stopped: a controller and its schedulers, say): the
    processes whose environment carries ``mark``, by PID -- psutil checks each
    one's start time before the signal -- never by name.  Their PIDs."""
    import psutil  # lazy: a dependency of ipyparallel, read only here

    left = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(LEFT_MARK) == mark:
                left.append(p)
        except (psutil.Error, OSError):  # gone, or not ours to read: not this run's
            continue
    for p in left:
        try:
            p.kill()
        except psutil.Error:  # ended by itself meanwhile
            pass
    psutil.wait_procs(left, timeout=5)
    return [p.pid for p in left]


def collected(files: list[str], root: str = ROOT) -> tuple[set[str], str]:
    """Every test id pytest collects from ``files``, and what it said if it failed."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p",
                        "no:cacheprovider", *files], cwd=root,
                       capture_output=True, text=True, env=_env(root))
    ids = {ln.strip() for ln in r.stdout.splitlines() if "::" in ln and not ln.startswith(" ")}
    said = "" if r.returncode == 0 else "; ".join(
        [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-3:])
    return ids, said


def covered(named: str, ids: set[str]) -> list[str]:
    """The collected ids a named test stands for: itself, its parametrized
    cases, or a whole module's tests."""
    return sorted(i for i in ids if i == named or i.startswith(named + "[")
                  or i.startswith(named + "::"))


def read_outcomes(path: str) -> dict[str, dict[str, str]]:
    """nodeid -> {phase: outcome}, and the reason under "why" for a skip or failure."""
    out: dict[str, dict[str, str]] = {}
    if not os.path.exists(path):
        return out
    with open(path) as fh:
        for ln in fh:
            if not ln.strip():
                continue
            rec = json.loads(ln)
            d = out.setdefault(rec["nodeid"], {})
            d[rec["when"]] = rec["outcome"]
            if rec.get("reason") and rec["outcome"] != "passed":
                d.setdefault("why", rec["reason"])
    return out


def passed(rec: dict[str, str] | None) -> bool:
    return bool(rec) and rec.get("call") == "passed" and "failed" not in (
        rec.get("setup"), rec.get("teardown"))


def failed(rec: dict[str, str] | None) -> bool:
    """Failed by the break: its call failed, or its setup raised (a fixture
    that the break broke).  A skip, or a test never reached, is not a failure."""
    return bool(rec) and (rec.get("call") == "failed" or rec.get("setup") == "failed")


#: pytest plugins a named test file does without unless it mentions them (each is
#: loaded at every pytest start: hypothesis's alone cost 0.8 s of a unit break's 1.9 s);
#: one process, no xdist: a break runs its few named tests in one
PLUGINS = {"hypothesispytest": ("hypothesis",), "anyio": ("anyio", "async def"),
           "xdist": ("xdist",)}


def lean(tests: tuple[str, ...] | list[str], root: str = ROOT) -> list[str]:
    """``-p no:NAME`` for each plugin of :data:`PLUGINS` no named test's file mentions."""
    texts = []
    for t in tests:
        path = os.path.join(root, t.split("::", 1)[0])
        try:
            with open(path) as f:
                texts.append(f.read())
        except OSError:  # a folder or a missing file: keep every plugin
            return []
    out = []
    for plugin, words in PLUGINS.items():
        if not any(w in text for w in words for text in texts):
            out += ["-p", f"no:{plugin}"]
    return out


def unbroken_outcomes(ids: list[str], root: str = ROOT) -> dict[str, dict[str, str]]:
    """One run of ``ids`` on the unbroken tree, every outcome read."""
    with tempfile.TemporaryDirectory(prefix="dpnb-baseline-") as d:
        path = os.path.join(d, "outcomes.jsonl")
        # side by side where there are many (xdist), as the suite runs them
        many = ["-n", "2"] if len(ids) > 10 else []
        env = _env(root, path)
        env[LEFT_MARK] = mark = f"{os.getpid()}-{time.monotonic_ns()}-baseline"
        try:
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *many, *ids], cwd=root, capture_output=True, text=True, env=env)
        finally:
            reap(mark)
        return read_outcomes(path)


# -- the checks before any break ----------------------------------------------------------------

def validate(chosen: list[Entry], baseline: dict[str, dict[str, str]] | None,
             root: str = ROOT) -> tuple[dict[str, list[str]], list[Verdict]]:
    """Each runnable entry's collected test ids, and a verdict for each entry
    that cannot be a fair trial: a named test missing, or not passing unbroken."""
    files = sorted({t.split("::")[0] for e in chosen for t in e.tests})
    ids, said = collected(files, root)
    ids_of: dict[str, list[str]] = {}
    bad: list[Verdict] = []
    for e in chosen:
        with open(os.path.join(root, e.file)) as fh:
            n = fh.read().count(e.old)
        if n != 1:
            bad.append(Verdict(e, "NOT RUN", f"{e.file} has {n} matches of the text"))
            continue
        missing = [t for t in e.tests if not covered(t, ids)]
        if missing:
            bad.append(Verdict(e, "INVALID", f"no such test collected: {', '.join(missing)}"
                               + (f" (pytest: {said})" if said else "")))
            continue
        ids_of[e.name] = sorted({i for t in e.tests for i in covered(t, ids)})
    if baseline is None:
        # never an empty list: pytest given no test id runs the whole suite
        todo = sorted({i for v in ids_of.values() for i in v})
        baseline = unbroken_outcomes(todo, root) if todo else {}
    for e in chosen:
        if e.name not in ids_of:
            continue
        notpass = [i for i in ids_of[e.name] if not passed(baseline.get(i))]
        if notpass:
            rec = baseline.get(notpass[0]) or {}
            how = ("not run" if not rec else
                   f"{rec.get('call') or rec.get('setup')}: {rec.get('why', '')}".strip(": "))
            bad.append(Verdict(e, "INVALID", f"does not pass unbroken: {notpass[0]} ({how})"
                               + (f" and {len(notpass) - 1} more" if len(notpass) > 1 else "")))
            del ids_of[e.name]
    return ids_of, bad


# -- one break ----------------------------------------------------------------------------------

def _copy(root: str) -> str:
    dst = tempfile.mkdtemp(prefix="dpnb-break-")
    shutil.copytree(root, os.path.join(dst, "tree"), ignore=_NOT_COPIED, symlinks=True)
    return os.path.join(dst, "tree")


def try_break(e: Entry, ids: list[str], tree: str, zygote: Zygote | None = None) -> Verdict:
    """Apply ``e`` in ``tree`` (a copy), run its named tests (all of them, no
    ``-x``), restore, and judge by the named tests' own outcomes.  With a
    ``zygote`` (of ``tree``), pytest is forked from it rather than started anew."""
    path = os.path.join(tree, e.file)
    with open(path) as fh:
        text = fh.read()
    outcomes = os.path.join(os.path.dirname(tree), "outcomes.jsonl")
    if os.path.exists(outcomes):
        os.remove(outcomes)
    t0 = time.monotonic()
    env = _env(tree, outcomes)
    env[LEFT_MARK] = mark = f"{os.getpid()}-{time.monotonic_ns()}-{os.path.basename(tree)}"
    try:
        with open(path, "w") as fh:
            fh.write(text.replace(e.old, e.new))
        args = ["-q", "-p", "no:cacheprovider", *lean(e.tests, tree), *e.tests]
        if zygote is not None:
            rc, said = zygote.pytest(args, env, os.path.join(os.path.dirname(tree), "pytest.out"))
        else:
            r = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=tree,
                               capture_output=True, text=True, env=env)
            rc, said = r.returncode, r.stdout + r.stderr
    finally:
        with open(path, "w") as fh:
            fh.write(text)
        reap(mark)  # what the broken tree's tests left running, stopped before the next break
    took = time.monotonic() - t0
    got = read_outcomes(outcomes)
    hit = [i for i in ids if failed(got.get(i))]
    last = ([ln for ln in said.splitlines() if ln.strip()] or ["(no output)"])[-1][-200:]
    if rc == 1 and hit:
        return Verdict(e, "caught", f"{len(hit)} of {len(ids)} named tests failed ({hit[0]})", took)
    if rc == 0 or (rc == 1 and not hit):
        return Verdict(e, "MISSED", f"no named test failed (pytest exit {rc}: {last})", took)
    return Verdict(e, "INVALID", f"pytest exit {rc} (collection or usage error, not a "
                   f"failing test): {last}", took)


def run(chosen: list[Entry], ids_of: dict[str, list[str]], jobs: int, root: str = ROOT,
        report=print) -> list[Verdict]:
    """Every entry in ``ids_of`` tried, ``jobs`` at a time, each worker in its own copy."""
    todo = [e for e in chosen if e.name in ids_of]
    lock = threading.Lock()  # the namespace tiers, one at a time
    trees = [_copy(root) for _ in range(max(1, min(jobs, len(todo))))]
    # started at first need; False: it could not start here (each break starts its own)
    zygotes: dict[str, Zygote | bool | None] = {t: None for t in trees}
    free: queue.SimpleQueue = queue.SimpleQueue()  # a copy per running break
    for t in trees:
        free.put(t)

    def one(e: Entry) -> Verdict:
        tree = free.get()
        try:
            if zygotes[tree] is None:
                zygotes[tree] = _zygote(tree) or False
            z = zygotes[tree] or None
            if e.tiers & TOGETHER:
                with lock:
                    v = try_break(e, ids_of[e.name], tree, z)
            else:
                v = try_break(e, ids_of[e.name], tree, z)
        finally:
            free.put(tree)
        report(v.line())
        return v

    try:
        with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return list(pool.map(one, todo))
    finally:
        for t in trees:
            if zygotes[t]:
                zygotes[t].close()
            shutil.rmtree(os.path.dirname(t), ignore_errors=True)


def _zygote(tree: str) -> Zygote | None:
    """A zygote for ``tree``; None (each break then starts its own pytest) where it
    cannot start, or with ``DPNB_BREAK_ZYGOTE=0`` (to compare, or to rule it out)."""
    if os.environ.get("DPNB_BREAK_ZYGOTE") == "0":
        return None
    try:
        return Zygote(tree, _env(tree))
    except (OSError, RuntimeError) as e:
        print(f"note: each break starts its own pytest ({e})", flush=True)
        return None
