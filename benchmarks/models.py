"""The models and data every benchmark side builds, so both sides of a
comparison train exactly the same thing.

Imported by dpnb's engines (the benchmark adds this folder to their
``sys.path``), by the plain ``torchrun`` script and by the accelerate
function.  ``build(name)`` seeds torch, so every rank and every side starts
from the same weights and the same dataset.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import dpnb.data

# name -> (micro-batch per rank, tokens per sample or None)
SPECS = {
    # Compute-bound: ~0.79M parameters (3.2 MB of gradients) against
    # ~1.2 GFLOP per rank per step, so the all-reduce is a small share.
    "mlp": (256, None),
    # The course's character-level transformer (816k parameters).
    "tinylm": (16, 64),
}


class MLP(nn.Sequential):
    def __init__(self, width: int = 512, io: int = 256):
        super().__init__(
            nn.Linear(io, width), nn.GELU(),
            nn.Linear(width, width), nn.GELU(),
            nn.Linear(width, width), nn.GELU(),
            nn.Linear(width, io),
        )


def build(name: str, tiny: bool = False):
    """``(model, dataset, micro_batch)`` for ``name``; ``tiny`` shrinks it for smoke runs."""
    if name not in SPECS:
        raise ValueError(f"unknown benchmark model {name!r}: choose one of {sorted(SPECS)}")
    mb, seq = SPECS[name]
    torch.manual_seed(0)
    if name == "mlp":
        width, io = (64, 32) if tiny else (512, 256)
        if tiny:
            mb = 16
        model = MLP(width, io)
        ds = dpnb.data.SyntheticRegression(n=8192 if not tiny else 512, in_dim=io, out_dim=io,
                                           seed=0)
    else:
        ds = dpnb.data.CharTextDataset(seq_len=16 if tiny else seq)
        model = dpnb.data.TinyLM(ds.vocab_size, d_model=32 if tiny else 128,
                                 n_layers=1 if tiny else 4, n_heads=4, seq_len=16 if tiny else seq)
        if tiny:
            mb = 4
    return model, ds, mb


def rank_device(backend: str) -> torch.device:
    """This torchrun worker's device: its own GPU (``LOCAL_RANK``) under
    NCCL, made current, else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    return dev


def fsdp_units(model: nn.Module) -> list:
    """The submodules that become FSDP units, innermost first: the children
    of every ``nn.ModuleList``, else every direct child with parameters (the
    rule dpnb's ``wrap`` uses)."""
    units = [m for mod in model.modules() if isinstance(mod, nn.ModuleList) for m in mod]
    if not units:
        units = [m for m in model.children() if any(True for _ in m.parameters())]
    return units
