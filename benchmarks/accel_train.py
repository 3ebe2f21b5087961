"""The training function that ``accelerate.notebook_launcher`` runs in the
start-up benchmark: build the benchmark model and data, let accelerate
prepare them (DDP, a sharded DataLoader), take ``steps`` AdamW steps, and
have the main process write the wall-clock time at which the first step
finished.  Every call of ``notebook_launcher`` forks fresh processes, so
every call pays for process start, group init, model build and wrap again.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def train(name: str, tiny: bool, out: str, steps: int = 1) -> None:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    import models
    from plain_train import loss_fn

    torch.set_num_threads(1)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    model, ds, mb = models.build(name, tiny)
    loader = DataLoader(ds, batch_size=mb, shuffle=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model, opt, loader = acc.prepare(model, opt, loader)
    first = None
    for i, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if first is None:
            first = time.time()
        if i + 1 >= steps:
            break
    if acc.is_main_process:
        with open(out, "w") as f:
            json.dump({"t_first_step": first, "world_size": acc.num_processes,
                       "distributed_type": str(acc.distributed_type)}, f)
    acc.wait_for_everyone()
