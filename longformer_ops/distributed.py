"""Sequence parallelism on ``torch.distributed``: local attention over a sequence split across ranks.

Each rank of a process group holds one contiguous shard of the sequence (rank 0 the first, lengths
may differ). A query attends to keys at most ``h = w * max(d)`` rows away, so a rank needs only its
neighbours' ``h`` border rows of K and V (the *halo*), not the whole sequence: per layer and rank that
is ``2 h`` rows sent and received against ``n / P`` rows of attention. The halo travels by
``batch_isend_irecv`` (gloo on CPUs, NCCL on GPUs); its backward sends the halo rows' gradients back to
the ranks that own them. Every rank must call (and backpropagate through) the same sequence of these
functions: they are collectives.

:func:`sequence_parallel` does the same for a whole model (ours, and its task models): each rank runs
it on its slice of the input, global tokens included.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from longformer_ops.models import model as model_module
from longformer_ops.models import tasks
from longformer_ops.models.layer import GlobalTokens, LongformerSelfAttention, PoolingformerSelfAttention
from longformer_ops.nn import dense
from longformer_ops.ops.attention import sliding_window_attention as _local_attention
from longformer_ops.ops.dropout import dropout_seed
from longformer_ops.runtime import checks, kernels

traffic: collections.Counter = collections.Counter()
"""Bytes this process has sent through this module, by kind: ``halo`` (K and V rows), ``halo gradients``,
``mask`` (key padding rows), ``sums`` (all-reduced tensors: the global tokens' rows and partial softmax
sums, per-sequence outputs; counted once, a ring all-reduce sends about twice that), ``objects`` (the
pickled lengths and arguments every call agrees on). ``traffic.clear()`` starts a count."""
waited: collections.Counter = collections.Counter()
"""Seconds this process has spent in this module's communication, by the same kinds as ``traffic``
(waiting for the other ranks included)."""


@contextlib.contextmanager
def _counted(kind: str, sent: int):
    traffic[kind] += sent
    started = time.perf_counter()
    try:
        yield
    finally:
        waited[kind] += time.perf_counter() - started


def _all_gather_object(everyone: list, mine, group) -> None:
    with _counted("objects", len(pickle.dumps(mine))):
        dist.all_gather_object(everyone, mine, group=group)


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    with _counted("sums", tensor.numel() * tensor.element_size()):
        dist.all_reduce(tensor, op=op, group=group)


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
        return (
            dist.get_global_rank(self.group, self.rank + offset)
            if self.group is not dist.group.WORLD
            else self.rank + offset
        )


def _describe(q, k, v, w, dilations, autoregressive, scale, key_padding_mask, dropout_p, return_lse) -> tuple:
    """What every rank must agree on, and this rank's length."""
    max_dilation = int(max(dilations)) if not isinstance(dilations, torch.Tensor) else int(dilations.max())
    return (
        dict(
            batch=q.shape[0],
            heads=q.shape[2],
            kv_heads=k.shape[2],
            head_dim=q.shape[3],
            dtype=str(q.dtype),
            device=q.device.type,
            w=w,
            dilations=tuple(int(x) for x in dilations),
            autoregressive=autoregressive,
            scale=scale,
            key_padding_mask=key_padding_mask is not None,
            dropout_p=dropout_p,
            return_lse=return_lse,
        ),
        q.shape[1],
        w * max_dilation,
    )


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
        for neighbour, needed in (
            (r + 1, before(r + 1) if r + 1 < len(seq_lens) else 0),
            (r - 1, after(r - 1) if r > 0 else 0),
        ):
            if rows < needed:
                raise ValueError(
                    f"sequence shards {seq_lens} (one per rank): rank {r}'s {rows} rows are fewer than the {needed} "
                    f"rows of halo rank {neighbour} needs from it (w * max(d) = {halo}); give every rank at least "
                    f"{halo} rows, or use fewer ranks"
                )
    return HaloPlan(
        group=group,
        rank=rank,
        ranks=len(seq_lens),
        start=starts[rank],
        length=length,
        before=before(rank),
        after=after(rank),
        to_previous=after(rank - 1) if rank > 0 else 0,
        to_next=before(rank + 1) if rank + 1 < len(seq_lens) else 0,
    )


