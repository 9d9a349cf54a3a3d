"""Sequence parallelism (``longformer_ops.distributed``): local attention over a sequence split across
ranks, each rank in its own process (gloo, 2 and 3 ranks), against the one-process call on the whole
sequence in float64: every rank's shard of the result and of its log-sum-exp, and of the gradients of
q, k and v (through both), within float64's bound.

The ranks run every case in one spawn per world size (each spawn costs seconds) and write what they
found; the tests read it. Refusals (a shard shorter than the halo a neighbour needs, ranks that
disagree on a shape, an argument one rank gets wrong) must raise on every rank, not hang. A halo one
row short (the plan's ``halo`` less one) must fail the comparison. Dropout uses the whole sequence's
mask: with the same ``torch.manual_seed``, the shards' results are the one-process call's.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import assert_normwise_close, stable_seed

TIMEOUT_S = 60  # gloo's: a rank stuck in a collective raises after this ...
DEADLINE_S = 180  # ... and the parent stops waiting after this

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")

class Case(NamedTuple):
    world: int  # ranks
    lengths: list[int]  # each rank's shard
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    w: int
    dilation: list[int]  # per head
    causal: bool
    padded: bool  # a key padding mask
    dropout_p: float = 0.0


CASES = {
    "even-2": Case(2, [20, 20], 1, 2, 2, 8, 3, [1, 1], False, False),
    "uneven-2": Case(2, [23, 17], 2, 2, 2, 16, 4, [1, 2], False, True),
    "dilated-3": Case(3, [10, 19, 12], 1, 4, 4, 8, 2, [1, 2, 3, 4], False, False),
    "causal-dilated-3": Case(3, [12, 9, 15], 2, 4, 2, 8, 2, [1, 2, 3, 4], True, True),
    "causal-2": Case(2, [30, 11], 1, 3, 1, 8, 5, [1, 1, 2], True, False),
    "halo-is-shard-3": Case(3, [8, 8, 9], 1, 2, 2, 8, 4, [2, 1], False, True),  # halo 8: a middle shard all halo
    "dropout-2": Case(2, [23, 17], 2, 2, 1, 16, 4, [1, 2], False, True, 0.3),
    "causal-dropout-3": Case(3, [12, 9, 15], 1, 4, 2, 8, 2, [1, 2, 3, 4], True, False, 0.2),
}
DROPOUT_SEED = 77  # torch.manual_seed before each call: the one-process call and every rank draw the same seed
# Refused on every rank: (world size, what to pass, the message expected)
REFUSALS = {
    "shard-shorter-than-halo": (3, "lengths [10, 3, 10], w 2, dilation up to 4: halo 8", r"rank 1's 3 rows are fewer "
                                r"than the 8 rows of halo rank 2 needs from it \(w \* max\(d\) = 8\)"),
    "head_dim-differs": (2, "rank 1 with head_dim 16", r"every rank must pass the same head_dim: got \[8, 16\]"),
    # (rank 1 raises its own error; the others say which rank's arguments were refused, and why)
    "w-refused-on-one-rank": (2, "rank 1 with w = -1", r"^(ValueError: rank 1's arguments were refused: )?"
                              r"ValueError: w \(one-sided window\) must be >= 0"),
    "dropout_p-differs": (2, "rank 1 with dropout_p = 0.1", r"every rank must pass the same dropout_p: got \[0.0, 0.1\]"),
}


def _inputs(name: str):
    case = CASES[name]
    g = torch.Generator().manual_seed(stable_seed("sequence parallel", name))
    n = sum(case.lengths)
    q = torch.randn(case.batch, n, case.heads, case.head_dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(case.batch, n, case.kv_heads, case.head_dim, generator=g, dtype=torch.float64) for _ in range(2))
    mask = (torch.rand(case.batch, n, generator=g) < 0.25) if case.padded else None
    grad_out = torch.randn(case.batch, n, case.heads, case.head_dim, generator=g, dtype=torch.float64)
    grad_lse = torch.randn(case.batch, n, case.heads, generator=g, dtype=torch.float64)
    return q, k, v, mask, grad_out, grad_lse


def _loss(out, lse, grad_out, grad_lse):
    return (out * grad_out).sum() + (lse.masked_fill(lse.isinf(), 0) * grad_lse).sum()


def _one_process(name: str):
    """The whole sequence in one call: result, lse and the gradients of q, k, v."""
    from longformer_ops import sliding_window_attention

    case = CASES[name]
    q, k, v, mask, grad_out, grad_lse = _inputs(name)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.manual_seed(DROPOUT_SEED)
    out, lse = sliding_window_attention(*leaves, case.w, case.dilation, case.causal, 0.5, key_padding_mask=mask,
                                        dropout_p=case.dropout_p, return_lse=True)
    grads = torch.autograd.grad(_loss(out, lse, grad_out, grad_lse), leaves)
    return out.detach(), lse.detach(), grads


def _sharded(name: str, rank: int, halo_short_by: int = 0):
    """This rank's shard through longformer_ops.distributed: result, lse, gradients (the plan's halo
    ``halo_short_by`` rows short, for the injected fault)."""
    from longformer_ops import distributed

    case = CASES[name]
    q, k, v, mask, grad_out, grad_lse = _inputs(name)
    rows = slice(sum(case.lengths[:rank]), sum(case.lengths[:rank + 1]))
    leaves = [x[:, rows].clone().requires_grad_() for x in (q, k, v)]
    plan_halo = distributed.plan_halo
    if halo_short_by:
        distributed.plan_halo = lambda lens, r, halo, *args: plan_halo(lens, r, halo - halo_short_by, *args)
    try:
        torch.manual_seed(DROPOUT_SEED)
        out, lse = distributed.sliding_window_attention(*leaves, case.w, case.dilation, case.causal, 0.5,
                                                        key_padding_mask=None if mask is None else mask[:, rows],
                                                        dropout_p=case.dropout_p, return_lse=True)
    finally:
        distributed.plan_halo = plan_halo
    grads = torch.autograd.grad(_loss(out, lse, grad_out[:, rows], grad_lse[:, rows]), leaves)
    return rows, out.detach(), lse.detach(), grads


def _compare(name: str, rank: int, halo_short_by: int = 0) -> str | None:
    """None if this rank's shard equals the one-process call's within float64's bound, else why not."""
    rows, out, lse, grads = _sharded(name, rank, halo_short_by)
    want_out, want_lse, want_grads = _one_process(name)
    try:
        assert torch.equal(lse.isinf(), want_lse[:, rows].isinf()), "rows with no key differ"
        finite = want_lse[:, rows].isfinite()
        assert_normwise_close(out, want_out[:, rows], torch.float64, "result", zero_scale=1.0)
        assert_normwise_close(lse[finite], want_lse[:, rows][finite], torch.float64, "lse", zero_scale=1.0)
        for which, got, want in zip("qkv", grads, want_grads, strict=True):
            assert_normwise_close(got, want[:, rows], torch.float64, f"d{which}", zero_scale=1.0, gradients=True)
    except AssertionError as error:
        return str(error)
    return None


