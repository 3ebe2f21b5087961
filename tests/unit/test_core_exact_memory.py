"""Exact mode: byte-for-byte against the real PyTorch objects."""

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpnb.core import (
    ConfigError,
    ParamSpec,
    exact_rank_bytes,
    fsdp_shard_rows,
    param_specs,
    zero1_partition,
    zero_memory,
)

SETTINGS = settings(max_examples=100, deadline=None)
FIELDS = (
    "params", "params_unpadded", "grads", "grad_storage", "comm_buffers", "optimizer_moments", "optimizer_steps",
)


def test_exact_mode_matches_engines_byte_for_byte(engine_measurements: dict[str, Any]) -> None:
    world = engine_measurements["world"]
    assert engine_measurements["results"]
    for res in engine_measurements["results"]:
        specs = [ParamSpec(n, tuple(s), d, rg) for n, s, d, rg in res["ranks"][0]["specs"]]
        model = exact_rank_bytes(
            specs, world, res["strategy"], res["optimizer"], gradient_as_bucket_view=res["bucket_view"]
        )
        for rank, (measured, predicted) in enumerate(zip(res["ranks"], model)):
            where = f"{res['strategy']}/{res['optimizer']}/bucket_view={res['bucket_view']} rank {rank}"
            for f in FIELDS:
                assert measured[f] == getattr(predicted, f), f"{where}: {f}"
            assert measured["owned"] == sorted(predicted.owned), where
            if res["strategy"] in ("ddp", "zero1"):
                # The reducer's buckets hold one copy of the trainable grads.
                assert measured["bucket_bytes"] == predicted.grads, where


def test_exact_mode_matches_training_meter(engine_measurements: dict[str, Any]) -> None:
    """Shared check with the training code: dpnb.engine.train.measure.state_bytes on the same objects."""
    results = engine_measurements["results"]
    assert results and all("engine" in r for res in results for r in res["ranks"])
    world = engine_measurements["world"]
    for res in results:
        specs = [ParamSpec(n, tuple(s), d, rg) for n, s, d, rg in res["ranks"][0]["specs"]]
        model = exact_rank_bytes(
            specs, world, res["strategy"], res["optimizer"], gradient_as_bucket_view=res["bucket_view"]
        )
        for measured, predicted in zip(res["ranks"], model):
            eng = measured["engine"]
            assert eng["params"] == predicted.params
            assert eng["grads"] == predicted.grad_storage
            assert eng["optimizer"] == predicted.optimizer_state
            assert eng["total"] == predicted.tensor_bytes


def _torch_zero_partition(sizes_per_group: list[list[int]], world: int) -> list[list[int]]:
    """Call the real ZeroRedundancyOptimizer._partition_parameters without a process group."""
    torch = pytest.importorskip("torch")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    tensors = [[torch.empty(s) for s in g] for g in sizes_per_group]
    index = {id(t): i for i, t in enumerate(t for g in tensors for t in g)}
    zero = object.__new__(ZeroRedundancyOptimizer)
    zero.param_groups = [{"params": g} for g in tensors]
    zero.world_size = world
    zero._partition_parameters_cache = []  # type: ignore[attr-defined]
    parts = ZeroRedundancyOptimizer._partition_parameters(zero)  # type: ignore[attr-defined]
    return [[index[id(p)] for group in rank_groups for p in group["params"]] for rank_groups in parts]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit notices on importing torch.distributed.optim
@SETTINGS
@given(
    groups=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=12), min_size=1, max_size=3),
    world=st.integers(1, 6),
)
def test_zero1_partition_matches_torch(groups: list[list[int]], world: int) -> None:
    specs = [ParamSpec(f"p{i}", (s,)) for i, s in enumerate(s for g in groups for s in g)]
    starts = [sum(len(g) for g in groups[:k]) for k in range(len(groups))]
    idx_groups = [list(range(a, a + len(g))) for a, g in zip(starts, groups)]
    assert zero1_partition(specs, world, idx_groups) == _torch_zero_partition(groups, world)


@SETTINGS
@given(sizes=st.lists(st.integers(1, 10**6), min_size=1, max_size=40), world=st.integers(1, 16))
def test_zero1_partition_is_a_balanced_partition(sizes: list[int], world: int) -> None:
    specs = [ParamSpec(f"p{i}", (s,)) for i, s in enumerate(sizes)]
    parts = zero1_partition(specs, world)
    assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in p) for p in parts]
    # Greedy largest-first never leaves a gap larger than the largest parameter.
    assert max(loads) - min(loads) <= max(sizes)


