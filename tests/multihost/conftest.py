"""The multi-host tier: two hosts made of network namespaces (see helpers.hosts)."""

import pytest
from helpers import hosts as _hosts


@pytest.fixture(scope="module")
def two_hosts():
    with _hosts.hosts_or_skip(2, "multi-host tier") as hs:
        yield hs
