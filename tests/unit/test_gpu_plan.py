"""Issue 29, defect 7: the GPU a rank drives is the one ``LOCAL_RANK`` names.

``--gpus 2,3`` used to give rank 0 ``cuda:2`` with ``LOCAL_RANK=0``: user
code and libraries calling ``torch.cuda.set_device(local_rank)`` moved to GPU
0, another rank's.  Now the engines are shown the chosen GPUs the way a
torchrun user shows them (``CUDA_VISIBLE_DEVICES``), counted with NVML so that
CUDA is not initialised before that, and a launcher that binds a GPU per task
(Slurm ``--gpus-per-task``) is recognised instead of falling back to gloo.
No GPU here: the plan is pure, the engine half is driven with NVML's and the
process map's answers made up.
"""

from __future__ import annotations

import os

import pytest

from dpnb.cluster.gpuplan import choose_backend, with_devices
from dpnb.cluster.launch import rank_init_info
from dpnb.cluster.placement import assign_ranks
from dpnb.core.errors import ConfigError
from dpnb.core.gpus import EngineGpus, GpuPick, bound_per_task, host_gpus, pick_gpus, visible_list
from dpnb.errors import DpnbError

ALL4 = ("GPU-a", "GPU-b", "GPU-c", "GPU-d")


def _probe(host, eid, *, ids=ALL4, visible=None):
    return {"host": host, "ip": "10.0.0.1", "pid": 100 + eid, "cuda_devices": len(ids),
            "gpu_ids": list(ids), "cuda_visible": visible}


def test_gpus_2_3_show_those_gpus_and_each_rank_drives_its_local_rank():
    probes = {0: _probe("a", 0), 1: _probe("a", 1)}
    ranks = with_devices(assign_ranks(probes), "nccl", [2, 3], probes)
    assert [(r.local_rank, r.device, r.visible_devices, r.device_fallback) for r in ranks] == [
        (0, "cuda:0", "2,3", 2), (1, "cuda:1", "2,3", 3)]
    info = rank_init_info(ranks[1], world_size=2, backend="nccl", master_addr="x", master_port=1,
                          timeout_s=3.0, threads=1, local=True, watch_ppid=None)
    # what init_rank gets: LOCAL_RANK 1, device index 1 within "2,3" = physical GPU 3
    assert (info["local_rank"], info["device_index"], info["visible_devices"]) == (1, 1, "2,3")


def test_without_gpus_nothing_is_hidden_and_local_rank_is_the_device():
    probes = {0: _probe("a", 0), 1: _probe("a", 1)}
    ranks = with_devices(assign_ranks(probes), "nccl", None, probes)
    assert [(r.device, r.visible_devices) for r in ranks] == [("cuda:0", ""), ("cuda:1", "")]
    assert [r.device for r in with_devices(ranks, "gloo", [2, 3], probes)] == ["cpu", "cpu"]


def test_gpus_count_within_a_list_the_engines_were_already_shown():
    assert visible_list("4,5,6,7", [1, 3]) == "5,7"
    assert visible_list("GPU-x,GPU-y", [1]) == "GPU-y"
    assert visible_list(None, [3, 1]) == "3,1"
    with pytest.raises(ConfigError, match=r"ordinal 4 is beyond the 4 GPUs .*CUDA_VISIBLE_DEVICES="
                                          r"4,5,6,7.*below 4"):
        visible_list("4,5,6,7", [0, 4])
    probes = {0: _probe("a", 0, visible="4,5,6,7"), 1: _probe("a", 1, visible="4,5,6,7")}
    ranks = with_devices(assign_ranks(probes), "nccl", [1, 3], probes)
    assert {r.visible_devices for r in ranks} == {"5,7"}
    with pytest.raises(DpnbError, match="beyond the 4 GPUs"):
        with_devices(assign_ranks(probes), "nccl", [1, 9], probes)


def test_a_gpu_per_task_launch_is_nccl_with_each_rank_on_the_gpu_it_sees():
    # Slurm --gpus-per-task=1: every task sees one GPU, a different one
    probes = {0: _probe("n1", 0, ids=("GPU-a",), visible="0"),
              1: _probe("n1", 1, ids=("GPU-b",), visible="1")}
    ranks = assign_ranks(probes)
    assert choose_backend("auto", ranks, probes, None) == "nccl"  # was gloo: 1 GPU < 2 engines
    assert [(r.device, r.visible_devices) for r in with_devices(ranks, "nccl", None, probes)] == [
        ("cuda:0", ""), ("cuda:0", "")]
    with pytest.raises(DpnbError, match="already gave each of this host's 2 engines its own GPU"):
        with_devices(ranks, "nccl", [0, 1], probes)


