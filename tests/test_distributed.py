"""Data-parallel training on the kernels: DistributedDataParallel (gloo, 2 CPU processes) against
one process on the whole batch.

A tiny float64 ``LongformerForMaskedLM`` (per-head dilation, a global token, a padded sequence,
attention mode "tvm") trains 3 SGD steps under DDP, each rank on half of a 4-sequence batch. Checked
against the same 3 steps in one process on the whole batch, within 1e-10 absolute:

- the all-reduced gradients after the first backward, on both ranks (and rank 1's equal rank 0's),
- the parameters after the last step,
- each step's whole-batch loss (the mean of the ranks' losses).

So the kernels' backward gives gradients that are additive over batch shards, and nothing in the
model (tied weights, global-attention projections) breaks DDP's bucketing or broadcast.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longformer_ops import LongformerConfig, LongformerForMaskedLM

WORLD_SIZE = 2
STEPS = 3
LR = 0.1
ATOL = 1e-10  # float64: only summation order differs between the runs
PAD = 1       # the config's default pad_token_id: padding gets position id PAD, as RoBERTa's
SEQ_LEN = 41
TIMEOUT_S = 120  # a rank stuck in a collective must fail the test, not hang it

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available")


def _config() -> LongformerConfig:
    return LongformerConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=80,
        # 10x the default init: at 0.02 the attention scores are so flat that the key projections'
        # gradients are ~1e-8, and a 1e-10 absolute bar on them would check next to nothing.
        initializer_range=0.2,
        # No dropout: both runs must compute the same function, whatever each process's RNG draws.
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attention_window=[3, 5], attention_dilation=[[1, 2, 1, 3], 1])


def _model() -> LongformerForMaskedLM:
    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    return LongformerForMaskedLM(_config()).double()


def _batch() -> dict[str, torch.Tensor]:
    """4 sequences; sequence 1 ends in 12 padding tokens, so the two shards hold unequal token counts."""
    g = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(3, 50, (4, SEQ_LEN), generator=g)
    labels = torch.randint(3, 50, (4, SEQ_LEN), generator=g)
    attention_mask = torch.ones(4, SEQ_LEN, dtype=torch.long)
    attention_mask[1, -12:] = 0
    input_ids[attention_mask == 0] = PAD
    labels[attention_mask == 0] = -100
    global_attention_mask = torch.zeros(4, SEQ_LEN, dtype=torch.long)
    global_attention_mask[:, 0] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "global_attention_mask": global_attention_mask, "labels": labels}


def _loss_sum(model, batch) -> torch.Tensor:
    """Sum of the per-token cross-entropies over the batch's labelled tokens.

    Computed here rather than with the model's ``labels=``, which gives the mean over each rank's own
    labelled tokens: the shards hold unequal counts, so only a sum over one global count averages exactly.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   global_attention_mask=batch["global_attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                             ignore_index=-100, reduction="sum")


def _grads(model) -> dict[str, torch.Tensor]:
    # named_parameters() lists the tied decoder weight / bias once, under their first names.
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    # Module-level so that spawn can pickle it by reference: the children import this module by the
    # name pytest gave it (tests/ is on sys.path, which spawn hands to the children).
    torch.set_num_threads(1)  # 2 ranks on 2 cores: intra-op threads would only oversubscribe them
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        full = _batch()
        total_tokens = int((full["labels"] != -100).sum())  # over the WHOLE batch, the same on every rank
        per_rank = full["input_ids"].shape[0] // WORLD_SIZE
        shard = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in full.items()}

        model = torch.nn.parallel.DistributedDataParallel(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        losses, first_grads = [], None
        for step in range(STEPS):
            optimizer.zero_grad()
            # The rank's token-loss SUM over the global token count, times WORLD_SIZE: DDP all-reduces
            # gradients and divides by WORLD_SIZE, so the result is sum over all tokens / total_tokens,
            # the gradient of the whole-batch mean, exactly (up to summation order; x2 and /2 are exact).
            # A per-rank mean would not be: the shards hold different numbers of real tokens (padding).
            loss = _loss_sum(model, shard) * WORLD_SIZE / total_tokens
            loss.backward()
            losses.append(loss.item())
            if step == 0:
                first_grads = _grads(model.module)
            optimizer.step()
        torch.save({"grads": first_grads, "params": _params(model.module), "losses": losses},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(init_file: str, out_dir: str) -> None:
    context = mp.spawn(_worker, args=(init_file, out_dir), nprocs=WORLD_SIZE, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1):  # raises ProcessRaisedException if a rank failed
            if time.monotonic() > deadline:
                pytest.fail(f"DDP workers did not finish within {TIMEOUT_S} s")
    finally:
        for process in context.processes:  # only ours, and only if still alive after a failure
            if process.is_alive():
                process.terminate()
                process.join(5)


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: parameter names differ"
    for name, ref in expected.items():
        error = (actual[name] - ref).abs().max().item()
        assert error <= ATOL, f"{what} {name}: max |difference| {error:.3e} > {ATOL:.0e}"


def test_ddp_matches_single_process(tmp_path):
    _spawn(str(tmp_path / "rendezvous"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]

    # The reference: one process, the whole batch, its mean token loss, the same steps.
    batch = _batch()
    total_tokens = int((batch["labels"] != -100).sum())
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ref_losses, ref_grads = [], None
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = _loss_sum(model, batch) / total_tokens
        loss.backward()
        ref_losses.append(loss.item())
        if step == 0:
            ref_grads = _grads(model)
        optimizer.step()

    # Non-vacuous: the key projections, local and global, get gradients far above ATOL (through the
    # kernels' Q.K^T backward and the global merge).
    for name in ("longformer.encoder.layer.0.attention.self.key.weight",
                 "longformer.encoder.layer.1.attention.self.key_global.weight"):
        assert ref_grads[name].abs().max() > 1e-3, f"{name}: (almost) no gradient in the reference"

    for r, saved in enumerate(ranks):
        _assert_close(saved["grads"], ref_grads, f"rank {r} first-step gradient")
    _assert_close(ranks[1]["grads"], ranks[0]["grads"], "rank 1 vs rank 0 gradient")
    _assert_close(ranks[0]["params"], _params(model), "final parameters")
    for step, ref in enumerate(ref_losses):
        ddp = sum(saved["losses"][step] for saved in ranks) / WORLD_SIZE
        assert abs(ddp - ref) <= ATOL, f"step {step}: DDP loss {ddp!r} != single-process loss {ref!r}"
