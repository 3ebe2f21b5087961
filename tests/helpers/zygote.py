"""A fresh pytest per break without paying for torch's import each time.

Every deliberate break (``tests/break_on_purpose.py``) runs its few named
tests in a pytest of its own, in a copy of the tree with one file changed.
On 2 cores most of a unit break's time went to the interpreter importing the
same third-party libraries again: torch alone is 1.9 s of a unit break's
2.2 s.  A :class:`Zygote` is one Python process per copy of the tree that
imports those libraries once -- never dpnb nor the tests, whose files the
breaks change -- and forks one child per break.  The child takes the break's
environment, runs ``pytest.main`` with the break's arguments in the copy,
writes its output to a file and exits with pytest's code; the zygote itself
stays as it was, so each break starts from the same clean state.

What a child shares with its zygote is only what :data:`PRELOADED` imported,
which dpnb's tests import anyway; ``sys.modules`` holds no dpnb module
(the zygote refuses to start if one got in), so each break imports the
broken file, as a new interpreter would.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

log = logging.getLogger("dpnb.tests.zygote")

#: imported once by the zygote: the heavy third-party libraries the tests import
PRELOADED = ("torch", "torch.distributed", "numpy", "IPython", "ipywidgets", "ipyparallel",
             "matplotlib", "pytest", "_pytest.config", "hypothesis", "xdist")

#: the zygote's own program: preload, then one forked pytest per request line
_SERVER = r"""
import importlib, json, os, sys
for m in PRELOADED:
    try:
        importlib.import_module(m)
    except ImportError:
        pass  # not installed here: the child imports it (or skips) as pytest would
leaked = sorted(m for m in sys.modules if m == "dpnb" or m.startswith(("dpnb.", "tests.")))
if leaked:
    sys.stderr.write("zygote: dpnb modules imported before any break: %s\n" % leaked)
    sys.exit(3)
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.clear()
            os.environ.update(req["env"])
            os.chdir(req["cwd"])
            sys.argv = ["pytest", *req["args"]]
            import pytest
            rc = int(pytest.main(req["args"]))
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException as e:  # the child never returns into the zygote's loop
            sys.stderr.write("zygote child: %r\n" % (e,))
            sys.stderr.flush()
            rc = 99
        os._exit(rc)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class Zygote:
    """One preloaded interpreter for the tree ``cwd``, forking a pytest per :meth:`pytest` call.

    Calls are one at a time (a zygote per copy of the tree, as the runner
    keeps a copy per job)."""

    def __init__(self, cwd: str, env: dict):
        self.cwd = cwd
        code = f"PRELOADED = {PRELOADED!r}\n" + _SERVER
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        first = self.proc.stdout.readline()
        if not first.startswith('{"ready"'):
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            self.close()
            raise RuntimeError(f"the zygote did not start: {first.strip()} {err.strip()[-300:]}")

    def pytest(self, args: list[str], env: dict, out: str) -> tuple[int, str]:
        """pytest's exit code and output for ``args`` run in a fresh fork with ``env``."""
        self.proc.stdin.write(json.dumps({"args": args, "env": env, "cwd": self.cwd,
                                          "out": out}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote exited ({self.proc.poll()}): "
                               f"{self.proc.stderr.read().strip()[-300:]}")
        with open(out, errors="replace") as f:
            text = f.read()
        return json.loads(line)["rc"], text

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("the zygote %d did not exit on end of input; killed", self.proc.pid)
                self.proc.kill()
                self.proc.wait()
