"""The multi-host tier: two hosts made of network namespaces (see helpers.hosts)."""

import pytest
from helpers import hosts as _hosts


@pytest.fixture(scope="module")
def two_hosts():
    why = _hosts.missing()
    if why:
        pytest.skip(f"multi-host tier: {why}")
    with _hosts.Hosts(2) as hs:
        yield hs
