"""Shared fixture: byte counts measured on real DDP / ZeRO-1 / FSDP2 objects."""

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def engine_measurements() -> dict[str, Any]:
    """Run helpers/measure_engines.py once (a few seconds) in a subprocess and parse its JSON.

    A subprocess keeps the fake process group, and torch itself, out of the
    test process.
    """
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(HERE.parent / "helpers" / "measure_engines.py")],
        capture_output=True, text=True, env=env, timeout=240,
    )
    if proc.returncode != 0:
        pytest.fail(f"measure_engines.py failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)