def _swap(
    plan: HaloPlan,
    first: torch.Tensor | None,
    last: torch.Tensor | None,
    from_previous: torch.Tensor | None,
    from_next: torch.Tensor | None,
    kind: str,
) -> None:
    """One round of point-to-point messages along dim 1: ``first`` to the previous rank, ``last`` to the
    next, ``from_previous`` and ``from_next`` filled from them (None: nothing that way); the bytes sent
    counted in ``traffic[kind]``."""
    ops, sent = [], 0
    for tensor, offset, send in ((first, -1, True), (last, 1, True), (from_previous, -1, False), (from_next, 1, False)):
        if tensor is not None and tensor.shape[1] > 0:
            ops.append(dist.P2POp(dist.isend if send else dist.irecv, tensor, plan.peer(offset), plan.group))
            sent += tensor.numel() * tensor.element_size() if send else 0
    if ops:
        with _counted(kind, sent):
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
        first = packed(k[:, : plan.to_previous], v[:, : plan.to_previous]) if plan.to_previous else None
        last = packed(k[:, n - plan.to_next :], v[:, n - plan.to_next :]) if plan.to_next else None
        received_before = k.new_empty(b, plan.before, kv_heads, 2 * f)
        received_after = k.new_empty(b, plan.after, kv_heads, 2 * f)
        _swap(plan, first, last, received_before, received_after, "halo")
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
        to_previous = grad[:, : plan.before].contiguous() if plan.before else None
        to_next = grad[:, plan.before + n :].contiguous() if plan.after else None
        from_previous = grad.new_empty(grad.shape[0], plan.to_previous, *grad.shape[2:])
        from_next = grad.new_empty(grad.shape[0], plan.to_next, *grad.shape[2:])
        _swap(plan, to_previous, to_next, from_previous, from_next, "halo gradients")
        own = grad[:, plan.before : plan.before + n].clone()
        own[:, : plan.to_previous] += from_previous
        own[:, n - plan.to_next :] += from_next
        return own[..., :f], own[..., f:], None


