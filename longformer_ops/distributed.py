"""Sequence parallelism on ``torch.distributed``: local attention over a sequence split across ranks.

Each rank of a process group holds one contiguous shard of the sequence (rank 0 the first, lengths
may differ). A query attends to keys at most ``h = w * max(d)`` rows away, so a rank needs only its
neighbours' ``h`` border rows of K and V (the *halo*), not the whole sequence: per layer and rank that
is ``2 h`` rows sent and received against ``n / P`` rows of attention. The halo travels by
``batch_isend_irecv`` (gloo on CPUs, NCCL on GPUs); its backward sends the halo rows' gradients back to
the ranks that own them. Every rank must call (and backpropagate through) the same sequence of these
functions: they are collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from longformer_ops import checks, kernels
from longformer_ops.attention import sliding_window_attention as _local_attention
from longformer_ops.dropout import dropout_seed


@dataclass(frozen=True)
class HaloPlan:
    """This rank's halo: rows received from the previous rank (``before``) and the next (``after``),
    and rows sent to them (this shard's first ``to_previous`` and last ``to_next`` rows)."""

    group: dist.ProcessGroup
    rank: int
    ranks: int
    start: int  # this shard's first row in the whole sequence
    length: int  # the whole sequence's
    before: int
    after: int
    to_previous: int
    to_next: int

    def peer(self, offset: int) -> int:
        """The global rank of the group's rank ``self.rank + offset`` (P2P ops take global ranks)."""
        return dist.get_global_rank(self.group, self.rank + offset) if self.group is not dist.group.WORLD \
            else self.rank + offset


def _describe(q, k, v, w, dilations, autoregressive, scale, key_padding_mask, dropout_p, return_lse) -> tuple:
    """What every rank must agree on, and this rank's length."""
    max_dilation = int(max(dilations)) if not isinstance(dilations, torch.Tensor) else int(dilations.max())
    return dict(batch=q.shape[0], heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3], dtype=str(q.dtype),
                device=q.device.type, w=w, dilations=tuple(int(x) for x in dilations), autoregressive=autoregressive,
                scale=scale, key_padding_mask=key_padding_mask is not None, dropout_p=dropout_p,
                return_lse=return_lse), q.shape[1], w * max_dilation


def plan_halo(seq_lens: list[int], rank: int, halo: int, autoregressive: bool, group) -> HaloPlan:
    """The halo of group rank ``rank`` among shards of ``seq_lens`` rows (in rank order), a query
    reaching ``halo`` rows each way (only back when ``autoregressive``). Raises ValueError (the same
    on every rank, which all hold ``seq_lens``) if a shard is shorter than the rows it must serve."""
    starts = [sum(seq_lens[:r]) for r in range(len(seq_lens) + 1)]
    length = starts[-1]

    def before(r):  # rows rank r needs from rank r - 1
        return min(halo, starts[r])

    def after(r):  # rows rank r needs from rank r + 1
        return 0 if autoregressive else min(halo, length - starts[r + 1])

    for r, rows in enumerate(seq_lens):
        for neighbour, needed in ((r + 1, before(r + 1) if r + 1 < len(seq_lens) else 0),
                                  (r - 1, after(r - 1) if r > 0 else 0)):
            if rows < needed:
                raise ValueError(
                    f"sequence shards {seq_lens} (one per rank): rank {r}'s {rows} rows are fewer than the {needed} "
                    f"rows of halo rank {neighbour} needs from it (w * max(d) = {halo}); give every rank at least "
                    f"{halo} rows, or use fewer ranks")
    return HaloPlan(group=group, rank=rank, ranks=len(seq_lens), start=starts[rank], length=length, before=before(rank),
                    after=after(rank), to_previous=after(rank - 1) if rank > 0 else 0,
                    to_next=before(rank + 1) if rank + 1 < len(seq_lens) else 0)