def test_fsdp_shard_rows_matches_torch_chunk() -> None:
    torch = pytest.importorskip("torch")
    for dim0 in range(0, 40):
        for world in range(1, 10):
            chunks = list(torch.chunk(torch.empty(dim0, 3), world, dim=0))
            sizes = [c.size(0) for c in chunks] + [0] * (world - len(chunks))
            for rank in range(world):
                rows, padded = fsdp_shard_rows(dim0, world, rank)
                assert rows == sizes[rank]
                assert padded == chunks[0].size(0)


@SETTINGS
@given(dim0=st.integers(0, 10**6), world=st.integers(1, 512))
def test_fsdp_rows_sum_and_padding(dim0: int, world: int) -> None:
    shards = [fsdp_shard_rows(dim0, world, r) for r in range(world)]
    assert sum(r for r, _ in shards) == dim0
    padded = shards[0][1]
    assert all(p == padded and 0 <= r <= p for r, p in shards)
    assert padded == math.ceil(dim0 / world)
    assert padded * world - dim0 < world or dim0 == 0


specs_strategy = st.lists(
    st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.booleans()), min_size=1, max_size=8
).map(lambda xs: [ParamSpec(f"p{i}", tuple(s), "float32", rg) for i, (s, rg) in enumerate(xs)])


@SETTINGS
@given(specs=specs_strategy, world=st.integers(1, 8), opt=st.sampled_from(["adam", "sgd-momentum", "sgd"]))
def test_exact_invariants(specs: list[ParamSpec], world: int, opt: str) -> None:
    ddp = exact_rank_bytes(specs, world, "ddp", opt)  # type: ignore[arg-type]
    z1 = exact_rank_bytes(specs, world, "zero1", opt)  # type: ignore[arg-type]
    z3 = exact_rank_bytes(specs, world, "zero3", opt)  # type: ignore[arg-type]
    z2 = exact_rank_bytes(specs, world, "zero2", opt)  # type: ignore[arg-type]
    full = sum(p.nbytes for p in specs)
    # Sharded state sums over ranks to the unsharded state.
    assert sum(r.optimizer_moments for r in z1) == ddp[0].optimizer_moments
    assert sum(r.optimizer_moments for r in z3) == ddp[0].optimizer_moments
    assert sum(r.params_unpadded for r in z3) == full == ddp[0].params
    assert sum(r.grads for r in z3) == ddp[0].grads
    assert all(r.params >= r.params_unpadded for r in z3)
    assert [(r.params, r.grads, r.optimizer_state) for r in z2] == [(r.params, r.grads, r.optimizer_state) for r in z3]
    assert all(r.params == full and r.comm_buffers == r.grads for r in z1)


def test_exact_agrees_with_analytic_for_even_shapes() -> None:
    # fp32 Adam, dims divisible by N: exact = analytic 16 B/param (+ 4 B per step tensor).
    specs = [ParamSpec("w", (64, 32)), ParamSpec("v", (128,)), ParamSpec("u", (16, 4, 4))]
    psi = sum(p.numel for p in specs)
    for n in (1, 2, 4, 8, 16):
        ddp = exact_rank_bytes(specs, n, "ddp", gradient_as_bucket_view=True)[0]
        assert ddp.total - ddp.optimizer_steps == zero_memory(psi, n, 0, "fp32").total
        for r in exact_rank_bytes(specs, n, "zero3"):
            assert r.total - r.optimizer_steps == zero_memory(psi, n, 3, "fp32").total
            assert r.optimizer_steps == 4 * len(specs)


def test_zero1_owned_names_follow_partition() -> None:
    specs = [ParamSpec("emb", (1000, 8)), ParamSpec("w", (64, 64)), ParamSpec("b", (64,)),
             ParamSpec("frozen", (500,), requires_grad=False)]
    ranks = exact_rank_bytes(specs, 2, "zero1")
    assert [r.owned for r in ranks] == [("emb",), ("w", "b")]
    assert ranks[0].optimizer_moments == 2 * 8000 * 4 and ranks[0].optimizer_steps == 4


def test_exact_mode_errors() -> None:
    with pytest.raises(ConfigError, match="0-dimensional"):
        exact_rank_bytes([ParamSpec("scale", ())], 2, "zero3")
    with pytest.raises(ConfigError, match="one dense dtype"):
        exact_rank_bytes([ParamSpec("a", (2,)), ParamSpec("b", (2,), "bfloat16")], 2, "zero1")
    with pytest.raises(ConfigError, match="dtype"):
        ParamSpec("a", (2,), "float13")
    with pytest.raises(ConfigError, match="strategy"):
        exact_rank_bytes([ParamSpec("a", (2,))], 2, "zero4")  # type: ignore[arg-type]


def test_param_specs_duck_types_tensors() -> None:
    class FakeTensor:
        shape = (3, 4)
        dtype = "torch.bfloat16"
        requires_grad = False

    (spec,) = param_specs([("w", FakeTensor())])
    assert spec == ParamSpec("w", (3, 4), "bfloat16", False) and spec.nbytes == 24
