"""``dpnb`` command line: ``dpnb demo`` (the main job, headless),
``dpnb doctor`` (what this environment gives dpnb), ``dpnb course build DIR``,
``dpnb kernel install``, ``dpnb grade SUBMISSION...`` (submitted notebooks
graded on the grader's own cluster: :mod:`dpnb.gradecli`) and ``dpnb mcp`` (an agent's
server over a live cluster: a running notebook's, or a kept one)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from importlib import resources

from . import gradecli
from .core.strategies import STRATEGIES


def kernel_spec(python: str | None = None) -> dict:
    """The "Python 3 (dpnb)" kernelspec, bound to ``python`` (default: this one)."""
    spec = json.loads(resources.files("dpnb").joinpath("kernelspec/kernel.json").read_text())
    spec["argv"][0] = python or sys.executable
    return spec


def install_kernel(*, user: bool = False, sys_prefix: bool = False, prefix: str | None = None,
                   name: str = "dpnb") -> str:
    """Install the kernelspec with jupyter_client; returns the installed path."""
    # lazy: each subcommand loads only what it runs
    from jupyter_client.kernelspec import KernelSpecManager

    if sum(map(bool, (user, sys_prefix, prefix))) > 1:
        raise SystemExit("choose one of --user, --sys-prefix, --prefix")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, name)
        os.makedirs(src)
        with open(os.path.join(src, "kernel.json"), "w") as f:
            json.dump(kernel_spec(), f, indent=2)
        if sys_prefix:
            prefix = sys.prefix
        return KernelSpecManager().install_kernel_spec(src, kernel_name=name, user=user,
                                                       prefix=prefix)


def _version() -> str:
    """The installed metadata's version (what ``dpnb.__version__`` also reads).
    Read here, not from the package: ``python -m dpnb.cli`` run in a folder
    holding a ``dpnb/`` directory (the private runtime folder's name) sees a
    namespace package named dpnb without the attribute."""
    from importlib.metadata import PackageNotFoundError, version  # lazy: only for --version's text

    try:
        return version("dpnb")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        return "0+unknown"


def parser() -> argparse.ArgumentParser:
    """Every subcommand's arguments (``dpnb -h``, ``dpnb SUBCOMMAND -h``)."""
    p = argparse.ArgumentParser(prog="dpnb", description=__doc__)
    p.add_argument("--version", action="version", version=f"dpnb {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)

    dr = sub.add_parser("doctor", help="check this environment for dpnb (torch, GPUs, "
                                       "ipyparallel, JupyterLab, limits); paste it into an issue")
    dr.add_argument("--json", action="store_true", help="the findings as JSON")

    d = sub.add_parser("demo", help="run the quick start on CPU engines, headless; "
                                    "writes figures and an HTML report")
    d.add_argument("--out", default="demo-out", help="output folder (default demo-out)")
    d.add_argument("-n", type=int, default=2, help="engines (default 2)")
    d.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    d.add_argument("--strategy", default="ddp", choices=STRATEGIES)

    c = sub.add_parser("course", help="the course's notebooks")
    csub = c.add_subparsers(dest="ccmd", required=True)
    cb = csub.add_parser("build", help="execute every chapter and write it as HTML (+ index.html)")
    cb.add_argument("dir", help="output folder")
    cb.add_argument("--notebooks", default="notebooks", help="the chapters' folder (default notebooks)")
    cb.add_argument("--only", default=None, help="chapter numbers, e.g. 00,03")
    cb.add_argument("--timeout", type=int, default=300, help="seconds per cell (default 300)")

    k = sub.add_parser("kernel", help="manage the 'Python 3 (dpnb)' Jupyter kernel")
    ksub = k.add_subparsers(dest="kcmd", required=True)
    ki = ksub.add_parser("install", help="install the kernelspec")
    g = ki.add_mutually_exclusive_group()
    g.add_argument("--user", action="store_true", help="for this user")
    g.add_argument("--sys-prefix", action="store_true", help="into this environment")
    g.add_argument("--prefix", default=None, help="into PREFIX/share/jupyter/kernels")
    ki.add_argument("--name", default="dpnb")

    m = sub.add_parser("mcp", help="serve a live cluster (a running notebook's, or a kept "
                                   "one) to an agent over the Model Context Protocol (stdio); "
                                   "needs pip install \"dpnb[agent]\"")
    m.add_argument("--attach", default=None, metavar="ID",
                   help="which cluster (a running kernel's, or a kept one: %%dp list); default: "
                        "the only one")
    m.add_argument("--allow-actions", action="store_true",
                   help="also serve interrupt, restart, reform and save")
    m.add_argument("--allow-code", action="store_true",
                   help="also serve run_code: code on the ranks, with a timeout")
    m.add_argument("--http", type=int, default=None, metavar="PORT",
                   help="serve streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio; requests "
                        "need the bearer token the server writes to its private folder")

    gradecli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.cmd == "doctor":
        # lazy: each subcommand loads only what it runs
        from .doctor import main as doctor

        return doctor(as_json=a.json)
    if a.cmd == "mcp":
        try:
            # lazy: each subcommand loads only what it runs
            from .agent.server import serve
        except ModuleNotFoundError as e:
            if e.name != "mcp":
                raise
            print('dpnb mcp: the mcp SDK is not installed: pip install "dpnb[agent]"',
                  file=sys.stderr)
            return 2
        return serve(a.attach, allow_actions=a.allow_actions, allow_code=a.allow_code,
                     http_port=a.http)
    if a.cmd == "grade":
        return gradecli.run(a)
    if a.cmd == "kernel":
        path = install_kernel(user=a.user, sys_prefix=a.sys_prefix, prefix=a.prefix,
                              name=a.name)
        print(f"installed kernelspec '{a.name}' in {path}")
        return 0
    if a.cmd == "course":
        # lazy: each subcommand loads only what it runs
        from .course import build

        try:
            done = build(a.dir, a.notebooks, a.only.split(",") if a.only else None, a.timeout)
        except (FileNotFoundError, ValueError) as e:
            print(f"dpnb course build: {e}", file=sys.stderr)
            return 2
        failed = [b for b in done if b.error]
        for b in done:
            print(f"{b.html} ({b.seconds:.0f} s){'  FAILED: ' + b.error if b.error else ''}")
        print(f"index: {os.path.join(a.dir, 'index.html')}")
        return 1 if failed else 0
    if a.cmd == "demo":
        # lazy: each subcommand loads only what it runs
        from .demo import run_demo

        report = run_demo(a.out, n=a.n, steps=a.steps, strategy=a.strategy)
        print(f"demo report: {report}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