def _exchange_mask(plan: HaloPlan, mask: torch.Tensor) -> torch.Tensor:
    """The key padding mask with the halo rows' around it (not differentiable)."""
    b, n = mask.shape
    as_bytes = mask.to(torch.uint8)[..., None, None]  # [b, n, 1, 1]: the rows along dim 1, as K's
    first = as_bytes[:, : plan.to_previous].contiguous() if plan.to_previous else None
    last = as_bytes[:, n - plan.to_next :].contiguous() if plan.to_next else None
    before = as_bytes.new_empty(b, plan.before, 1, 1)
    after = as_bytes.new_empty(b, plan.after, 1, 1)
    _swap(plan, first, last, before, after, "mask")
    return torch.cat([before, as_bytes, after], dim=1)[..., 0, 0].bool()


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: int,
    d=1,
    autoregressive: bool = False,
    scale: float | None = None,
    *,
    group=None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
):
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
        raise RuntimeError(
            "longformer_ops.distributed needs torch.distributed initialised (torch.distributed.init_process_group)"
        )
    error, described, seq_len, halo = None, None, 0, 0
    try:
        q, k, v = kernels.autocast_inputs(q, k, v)
        w, dilations, scale = checks.check_sliding_window_attention(
            q, k, v, w, d, autoregressive, scale, key_padding_mask
        )
        dropout_p = checks.check_dropout_p(dropout_p)
        checks.check_bool("return_lse", return_lse)
        if dropout_p > 0 and not kernels.available("attention", q.device, q.dtype):
            raise NotImplementedError(
                f"dropout_p > 0 needs the fused local-attention kernels, which this machine's "
                f"libraries lack for {q.device.type} and {q.dtype}; got dropout_p={dropout_p}"
            )
        described, seq_len, halo = _describe(
            q, k, v, w, dilations, autoregressive, scale, key_padding_mask, dropout_p, return_lse
        )
    except (TypeError, ValueError, NotImplementedError) as caught:
        error = caught
    seed = int(dropout_seed()) if error is None and dropout_p > 0 else 0  # (rank 0's serves every rank)
    everyone = [None] * dist.get_world_size(group)
    _all_gather_object(
        everyone, (None if error is None else f"{type(error).__name__}: {error}", described, seq_len, halo, seed), group
    )
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
    q_all = torch.cat(
        [q.new_zeros(q.shape[0], plan.before, *q.shape[2:]), q, q.new_zeros(q.shape[0], plan.after, *q.shape[2:])],
        dim=1,
    )
    mask_all = None if key_padding_mask is None else _exchange_mask(plan, key_padding_mask)
    if dropout_p > 0:
        # The fused op, given the seed: its high 32 bits offset the mask's rows by this call's first
        # row in the whole sequence (tvm_kernels.compute.dropout_row_key).
        offset_seed = torch.tensor(everyone[0][4] + ((plan.start - plan.before) << 32), dtype=torch.int64)
        out, lse = torch.ops.longformer_ops.attention(
            q_all,
            k_all,
            v_all,
            mask_all,
            offset_seed,
            w,
            kernels.dilation_argument(dilations),
            autoregressive,
            scale,
            dropout_p,
        )
    else:
        out, lse = _local_attention(
            q_all, k_all, v_all, w, dilations, autoregressive, scale, key_padding_mask=mask_all, return_lse=True
        )
    rows = slice(plan.before, plan.before + seq_len)
    out = out[:, rows].contiguous()
    return (out, lse[:, rows].contiguous()) if return_lse else out


# ============================================================================ the model
# After sequence_parallel(model) each rank runs the model on its own slice of the sequence. What needs
# the rest of the sequence, and how it gets it:
#   position ids          the earlier shards' real tokens (counted: one all_gather_object)
#   local attention       the halo (sliding_window_attention above)
#   global tokens         their inputs, gathered to every rank (an all_reduce of [b, g, hidden]); their
#                         own rows attend to every rank's keys: partial softmax sums, merged by all_reduce
#   <s> (pooler, head)    group rank 0's first row, to every rank
#   span logits, losses   gathered, or summed over the ranks
# Each cross-rank step is differentiable: an all_reduce's backward sums the ranks' gradients, so the
# ranks' parameter gradients are shares whose sum is the one-process gradient.


class _SumOverRanks(torch.autograd.Function):
    """The sum of every rank's ``x``; the backward sums the ranks' gradients (each rank's output feeds
    every rank's loss). (torch.distributed.nn.functional.all_reduce, which did this, is deprecated.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = x.clone(memory_format=torch.contiguous_format)
        _all_reduce(total, group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return _SumOverRanks.apply(grad, ctx.group), None


def _sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's ``x`` (the same shape on each); differentiable."""
    return _SumOverRanks.apply(x, group)


