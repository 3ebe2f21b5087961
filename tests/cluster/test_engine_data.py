"""In-process tests (no process group): datasets, TinyLM, FSDP unit choice,
user-facing errors, the sharding invariant resumption relies on, and the
checkpoint reader's refusal to unpickle anything but DCP metadata."""

import os
import pickle

import pytest
import torch
import torch.nn as nn

from dpnb.data import Block, CharTextDataset, SyntheticRegression, TinyLM, load_tiny_text
from dpnb.engine.train import training as T
from dpnb.engine.train.checkpoint import SafeFileSystemReader
from dpnb.engine.state import EngineState


def fake_ns(rank=0, world_size=2, **objs):
    st = EngineState(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                     node_rank=0, backend="gloo", device=torch.device("cpu"),
                     master_addr="127.0.0.1", master_port=1, timeout_s=20)
    return {"_dpnb": st, "rank": rank, "world_size": world_size, "torch": torch, **objs}


# ---------------------------------------------------------------- datasets

def test_synthetic_regression_is_deterministic_per_seed():
    a, b, c = SyntheticRegression(64, 5, 3, seed=7), SyntheticRegression(64, 5, 3, seed=7), SyntheticRegression(64, 5, 3, seed=8)
    assert len(a) == 64
    x, y = a[3]
    assert x.shape == (5,) and y.shape == (3,) and x.dtype == torch.float32
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)
    # the target is a function of x, not noise alone
    assert a.y.std() > 5 * 0.01


def test_shipped_text_and_char_dataset():
    text = load_tiny_text()
    assert 20_000 <= len(text.encode()) <= 50_000
    ds = CharTextDataset(seq_len=16)
    assert ds.vocab_size == len(set(text)) == len(ds.chars)
    assert len(ds) == len(text) - 16
    x, y = ds[10]
    assert x.dtype == torch.long and x.shape == y.shape == (16,)
    assert torch.equal(x[1:], y[:-1])
    assert ds.decode(x) == text[10:26] and ds.decode(y) == text[11:27]
    s = "The keeper climbs."
    assert ds.decode(ds.encode(s)) == s
    with pytest.raises(ValueError, match="not in this dataset's vocabulary"):
        ds.encode("ünïcode")
    assert ds.seq_len == 16
    small = CharTextDataset(seq_len=4, text="abcabcabca", stride=3)
    assert [small.decode(small[i][0]) for i in range(len(small))] == ["abca", "abca"]
    with pytest.raises(ValueError, match="fewer than seq_len"):
        CharTextDataset(seq_len=20, text="short")


def test_tiny_lm_shapes_blocks_and_causality():
    torch.manual_seed(0)
    m = TinyLM(vocab_size=11, d_model=16, n_layers=3, n_heads=2, seq_len=8)
    assert isinstance(m.blocks, nn.ModuleList) and len(m.blocks) == 3
    assert all(isinstance(b, Block) for b in m.blocks)
    idx = torch.randint(0, 11, (2, 8))
    out = m(idx)
    assert out.shape == (2, 8, 11)
    idx2 = idx.clone()
    idx2[:, 5] = (idx2[:, 5] + 1) % 11
    out2 = m(idx2)
    assert torch.allclose(out[:, :5], out2[:, :5], atol=1e-6)  # the past does not see the future
    assert not torch.allclose(out[:, 5:], out2[:, 5:])
    assert m.generate(idx[:, :3], 4).shape == (2, 7)
    with pytest.raises(ValueError, match="longer than seq_len"):
        m(torch.zeros(1, 9, dtype=torch.long))


def test_fsdp_units():
    lm = TinyLM(vocab_size=5, d_model=8, n_layers=2, n_heads=2, seq_len=4)
    assert T.fsdp_units(lm) == ["blocks.1", "blocks.0"]
    assert T.fsdp_units(lm, ["Block"]) == ["blocks.1", "blocks.0"]
    assert T.fsdp_units(lm, Block) == ["blocks.1", "blocks.0"]
    # innermost first: a Linear inside a block precedes the block
    units = T.fsdp_units(lm, ["Block", "Linear"])
    assert units.index("blocks.0.qkv") < units.index("blocks.0") and "head" in units
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert T.fsdp_units(seq) == ["2", "0"]
    with pytest.raises(T.TrainError, match="no submodule matches"):
        T.fsdp_units(seq, ["Conv2d"])


# ---------------------------------------------------------------- errors

def test_wrap_errors_say_what_to_do():
    ns = fake_ns(net=nn.Linear(2, 2), ds=SyntheticRegression(8, 2, 2))
    with pytest.raises(T.TrainError, match="unknown strategy 'zero4'.*ddp, zero1, zero2, zero3"):
        T.wrap(ns, "net", "zero4")
    with pytest.raises(T.TrainError, match="fp16 needs CUDA.*bf16"):
        T.wrap(ns, "net", "zero3", mixed_precision="fp16")
    with pytest.raises(T.TrainError, match="cpu-offload applies to the FSDP strategies"):
        T.wrap(ns, "net", "ddp", cpu_offload=True)
    with pytest.raises(T.TrainError, match="unknown optimizer"):
        T.wrap(ns, "net", "ddp", optimizer="lamb")
    with pytest.raises(T.TrainError, match=r"no 'mdl' on rank 0.*\['net'\]"):
        T.wrap(ns, "mdl", "ddp")
    with pytest.raises(T.TrainError, match="not a torch.nn.Module"):
        T.wrap(ns, "ds", "ddp")
    with pytest.raises(T.TrainError, match="run `%dp wrap MODEL"):
        T.train(ns, steps=1, micro_batch=1)
    with pytest.raises(T.TrainError, match="no dataset 'data' on rank 0.*'ds'"):
        T.set_data(ns, "data")
    with pytest.raises(T.TrainError, match="not a map-style dataset"):
        T.set_data(ns, 42)


def test_sharding_prefix_invariant_across_world_sizes():
    # Resuming under another world size relies on: the first n global samples
    # of an epoch are the same set whatever the number of ranks.
    ds = SyntheticRegression(60, 2, 1)
    perm = None
    for ws in (1, 2, 3, 4):
        d = T.DataState(dataset=ds, name="ds", seed=5, shuffle=True, epoch=2)
        n = 12  # global samples consumed, a multiple of every ws
        taken = set()
        for r in range(ws):
            taken |= set(d._rank_indices(r, ws)[: n // ws])
        if perm is None:
            perm = taken
        assert taken == perm
    d = T.DataState(dataset=ds, name="ds", seed=5, shuffle=True)
    e0 = d._rank_indices(0, 2)
    d.epoch = 1
    assert d._rank_indices(0, 2) != e0  # set_epoch reshuffles


# ---------------------------------------------------------------- safe loading

class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dpnb_pwned_marker",))


def test_checkpoint_metadata_reader_refuses_arbitrary_objects(tmp_path):
    marker = "/tmp/dpnb_pwned_marker"
    if os.path.exists(marker):
        os.remove(marker)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not os.path.exists(marker)
