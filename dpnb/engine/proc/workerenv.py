"""What a process torchrun starts sees, given to each engine: its environment
variables and no interactive prompt.

Code written for torchrun -- and libraries that ask how they were launched
(Lightning Fabric, Accelerate, torch itself) -- reads these to find its rank
and to decide whether to start processes.  Under dpnb the ranks already
exist, so every engine must look like one of torchrun's workers.
"""

from __future__ import annotations

import sys


def torchrun_env(info: dict) -> dict[str, str]:
    """The variables torchrun's agent gives each worker it starts
    (``torch.distributed.elastic.agent.server.local_elastic_agent``), for this rank.

    With ``TORCHELASTIC_RUN_ID`` set, libraries that ask "was I launched by
    torchelastic?" (``torch.distributed.is_torchelastic_launched``, Lightning's
    ``TorchElasticEnvironment.detect``) get yes, as under torchrun, and take
    the ranks from this environment instead of starting processes.
    ``TORCHELASTIC_USE_AGENT_STORE=False``: rank 0 serves the store itself
    (what torchrun sets when its agent does not share its store; ``True``
    would send an ``env://`` rendezvous to an agent store that is not there).
    Not set: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (dpnb's release of a blocked
    group decides how NCCL errors end) and ``OMP_NUM_THREADS`` (set by
    threads, below).
    """
    rank, world = int(info["rank"]), int(info["world_size"])
    local, local_world, group, groups = (info["local_rank"], info["local_world_size"],
                                         info["node_rank"], info.get("nnodes", 1))
    if info.get("own_gpu"):
        # A launcher bound this engine its own GPU (Slurm --gpus-per-task): it
        # is cuda:0 here, so set_device(LOCAL_RANK) must name 0 -- what
        # `srun --gpus-per-task=1 torchrun --nproc-per-node=1` gives each
        # task: its own agent, local rank 0 of 1, one node per task.
        local, local_world, group, groups = 0, 1, rank, world
    env = {
        "RANK": rank,
        "WORLD_SIZE": world,
        "LOCAL_RANK": local,
        "LOCAL_WORLD_SIZE": local_world,
        "GROUP_RANK": group,
        "GROUP_WORLD_SIZE": groups,
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": world,
        "ROLE_NAME": "default",
        "TORCHELASTIC_RESTART_COUNT": 0,
        "TORCHELASTIC_MAX_RESTARTS": 0,
        "TORCHELASTIC_RUN_ID": info.get("run_id") or "dpnb",
        "TORCHELASTIC_USE_AGENT_STORE": False,
        "MASTER_ADDR": info["master_addr"],
        "MASTER_PORT": info["master_port"],
    }
    return {k: str(v) for k, v in env.items()}


def as_a_worker() -> None:
    """Drop ``sys.ps1``/``ps2``/``ps3``, which the engine's IPython set.

    IPython sets them "so that scripts can decide if they are running
    interactively"; Python itself defines ``sys.ps1`` only in interactive
    mode.  An engine is not: nobody types at it, it runs cells a notebook
    sends, and the same code under torchrun sees no ``sys.ps1``.  Libraries
    that read it refuse multi-process work there (Lightning Fabric refuses
    ``strategy="ddp"`` "in an interactive environment", where it would
    start processes from the notebook; here the ranks already exist).
    """
    for name in ("ps1", "ps2", "ps3"):
        if hasattr(sys, name):
            delattr(sys, name)