@dataclass(frozen=True)
class _Extent:
    """This rank's slice: rows ``start ... start + length`` of a sequence of ``total`` rows."""

    start: int
    length: int
    total: int

    def whole(self, x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
        """Every rank's slice of ``x`` along ``dim``, in rank order: the whole sequence's, on every rank
        (differentiable for floating-point ``x``)."""
        dim = dim % x.dim()
        placed = torch.nn.functional.pad(
            x, [0, 0] * (x.dim() - 1 - dim) + [self.start, self.total - self.start - self.length]
        )
        if x.is_floating_point():
            return _sum_over_ranks(placed, group)
        _all_reduce(placed, group)
        return placed


def _gather_from_ranks(group, batch: int, length: int, payload=None) -> tuple[_Extent, list[tuple[int, object]]]:
    """One ``all_gather_object``: this rank's extent, and every rank's first row and ``payload``. Raises
    ValueError on every rank when the ranks' batch sizes differ."""
    everyone = [None] * dist.get_world_size(group)
    _all_gather_object(everyone, (batch, length, payload), group)
    batches = [entry[0] for entry in everyone]
    if len(set(batches)) > 1:
        raise ValueError(
            f"every rank must pass the same batch size (its slice of the same sequences): got {batches} (one per rank)"
        )
    starts = [0]
    for _, rows, _ in everyone:
        starts.append(starts[-1] + rows)
    rank = dist.get_rank(group)
    return _Extent(starts[rank], length, starts[-1]), [(start, entry[2]) for start, entry in zip(starts, everyone)]


@dataclass
class _SequenceGlobals:
    """The whole sequence's global tokens as every rank sees them: ``tokens`` (positions in the whole
    sequence, ``[b, g]``), and the slots this rank holds: example ``own_example``, row ``own_row`` of
    this slice, slot ``own_slot``."""

    tokens: GlobalTokens
    extent: _Extent
    own_example: torch.Tensor
    own_row: torch.Tensor
    own_slot: torch.Tensor

    @staticmethod
    def gather(is_global: torch.Tensor, group) -> _SequenceGlobals | None:
        """From every rank's ``is_global [b, n_r]`` (one host sync and one all_gather_object); None when
        no rank has a global token."""
        b, n = is_global.shape
        extent, everyone = _gather_from_ranks(group, b, n, [row.nonzero().flatten().tolist() for row in is_global])
        # Each example's global positions in the whole sequence, in order (ranks hold consecutive rows).
        positions = [[start + p for start, theirs in everyone for p in theirs[example]] for example in range(b)]
        slots = max(len(mine) for mine in positions) if b else 0
        if slots == 0:
            return None
        device = is_global.device
        valid = torch.tensor([[j < len(mine) for j in range(slots)] for mine in positions], device=device)
        padded = torch.tensor([mine + [0] * (slots - len(mine)) for mine in positions], device=device)  # (0: empty)
        own = [
            (example, p - extent.start, slot)
            for example, mine in enumerate(positions)
            for slot, p in enumerate(mine)
            if extent.start <= p < extent.start + n
        ]
        own_example, own_row, own_slot = (
            torch.tensor(column, dtype=torch.long, device=device) for column in (zip(*own) if own else ([], [], []))
        )
        return _SequenceGlobals(GlobalTokens(padded, valid), extent, own_example, own_row, own_slot)

    def rows(self, x: torch.Tensor, group) -> torch.Tensor:
        """The global tokens' rows of every rank's ``x [b, n_r, ...]``: ``[b, g, ...]`` on every rank
        (zeros in empty slots); differentiable."""
        b, g = self.tokens.positions.shape
        mine = x.new_zeros(b, g, *x.shape[2:]).index_put(
            (self.own_example, self.own_slot), x[self.own_example, self.own_row]
        )
        return _sum_over_ranks(mine, group)


class _SequenceParallelSelfAttention:
    """Mixed into :class:`longformer_ops.models.layer.LongformerSelfAttention`: the layer on this rank's slice
    of the sequence (its rows of what the layer returns for the whole sequence)."""

    sequence_group: dist.ProcessGroup

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, output_attentions: bool = False
    ):
        if output_attentions:
            raise NotImplementedError(
                "output_attentions=True is not supported under sequence parallelism (each "
                "rank would hold its rows of attentions over global columns of the whole "
                "sequence); run the one-process model to inspect attentions"
            )
        checks.check_hidden_states(hidden_states, self.query.in_features, self.query.weight)
        b, n, hidden = hidden_states.shape
        if attention_mask is None:
            attention_mask = hidden_states.new_zeros(b, n)
        elif attention_mask.shape != (b, n):
            raise ValueError(
                f"attention_mask must be [batch, seq_len] = {(b, n)} (negative = padding, 0 = local, "
                f"positive = global), got shape {tuple(attention_mask.shape)}"
            )
        group = self.sequence_group
        is_padding = attention_mask < 0
        is_global = (attention_mask > 0) & ~is_padding
        slots = _SequenceGlobals.gather(is_global, group)

        q = self._heads(self._scaled_query(hidden_states, in_place=False))
        k, v = (self._heads(dense.apply_linear(projection, hidden_states)) for projection in (self.key, self.value))
        dropout_p = self.dropout if self.training else 0.0
        # Global tokens are removed from the band as keys (every query reaches them through their columns).
        context, lse = sliding_window_attention(
            q,
            k,
            v,
            self.window,
            self.dilation,
            self.autoregressive,
            1.0,
            group=group,
            key_padding_mask=is_padding | is_global,
            dropout_p=dropout_p,
            return_lse=True,
        )
        if slots is not None:
            slot_states = slots.rows(hidden_states, group)  # [b, g, hidden]
            key_slots, value_slots = (
                self._heads(dense.apply_linear(projection, slot_states)) for projection in (self.key, self.value)
            )
            context = self._merge_global_keys(
                context, lse, q, key_slots, value_slots, slots.tokens, dropout_p, slots.extent.start
            )
        del q, k, v  # (autograd keeps what its backward needs) before the global rows'
        context = context.masked_fill(is_padding[:, :, None, None], 0)
        if slots is not None:  # the global tokens' own rows replace their local ones
            global_context = self._global_rows_over_ranks(hidden_states, is_padding, slot_states, slots)
            context.index_put_((slots.own_example, slots.own_row), global_context[slots.own_example, slots.own_slot])
        return context.reshape(b, n, hidden), None, None

    def _global_rows_over_ranks(self, hidden_states, is_padding, slot_states, slots: _SequenceGlobals):
        """Each global token's row over every rank's keys: ``[b, g, h, d]`` on every rank. Each rank sums
        its rows' terms of the softmax under one shift (the ranks' largest score), the sums are added."""
        group = self.sequence_group
        queries = self._global_queries(slot_states)  # [b, g, h, d]
        scores, through_weights = self._global_row_scores(
            hidden_states, queries, is_padding, slots.tokens, slots.extent.start
        )  # [b, n, h, g]
        b, n, h, g = scores.shape
        # Any shift common to the ranks gives the same result, so it needs no gradient.
        shift = scores.detach().amax(1) if n else scores.new_full((b, h, g), torch.finfo(scores.dtype).min)
        _all_reduce(shift, group, dist.ReduceOp.MAX)
        weights = torch.exp(scores - shift[:, None])
        total = _sum_over_ranks(weights.sum(1), group)  # [b, h, g]
        context = self._global_row_context(self._global_row_dropout(weights), hidden_states, through_weights)
        context = _sum_over_ranks(context, group)  # [b, g, h, d]
        return context / total.clamp_min(torch.finfo(total.dtype).tiny).transpose(1, 2)[..., None]


