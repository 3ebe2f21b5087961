"""``c.pull`` sends tensors on the CPU (dpnb.engine.runner.get_value): a CUDA
tensor unpickled in the notebook would open a CUDA context there, on the
engine's device number, or fail on a host without a GPU.  No GPU here: a
tensor that reports a CUDA device stands in for one."""

from collections import OrderedDict, namedtuple

import pytest

torch = pytest.importorskip("torch")

Pair = namedtuple("Pair", "loss step")


class CudaLooking(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (its results are plain tensors)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return torch.device("cuda", 1)


def cuda_looking(*values):
    return torch.tensor(values).as_subclass(CudaLooking)


def test_a_pulled_value_carries_cuda_tensors_to_the_notebook_on_the_cpu(monkeypatch):
    from ipyparallel.serialize import deserialize_object

    from dpnb.engine import runner

    value = {"w": cuda_looking(1.0, 2.0),
             "hist": [cuda_looking(3.0), 7, (cuda_looking(4.0),)],
             "pair": Pair(cuda_looking(5.0), 3),
             "od": OrderedDict(g=cuda_looking(6.0))}
    monkeypatch.setattr(runner, "user_ns", lambda: {"stats": value})
    got, _ = deserialize_object(runner.get_value("stats"))
    tensors = [got["w"], got["hist"][0], got["hist"][2][0], got["pair"].loss, got["od"]["g"]]
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)
    assert got["w"].tolist() == [1.0, 2.0] and got["hist"][1] == 7 and got["pair"].step == 3
    assert isinstance(got["pair"], Pair) and isinstance(got["od"], OrderedDict)
    # the rank's own value is left on its device
    assert type(value["w"]) is CudaLooking