def test_engines_sharing_a_gpu_are_not_a_per_task_launch():
    one = EngineGpus(0, 0, 1, ("GPU-a",))
    assert not bound_per_task([one, EngineGpus(1, 1, 1, ("GPU-a",))])
    assert host_gpus([one, EngineGpus(1, 1, 1, ("GPU-a",))]) == 1
    assert not bound_per_task([EngineGpus(0, 0, 2), EngineGpus(1, 1, 2)])  # NVML could not tell
    assert host_gpus([EngineGpus(0, 0, 2), EngineGpus(1, 1, 2)]) == 2
    assert pick_gpus([EngineGpus(0, 0, 2), EngineGpus(1, 1, 2)], None) == {
        0: GpuPick(0), 1: GpuPick(1)}


# -- the engine half -------------------------------------------------------

def test_counting_gpus_uses_nvml_and_never_the_cuda_runtime(monkeypatch):
    import torch

    from dpnb.engine import device

    def no_cuinit(*a):
        raise AssertionError("the CUDA runtime was asked: cuInit would fix CUDA_VISIBLE_DEVICES")

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", lambda: list(ALL4))
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", no_cuinit, raising=False)
    monkeypatch.setattr(torch.accelerator, "device_count", no_cuinit)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert device.gpu_ids() == ("GPU-c", "GPU-a")
    assert device.device_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-d,7,1")  # CUDA stops at the bad entry
    assert device.gpu_ids() == ("GPU-d",)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert device.gpu_ids() == ALL4


def test_no_nvml_falls_back_to_the_runtime_count(monkeypatch):
    import torch

    from dpnb.engine import device

    def no_lib():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", no_lib)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 3)
    assert device.gpu_ids() is None and device.device_count() == 3


def test_driver_loaded_reads_the_process_map(tmp_path):
    from dpnb.engine.device import driver_loaded

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not driver_loaded(str(maps))
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/libcuda.so.580.1\n")
    assert driver_loaded(str(maps))
    # with no path: this process's own map, read the same way as the file above
    with open("/proc/self/maps") as f:
        own = any("/libcuda.so" in line for line in f)
    assert driver_loaded() == own, "this process's own map was not read"


def test_show_gpus_sets_the_list_once_and_refuses_after_cuinit(tmp_path, monkeypatch):
    from dpnb.engine import device

    clean, loaded = tmp_path / "clean", tmp_path / "loaded"
    clean.write_text("")
    loaded.write_text("1-2 r-xp 0 0:0 1 /lib/libcuda.so.1\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.delenv("DPNB_CUDA_VISIBLE_DEVICES_BEFORE", raising=False)
    assert device.show_gpus("5,7", str(clean))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert device.inherited_visible() == "4,5,6,7"  # a re-probe plans from the original
    assert device.show_gpus("5,7", str(loaded))  # already so: nothing to change
    assert not device.show_gpus("4", str(loaded))  # CUDA read the list already
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"


def test_the_zygote_refuses_to_fork_once_the_driver_is_loaded(monkeypatch):
    from dpnb.engine import device
    from dpnb.engine import hostagent

    agent = object.__new__(hostagent.Agent)  # the check reads no attribute of it
    agent._check_fork_safe()  # CPU torch, no driver: fine
    monkeypatch.setattr(device, "driver_loaded", lambda maps="/proc/self/maps": True)
    with pytest.raises(RuntimeError, match="CUDA was initialised in the zygote"):
        agent._check_fork_safe()


def test_a_gpu_per_task_rank_sees_local_rank_0_as_srun_torchrun_gives_each_task():
    """Under --gpus-per-task every engine's one GPU is cuda:0: the LOCAL_RANK
    its code sees must name it (``set_device(LOCAL_RANK)`` in Accelerate,
    Lightning, most scripts), as ``srun torchrun --nproc-per-node=1`` gives:
    each task its own agent, local rank 0 of 1, one node per task."""
    from dpnb.engine.proc.workerenv import torchrun_env

    probes = {0: _probe("n1", 0, ids=("GPU-a",), visible="0"),
              1: _probe("n1", 1, ids=("GPU-b",), visible="1")}
    ranks = with_devices(assign_ranks(probes), "nccl", None, probes)
    envs = [torchrun_env(rank_init_info(r, world_size=2, backend="nccl", master_addr="x",
                                        master_port=1, timeout_s=3.0, threads=1, local=False,
                                        watch_ppid=None)) for r in ranks]
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"])
            for e in envs] == [("0", "1", "0", "2"), ("0", "1", "1", "2")]
    assert [r.device for r in ranks] == ["cuda:0", "cuda:0"]
    # engines that share the host's GPUs keep torchrun's per-host numbering
    probes = {0: _probe("a", 0), 1: _probe("a", 1)}
    shared = with_devices(assign_ranks(probes), "nccl", None, probes)
    env = torchrun_env(rank_init_info(shared[1], world_size=2, backend="nccl", master_addr="x",
                                      master_port=1, timeout_s=3.0, threads=1, local=True,
                                      watch_ppid=None))
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("1", "2", "0")