class _SequenceParallelEmbeddings:
    """Mixed into :class:`longformer_ops.models.model.LongformerEmbeddings`: position ids that continue from
    the earlier ranks' slices (RoBERTa's count only real tokens: the earlier slices' are counted)."""

    sequence_group: dist.ProcessGroup

    def position_ids(self, input_ids: torch.Tensor | None, shape: torch.Size, device) -> torch.Tensor:
        local = super().position_ids(input_ids, shape, device)
        if input_ids is None:
            extent, _ = _gather_from_ranks(self.sequence_group, shape[0], shape[1])
            return local + extent.start
        real = input_ids != self.pad_token_id
        extent, counts = _gather_from_ranks(self.sequence_group, shape[0], shape[1], real.sum(1).tolist())
        before = torch.tensor(
            [sum(theirs[example] for start, theirs in counts if start < extent.start) for example in range(shape[0])],
            dtype=local.dtype,
            device=local.device,
        )
        return local + before[:, None] * real


class _SequenceParallelFirstToken:
    """Mixed into the pooler and the classification head, which read the first token: they read the
    sequence's (group rank 0's first row) on every rank."""

    sequence_group: dist.ProcessGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The same operations on every rank (a backward collective must be reached by each of them).
        first = torch.nn.functional.pad(x[:, :1], [0, 0] * (x.dim() - 2) + [0, 1 - min(x.shape[1], 1)])
        first = torch.where(torch.tensor(dist.get_rank(self.sequence_group) == 0, device=x.device), first, 0)
        return super().forward(_sum_over_ranks(first, self.sequence_group))