def _refusal(name: str, rank: int) -> str:
    """The exception this rank raised for the refused call ``name`` ("" if none)."""
    from longformer_ops import distributed

    world = REFUSALS[name][0]
    q = torch.randn(1, 10 if rank != 1 or name != "shard-shorter-than-halo" else 3, 4, 8, dtype=torch.float64)
    w, dilation, dropout_p = 2, [1, 2, 3, 4], 0.0
    if name == "head_dim-differs" and rank == 1:
        q = torch.randn(1, 10, 4, 16, dtype=torch.float64)
    if name == "w-refused-on-one-rank" and rank == 1:
        w = -1
    if name == "dropout_p-differs" and rank == 1:
        dropout_p = 0.1
    assert world == dist.get_world_size()
    try:
        distributed.sliding_window_attention(q, q, q, w, dilation, dropout_p=dropout_p)
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        found = {}
        for name, case in CASES.items():
            if case.world == world:
                found[name] = _compare(name, rank)
                found[f"{name} (halo one row short)"] = _compare(name, rank, halo_short_by=1)
        for name, refusal in REFUSALS.items():
            if refusal[0] == world:
                found[f"refused: {name}"] = _refusal(name, rank)
        torch.save(found, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks_found(tmp_path_factory):
    """{world size: [what each rank found]} after one spawn per world size."""
    found = {}
    for world in sorted({case.world for case in CASES.values()}):
        out = tmp_path_factory.mktemp(f"world{world}")
        context = mp.spawn(_worker, args=(world, str(out / "rendezvous"), str(out)), nprocs=world, join=False)
        deadline = time.monotonic() + DEADLINE_S
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{world} ranks did not finish within {DEADLINE_S} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        found[world] = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_gets_its_shard_of_the_one_process_result(ranks_found, name):
    for rank, found in enumerate(ranks_found[CASES[name].world]):
        assert found[name] is None, f"rank {rank} of case {name} {CASES[name]}: {found[name]}"


@pytest.mark.parametrize("name", list(CASES))
def test_a_halo_one_row_short_fails(ranks_found, name):
    """The injected fault: with the plan's halo one row short, some rank's shard differs."""
    results = [found[f"{name} (halo one row short)"] for found in ranks_found[CASES[name].world]]
    assert any(result is not None for result in results), f"case {name}: a halo one row short went unnoticed"


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals_raise_on_every_rank(ranks_found, name):
    world, what, message = REFUSALS[name]
    import re

    for rank, found in enumerate(ranks_found[world]):
        assert re.search(message, found[f"refused: {name}"]), f"{what}, rank {rank}: {found[f'refused: {name}']!r}"
