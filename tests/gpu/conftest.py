"""The GPU tier: runs on a machine with one CUDA GPU, skips cleanly elsewhere."""

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        ok = torch.cuda.is_available()
        why = "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    except ImportError:
        ok, why = False, "torch is not installed"
    if ok:
        return
    skip = pytest.mark.skip(reason=f"gpu tier: {why}")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def gpu_cluster():
    """World size 1 over NCCL on GPU 0."""
    import dpnb

    c = dpnb.start(1, backend="nccl", timeout=20)
    yield c
    c.stop()