class _SequenceParallelTask:
    """Mixed into our task models: whole-sequence default global attention, span logits and losses."""

    sequence_group: dist.ProcessGroup
    _sequence_parallel_base: type

    def forward(self, *args, **kwargs):
        base = self._sequence_parallel_base
        arguments = inspect.signature(base.forward).bind(self, *args, **kwargs).arguments
        del arguments["self"]
        group = self.sequence_group
        if arguments.get("global_attention_mask") is None and base in _DEFAULT_GLOBAL_ATTENTION:
            arguments["global_attention_mask"] = _DEFAULT_GLOBAL_ATTENTION[base](self, arguments, group)
        labels = {name: arguments.pop(name, None) for name in _WHOLE_SEQUENCE_LOSSES.get(base, ())}
        out = base.forward(self, **arguments)
        if base is tasks.LongformerForQuestionAnswering:
            extent, _ = _gather_from_ranks(group, *out.start_logits.shape)
            out.start_logits, out.end_logits = (extent.whole(x, group) for x in (out.start_logits, out.end_logits))
            if labels["start_positions"] is not None and labels["end_positions"] is not None:
                out.loss = tasks.span_loss(
                    out.start_logits, out.end_logits, labels["start_positions"], labels["end_positions"]
                )
        elif labels and labels["labels"] is not None:
            out.loss = _token_mean_loss(out.logits, labels["labels"], group)
        return out


def _token_mean_loss(logits: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    """The task models' per-token loss (the mean cross-entropy over labels that are not -100) over
    every rank's tokens, the same on every rank."""
    labels = labels.to(logits.device).reshape(-1)
    total = tasks.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, reduction="sum")
    counted = (labels != -100).sum().to(total.dtype)
    _all_reduce(counted, group)
    return _sum_over_ranks(total, group) / counted


def _sliced_default(rule):
    """A default global attention computed on the whole sequence's input_ids, then sliced to this rank's."""

    def default(model, arguments, group):
        ids = arguments.get("input_ids")
        if ids is None:
            return None  # (the model warns, or uses no global attention)
        extent, _ = _gather_from_ranks(group, ids.shape[0], ids.shape[-1])
        return rule(extent.whole(ids, group, dim=-1), model.config.sep_token_id)[
            ..., extent.start : extent.start + extent.length
        ]

    return default


def _first_token_default(model, arguments, group):
    source = arguments.get("input_ids")
    source = arguments.get("inputs_embeds") if source is None else source
    if source is None:
        return None
    mask = torch.zeros(source.shape[:2], dtype=torch.long, device=source.device)
    if dist.get_rank(group) == 0 and mask.shape[1]:
        mask[:, 0] = 1
    return mask


_DEFAULT_GLOBAL_ATTENTION = {
    tasks.LongformerForSequenceClassification: _first_token_default,
    tasks.LongformerForQuestionAnswering: _sliced_default(tasks.question_global_mask),
    tasks.LongformerForMultipleChoice: _sliced_default(tasks.choice_global_mask),
}
_WHOLE_SEQUENCE_LOSSES = {  # the labels whose loss needs every rank's logits
    tasks.LongformerForMaskedLM: ("labels",),
    tasks.LongformerForTokenClassification: ("labels",),
    tasks.LongformerForQuestionAnswering: ("start_positions", "end_positions"),
}
_MIXINS = {
    LongformerSelfAttention: _SequenceParallelSelfAttention,
    model_module.LongformerEmbeddings: _SequenceParallelEmbeddings,
    model_module.LongformerPooler: _SequenceParallelFirstToken,
    tasks.LongformerClassificationHead: _SequenceParallelFirstToken,
    **{task: _SequenceParallelTask for task in tasks.TASK_MODELS},
}
_mixed_classes: dict[type, type] = {}


