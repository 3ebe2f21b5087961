"""Every test here runs real multi-process gloo groups: the `cluster` tier."""

import pathlib

import pytest

_HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # this hook sees every collected item, not just this folder's
    for item in items:
        if _HERE in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.cluster)
