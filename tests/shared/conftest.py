"""The shared-host tier: a second unix user on this machine tries dpnb's cluster.

Root only (it creates the user, and later a third network-namespace host);
skipped elsewhere with the reason.  The user is removed afterwards, also when
a test fails.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest

INTRUDER = pathlib.Path(__file__).resolve().parents[1] / "helpers" / "intruder.py"


class Intruder:
    """Runs :mod:`helpers.intruder` as the second user (root starts it, it drops
    to that user before trying anything)."""

    def __init__(self, user: str):
        self.user = user

    def argv(self, plan: dict) -> list[str]:
        return [sys.executable, str(INTRUDER), "--as", self.user, json.dumps(plan)]

    def run(self, plan: dict, timeout: float = 90) -> dict:
        p = subprocess.run(self.argv(plan), capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    def start(self, plan: dict) -> subprocess.Popen:
        return subprocess.Popen(self.argv(plan), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    @staticmethod
    def result(p: subprocess.Popen, timeout: float = 90) -> dict:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def intruder():
    if os.geteuid() != 0:
        pytest.skip("shared-host tier: needs root (creates a second unix user)")
    name = f"dpnbx{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    try:
        yield Intruder(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)