def _sequence_parallel_class(base: type) -> type:
    if base not in _mixed_classes:
        _mixed_classes[base] = type(
            f"SequenceParallel{base.__name__}",
            (_MIXINS[base], base),
            {"_sequence_parallel_base": base, "__module__": __name__},
        )
    return _mixed_classes[base]


def sequence_parallel(model: nn.Module, group=None) -> nn.Module:
    """Run ``model`` (our :class:`longformer_ops.LongformerModel` or one of its task models) with the
    sequence split across the ranks of ``group`` (default: the world); returns ``model``, changed in
    place (its weights and ``state_dict()`` unchanged).

    Afterwards each rank calls the model with its own contiguous slice of ``input_ids`` (or
    ``inputs_embeds``), ``attention_mask``, ``global_attention_mask`` and ``token_type_ids``: rank 0 the
    first rows, lengths may differ, every rank the same batch and every other argument (labels:
    per-token ones sliced, ``start_positions``/``end_positions`` and per-sequence labels whole).

    - Position ids continue across the ranks; global tokens may sit anywhere, on any rank.
    - Per-token outputs (``last_hidden_state``, masked-LM and token logits) are this rank's rows of the
      one-process model's; per-sequence outputs (``pooler_output``, classification and multiple-choice
      logits, question answering's ``start_logits``/``end_logits`` over the whole sequence, and every
      ``loss``) are the whole sequence's, the same on every rank, and differentiable on each.
    - Gradients: when each rank backpropagates its share of the loss (its own rows' per-token terms,
      the per-sequence terms divided by the number of ranks; for the model's ``loss``: ``loss / ranks``),
      each parameter's gradient summed over the ranks is the one-process gradient. Sum them (an
      ``all_reduce`` over ``group``) before the optimizer step; data parallelism over another group
      (DistributedDataParallel with its ``process_group``) averages across replicas as usual.
    - Gradient checkpointing works. Dropout: the attention's masks are the whole sequence's (the
      result does not depend on the number of ranks); hidden-state dropout draws each rank's own.
    - Every call is a collective: every rank of ``group`` must call the model, and backpropagate, together.

    Refused: Poolingformer layers (level 2 would need a halo of pooled rows; NotImplementedError),
    ``output_attentions=True`` (at call time), and any other model (TypeError). transformers' own
    Longformer models, patched by :func:`longformer_ops.hf.patch` or not, cannot go this way: their
    forward pads the sequence to a multiple of the window and numbers positions per call, and their
    heads read the first token and average losses over the local rows; load their weights into ours
    (:func:`longformer_ops.from_hf_pretrained`) instead.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "longformer_ops.distributed needs torch.distributed initialised (torch.distributed.init_process_group)"
        )
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not in the group passed as group")
    models = (model_module.LongformerModel, *tasks.TASK_MODELS)
    base = getattr(type(model), "_sequence_parallel_base", type(model))
    if base not in models:
        raise TypeError(
            f"sequence_parallel takes longformer_ops' {', '.join(m.__name__ for m in models)}, got "
            f"{type(model).__module__}.{type(model).__qualname__}. transformers' Longformer models cannot "
            f"be sharded (they pad to the window and number positions per call): load their weights "
            f"with longformer_ops.from_hf_pretrained"
        )
    pooling = [name for name, module in model.named_modules() if isinstance(module, PoolingformerSelfAttention)]
    if pooling:
        raise NotImplementedError(
            f"sequence_parallel does not shard Poolingformer layers (their pooled level 2 would "
            f"need a halo of pools): {pooling[0]} is one"
        )
    for module in model.modules():
        base = getattr(type(module), "_sequence_parallel_base", type(module))
        if base in _MIXINS:
            module.__class__ = _sequence_parallel_class(base)
            module.sequence_group = group
    return model
