"""``POST /api/dpnb/clusters/start``: the sidebar's Start, a kept cluster that any notebook attaches.

The server checks the request's body with the checks ``%dp start`` makes
before anything starts (:func:`dpnb.cluster.launch.check_start_args`, the
launcher's own ``check_start``: the ssh ``HOST=N`` counts, the Slurm keys,
``--keep``'s time to live and its writable record folder), then runs
``python -m dpnb.lab.start`` -- a process of its own, as :mod:`dpnb.lab.act`,
so no ipyparallel client or cluster atexit hook lives in the server.  That
process starts the cluster with ``keep=TTL``, writes its kept record and lets
go (:func:`dpnb.cluster.keep.release`): the cluster is free, listed by
``GET /api/dpnb/clusters`` from its record, and a notebook takes it up with
``%dp attach ID`` (the attach-code action); the reaper stops it once its TTL
has passed with nobody holding it.

A kept cluster takes local engines only (its engines must outlive the
process that started them; ssh agents and Slurm jobs are held by that
process's connections).  So an ssh or Slurm profile is checked here and
answered with the ``%dp start`` line the sidebar runs in the current
notebook (:func:`magic_line`): that kernel holds the connections, and the
cluster is the notebook's, in its code, from the first cell.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from ..cluster import keep as keeping
from ..cluster import launch
from ..cluster.launchers import launcher_for
from ..cluster.launchers.slurm_mpi import SLURM_KEYS
from ..cluster.types import StartOptions
from ..cluster.types import LaunchSpec
from ..core.errors import UserError
from ..errors import DpnbError

#: the time to live of a panel-started cluster when the body names none
DEFAULT_TTL = "1h"
#: seconds the starting process may take (engines import torch one by one)
START_TIMEOUT_S = 180
KEYS = ("n", "launcher", "hosts", "slurm", "keep", "backend")


class StartRequestError(UserError):
    """A start request the server refuses before anything starts (answered 400)."""


def _hosts(hosts) -> list[str]:
    """``"node1=2 node2=2"`` or ``["node1=2", ...]`` -> the ssh ``--launcher-arg`` list."""
    if hosts is None:
        return []  # refused by the ssh launcher's own check, with the example
    if isinstance(hosts, str):
        return hosts.replace(",", " ").split()
    if isinstance(hosts, list) and all(isinstance(h, str) for h in hosts):
        return hosts
    raise StartRequestError("hosts: give HOST=N for each host, e.g. \"node1=2 node2=2\"")


def _slurm(opts) -> list[str]:
    """``{"queue": "gpu", ...}`` -> the Slurm ``--launcher-arg KEY=VALUE`` list, keys checked."""
    if not isinstance(opts, dict):
        raise StartRequestError(f"slurm: give an object of settings ({', '.join(SLURM_KEYS)})")
    bad = sorted(set(opts) - set(SLURM_KEYS))
    if bad:
        raise StartRequestError(f"slurm setting {bad[0]!r}: slurm takes {', '.join(SLURM_KEYS)}")
    return [f"{k}={v}" for k, v in opts.items()]


#: a profile's settings in the body -> the launcher's ``--launcher-arg`` words
PROFILE_ARGS = {"ssh": lambda body: _hosts(body.get("hosts")),
                "slurm": lambda body: _slurm(body.get("slurm") or {})}


def checked(body) -> dict:
    """The body of a start request -> keyword arguments of :meth:`dpnb.Cluster.start`,
    or StartRequestError with one line saying what to change."""
    if not isinstance(body, dict):
        raise StartRequestError('give a JSON object, e.g. {"n": 2, "launcher": "local"}')
    unknown = sorted(set(body) - set(KEYS))
    if unknown:
        raise StartRequestError(f"unknown setting {unknown[0]!r}: give {', '.join(KEYS)}")
    n, engines = body.get("n", 2), body.get("launcher", "local")
    backend, ttl = body.get("backend", "auto"), body.get("keep", DEFAULT_TTL)
    # the launcher's own settings, as --launcher-arg words (by name: only the launcher
    # classes compare launcher names)
    to_args = PROFILE_ARGS.get(engines)
    args = to_args(body) if to_args else []
    try:
        launch.check_start_args(n, backend, engines, None, None, None)
        starter = launcher_for(LaunchSpec(engines=engines, launcher_args=tuple(args)))
        starter.check(n)  # ssh: HOST=N counts against n, an ssh client here
        keeping.checked_ttl(ttl)
    except DpnbError as e:
        raise StartRequestError(str(e)) from None
    if not starter.engines_here:  # engines held by the starting process's connections
        if "keep" in body:
            raise StartRequestError(f"a kept cluster takes local engines: leave keep out, and "
                                    f"the panel starts the {engines} engines in your notebook's "
                                    f"kernel, which holds their connections")
        ttl = None  # the notebook's kernel holds it: not kept
    return {"n": n, "backend": backend, "engines": engines, "launcher_args": args, "keep": ttl}


def magic_line(kwargs: dict) -> str:
    """The ``%dp start`` line that starts :func:`checked`'s cluster in a kernel."""
    words = ["%dp", "start", "-n", str(kwargs["n"]), "--engines", kwargs["engines"]]
    if kwargs["backend"] != "auto":
        words += ["--backend", kwargs["backend"]]
    for a in kwargs["launcher_args"]:
        words += ["--launcher-arg", shlex.quote(a)]
    return " ".join(words)


def start(body) -> dict:
    """Check ``body`` and start the kept cluster in a process of its own:
    ``{"id", "world_size", "message"}``; for ssh or Slurm engines, start nothing
    and answer ``{"in_kernel": True, "code", "message"}`` (the line to run).  StartRequestError for bad input (nothing
    started); RuntimeError with the starting process's last line if it failed."""
    kwargs = checked(body)
    if kwargs["keep"] is None:  # ssh, Slurm: the notebook's kernel starts and holds it
        code = magic_line(kwargs)
        return {"in_kernel": True, "code": code,
                "message": f"{kwargs['engines']} engines are held by a kernel's connections: "
                           f"running {code} in your notebook"}
    try:
        proc = subprocess.run([sys.executable, "-m", "dpnb.lab.start", json.dumps(kwargs)],
                              capture_output=True, text=True, timeout=START_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"start failed: no cluster after {START_TIMEOUT_S} s "
                           f"(the starting process was stopped)") from None
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"start failed: {lines[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    """The starting process: start, record, let go; one JSON line on stdout."""
    # lazy: torch and ipyparallel only in the starting process, never in the server
    from ..session import Cluster

    kwargs = json.loads(argv[0])
    c = Cluster.start_with(StartOptions(**{**kwargs, "launcher_args": tuple(kwargs["launcher_args"])}))
    # free: listed from its record, the reaper's countdown runs (this process's exit
    # would let go too; done here so the line below is printed only once it is free)
    keeping.release(c)
    print(json.dumps({"id": c.cluster_id, "world_size": c.world_size,
                      "message": f"started kept cluster {c.cluster_id} ({c.world_size} ranks, "
                                 f"{c.backend}): %dp attach {c.cluster_id} takes it up"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
