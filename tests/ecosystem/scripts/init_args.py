"""``init_process_group`` with the arguments torchrun scripts pass it: a device,
a timeout, backend options; then one all-reduce, rank 0 busy first if asked.

    torchrun --nproc-per-node 2 init_args.py --device-id cpu      # torch: ValueError
    torchrun --nproc-per-node 2 init_args.py --timeout 2 --rank0-busy 8

``--show-timeout`` prints the group's timeout as the backend holds it.
"""

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device-id", default=None)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--rank0-busy", type=float, default=0.0)
    p.add_argument("--pg-options", action="store_true")
    p.add_argument("--show-timeout", action="store_true")
    args = p.parse_args()
    kwargs = {}
    if args.device_id is not None:
        kwargs["device_id"] = torch.device(args.device_id)
    if args.timeout is not None:
        kwargs["timeout"] = timedelta(seconds=args.timeout)
    if args.pg_options:
        kwargs["pg_options"] = dist.ProcessGroupGloo._Options()
    dist.init_process_group("gloo", **kwargs)
    rank = dist.get_rank()
    if args.show_timeout:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        print(f"rank {rank} group timeout {backend.options._timeout.total_seconds():g}")
    if rank == 0:
        time.sleep(args.rank0_busy)  # an evaluation, say
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {rank} sum {t.item():g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
