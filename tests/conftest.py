"""Test-wide settings and the one layout rule: a test's folder is its tier.

``unit/`` (fast, one machine, no engine and no cluster: pure logic, plus short
Python subprocesses, world-size-1 gloo groups, and local sockets and threads
where the thing tested is one -- the wire's servers, the import checks), ``cluster/``
(real ipyparallel engines or multi-process gloo groups), ``ecosystem/`` (code
written the way other projects write it -- torchrun scripts, DDP/FSDP/ZeRO
built in cells, Accelerate -- on real clusters), ``multihost/``
(two hosts from network namespaces: ssh, Slurm, Open MPI), ``shared/`` (a
second unix user and a third namespace host attack a running cluster; root
only), ``notebook/``
(nbclient), ``browser/`` (JupyterLab in Chromium), ``slow/`` (fresh virtual
environments, the benchmark smoke run), ``standin/`` (dpnb's engine code on
multi-process groups whose backend, like NCCL, serves the CUDA device type
only: a CPU tensor at a collective fails as under NCCL; see
``helpers/standin.py``), ``gpu/`` (one CUDA GPU; skipped
without one).  Each test gets its folder's marker here, so
``-m "not cluster and not ecosystem and not multihost and not shared and not notebook and not browser and not slow and not gpu and not standin"``
selects the fast tier (the same tests as ``tests/unit``).  Shared helpers are the package ``tests/helpers``.

IPython/Jupyter state is kept out of the user's home.
"""

import os
import pathlib
import signal
import tempfile

import pytest

_home = tempfile.mkdtemp(prefix="dpnb-test-home-")
for var, sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter-config"),
                 ("JUPYTER_DATA_DIR", "jupyter-data"), ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"),
                 ("MPLCONFIGDIR", "mpl")):
    os.environ[var] = os.path.join(_home, sub)
    os.makedirs(os.environ[var], exist_ok=True)
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests press Ctrl-C by sending SIGINT to this process, as Jupyter does to a
# kernel.  A run started in the background by a non-interactive shell
# (`.ci/run &`) inherits SIGINT ignored, and Python keeps it ignored: those
# tests then waited for an interrupt that never came (three failed that way
# here).  A kernel always handles SIGINT, so the tests run with Python's own
# handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

TESTS = pathlib.Path(__file__).resolve().parent
TIERS = ("unit", "cluster", "ecosystem", "multihost", "shared", "notebook", "browser", "slow",
         "standin", "gpu", "hosted")


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            tier = pathlib.Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