def _swap(plan: HaloPlan, first: torch.Tensor | None, last: torch.Tensor | None, from_previous: torch.Tensor | None,
          from_next: torch.Tensor | None) -> None:
    """One round of point-to-point messages along dim 1: ``first`` to the previous rank, ``last`` to the
    next, ``from_previous`` and ``from_next`` filled from them (None: nothing that way)."""
    ops = []
    for tensor, offset, send in ((first, -1, True), (last, 1, True), (from_previous, -1, False), (from_next, 1, False)):
        if tensor is not None and tensor.shape[1] > 0:
            ops.append(dist.P2POp(dist.isend if send else dist.irecv, tensor, plan.peer(offset), plan.group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


class _HaloExchange(torch.autograd.Function):
    """(k, v) of this shard -> (k, v) with the neighbours' halo rows around them; the backward returns
    the halo rows' gradients to their owners and adds theirs to this shard's border rows."""

    @staticmethod
    def forward(ctx, k, v, plan: HaloPlan):
        ctx.plan = plan
        b, n, kv_heads, f = k.shape
        packed = lambda x, y: torch.cat([x, y], dim=-1).contiguous()  # noqa: E731  (one message a way)
        first = packed(k[:, :plan.to_previous], v[:, :plan.to_previous]) if plan.to_previous else None
        last = packed(k[:, n - plan.to_next:], v[:, n - plan.to_next:]) if plan.to_next else None
        received_before = k.new_empty(b, plan.before, kv_heads, 2 * f)
        received_after = k.new_empty(b, plan.after, kv_heads, 2 * f)
        _swap(plan, first, last, received_before, received_after)
        k_all = torch.cat([received_before[..., :f], k, received_after[..., :f]], dim=1)
        v_all = torch.cat([received_before[..., f:], v, received_after[..., f:]], dim=1)
        return k_all, v_all

    @staticmethod
    def backward(ctx, grad_k_all, grad_v_all):
        plan = ctx.plan
        n = grad_k_all.shape[1] - plan.before - plan.after
        f = grad_k_all.shape[-1]
        grad = torch.cat([grad_k_all, grad_v_all], dim=-1)
        # Ours go back to the ranks we took the halos from; theirs come back for our border rows.
        to_previous = grad[:, :plan.before].contiguous() if plan.before else None
        to_next = grad[:, plan.before + n:].contiguous() if plan.after else None
        from_previous = grad.new_empty(grad.shape[0], plan.to_previous, *grad.shape[2:])
        from_next = grad.new_empty(grad.shape[0], plan.to_next, *grad.shape[2:])
        _swap(plan, to_previous, to_next, from_previous, from_next)
        own = grad[:, plan.before:plan.before + n].clone()
        own[:, :plan.to_previous] += from_previous
        own[:, n - plan.to_next:] += from_next
        return own[..., :f], own[..., f:], None


def _exchange_mask(plan: HaloPlan, mask: torch.Tensor) -> torch.Tensor:
    """The key padding mask with the halo rows' around it (not differentiable)."""
    b, n = mask.shape
    as_bytes = mask.to(torch.uint8)[..., None, None]  # [b, n, 1, 1]: the rows along dim 1, as K's
    first = as_bytes[:, :plan.to_previous].contiguous() if plan.to_previous else None
    last = as_bytes[:, n - plan.to_next:].contiguous() if plan.to_next else None
    before = as_bytes.new_empty(b, plan.before, 1, 1)
    after = as_bytes.new_empty(b, plan.after, 1, 1)
    _swap(plan, first, last, before, after)
    return torch.cat([before, as_bytes, after], dim=1)[..., 0, 0].bool()


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, d=1,
                             autoregressive: bool = False, scale: float | None = None, *, group=None,
                             key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                             return_lse: bool = False):
    """:func:`longformer_ops.sliding_window_attention` over a sequence split across the ranks of
    ``group`` (default: the world).

    Each rank passes its own contiguous shard, ``[batch, seq_len_r, heads, head_dim]`` (rank ``r``
    holds rows ``sum(seq_len_0 .. seq_len_{r-1})`` onwards; lengths may differ; k and v may have fewer
    heads) and its shard of ``key_padding_mask``, and gets back its shard of exactly what the
    one-process call on the whole sequence returns (and of its log-sum-exp with ``return_lse``).
    Differentiable: the halo rows' gradients go back to the ranks that own them, so every rank must
    backpropagate through the result. Every other argument must be the same on every rank.

    ``dropout_p``: attention dropout with the whole sequence's mask (rank 0's draw of the seed, its
    rows offset to this shard's: the result does not depend on the number of ranks); it needs the
    fused kernels (the CPU and CUDA libraries).

    Raises ValueError on every rank (never a hang) when the ranks disagree on an argument or a
    shape, or when a shard is shorter than the halo (``w * max(d)`` rows) a neighbour needs from it.
    """
    group = dist.group.WORLD if group is None else group
    if not dist.is_initialized():
        raise RuntimeError("longformer_ops.distributed needs torch.distributed initialised "
                           "(torch.distributed.init_process_group)")
    error, described, seq_len, halo = None, None, 0, 0
    try:
        q, k, v = kernels.autocast_inputs(q, k, v)
        w, dilations, scale = checks.check_sliding_window_attention(q, k, v, w, d, autoregressive, scale,
                                                                     key_padding_mask)
        dropout_p = checks.check_dropout_p(dropout_p)
        checks.check_bool("return_lse", return_lse)
        needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        if dropout_p > 0 and not kernels.fused_attention_available(q.device, q.dtype, backward=needs_grad):
            raise NotImplementedError(f"dropout_p > 0 needs the fused local-attention kernels, which this machine's "
                                      f"libraries lack for {q.device.type} and {q.dtype}; got dropout_p={dropout_p}")
        described, seq_len, halo = _describe(q, k, v, w, dilations, autoregressive, scale, key_padding_mask, dropout_p,
                                             return_lse)
    except (TypeError, ValueError, NotImplementedError) as caught:
        error = caught
    seed = int(dropout_seed()) if error is None and dropout_p > 0 else 0  # (rank 0's serves every rank)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (None if error is None else f"{type(error).__name__}: {error}", described, seq_len,
                                      halo, seed), group=group)
    rank = dist.get_rank(group)
    if error is not None:
        raise error
    failed = [(r, message) for r, (message, *_) in enumerate(everyone) if message is not None]
    if failed:
        raise ValueError(f"rank {failed[0][0]}'s arguments were refused: {failed[0][1]}")
    for name, mine in described.items():
        values = [theirs[name] for _, theirs, *_ in everyone]
        if any(value != mine for value in values):
            raise ValueError(f"every rank must pass the same {name}: got {values} (one per rank)")
    plan = plan_halo([entry[2] for entry in everyone], rank, max(entry[3] for entry in everyone), autoregressive, group)

    k_all, v_all = _HaloExchange.apply(k, v, plan)
    # The halo rows' queries are zeros, their results discarded (2 w max(d) rows of wasted work a rank).
    q_all = torch.cat([q.new_zeros(q.shape[0], plan.before, *q.shape[2:]), q,
                       q.new_zeros(q.shape[0], plan.after, *q.shape[2:])], dim=1)
    mask_all = None if key_padding_mask is None else _exchange_mask(plan, key_padding_mask)
    if dropout_p > 0:
        # The fused op, given the seed: its high 32 bits offset the mask's rows by this call's first
        # row in the whole sequence (tvm_kernels.compute.dropout_row_key).
        offset_seed = torch.tensor(everyone[0][4] + ((plan.start - plan.before) << 32), dtype=torch.int64)
        out, lse = torch.ops.longformer_ops.attention(q_all, k_all, v_all, mask_all, offset_seed, w,
                                                      kernels.dilation_argument(dilations), autoregressive, scale,
                                                      dropout_p)
    else:
        out, lse = _local_attention(q_all, k_all, v_all, w, dilations, autoregressive, scale, key_padding_mask=mask_all,
                                    return_lse=True)
    rows = slice(plan.before, plan.before + seq_len)
    out = out[:, rows].contiguous()
    return (out, lse[:, rows].contiguous()) if return_lse else out
