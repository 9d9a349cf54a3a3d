"""Poolingformer's second level: pooling attention over a wide window, on the local-attention kernels.

The functions the layer, :class:`longformer_ops.PoolingformerSelfAttention`, composes:

- :func:`pool_sequence` compresses keys or values along the sequence: pool ``j`` covers positions
  ``j * stride .. j * stride + kernel_size - 1`` (clipped to the sequence, padding left out), and
  is the mean, the max, or an LDConv weighted sum (weights: a softmax over the pool's positions of
  caller-given logits) of them. :func:`pool_then_project` gives the same pools of projected keys
  or values (mean and LDConv) by projecting the pooled input, at ``1 / stride`` of the work.
- :func:`pooling_attention`: query ``i`` attends to the pooled keys whose centres
  ``j * stride + (kernel_size - 1) / 2`` lie within ``window`` tokens of ``i`` (and, when
  autoregressive, whose pools end at or before ``i``).

How level 2 runs on the banded kernels: write ``i = r + stride * t``. Whether query ``i`` sees
pool ``j`` depends only on ``o = j - t`` and the residue ``r``: for each ``r`` it is an interval
``lo_r <= o <= hi_r``. So the queries of one residue, taken in order, see an ordinary band of the
pooled sequence, one-sided once the pooled keys are shifted by ``hi_r``: a call of
:func:`longformer_ops.sliding_window_attention` with ``autoregressive=True`` and
``w = hi_r - lo_r``. Residues with the same interval width (at most two widths) share one call,
stacked along the batch. Memory: the stacked queries, keys and values are the size of the
inputs (plus a few rows per residue); the fused kernels keep no band, and nothing has the size of
``n x (2 * window / stride)`` beyond what the three-step path's band output needs (CUDA).
"""

from __future__ import annotations

import math

import torch

from longformer_ops.models.config import POOLING_KINDS
from longformer_ops.nn import dense
from longformer_ops.ops.attention import sliding_window_attention


def num_pools(seq_len: int, stride: int) -> int:
    """Pools start at 0, stride, 2 * stride, ... up to the last position: ``ceil(seq_len / stride)``."""
    return -(-seq_len // stride)


def _windows(x: torch.Tensor, kernel_size: int, stride: int, is_padding: torch.Tensor | None):
    """The pools' windows of ``x [b, n, ...]``: ``(windows [b, m, ..., k], counted [b, m, k], valid [b, m])``;
    ``counted`` marks the window positions that lie in the sequence and are not padding."""
    b, n = x.shape[:2]
    m = num_pools(n, stride)
    span = (m - 1) * stride + kernel_size  # positions the pools reach
    counts = torch.ones(b, n, dtype=torch.bool, device=x.device) if is_padding is None else ~is_padding
    counted = torch.nn.functional.pad(counts, (0, span - n)).unfold(1, kernel_size, stride)  # [b, m, k]
    padded = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, span - n))
    return padded.unfold(1, kernel_size, stride), counted, counted.any(-1)


def _ldconv_weights(ldconv_logits: torch.Tensor, counted: torch.Tensor, valid: torch.Tensor, expected: tuple):
    """LDConv's weights ``[b, m, h, k]``: a softmax of the logits over each pool's counted positions."""
    if ldconv_logits is None or ldconv_logits.shape != expected:
        raise ValueError(
            f"ldconv_logits must be [batch, pools, heads, kernel_size] = {expected}, "
            f"got {None if ldconv_logits is None else tuple(ldconv_logits.shape)}"
        )
    counted = counted[:, :, None, :]  # [b, m, 1, k]
    # An empty pool softmaxes zeros (not all -inf, whose NaN would reach every gradient), then gets weight 0.
    logits = ldconv_logits.masked_fill(~counted, float("-inf")).masked_fill(~valid[:, :, None, None], 0)
    return torch.softmax(logits, dim=-1) * counted


def pool_sequence(
    x: torch.Tensor,
    kernel_size: int,
    stride: int,
    kind: str = "mean",
    is_padding: torch.Tensor | None = None,
    ldconv_logits: torch.Tensor | None = None,
):
    """Pool ``x [b, n, h, d]`` along the sequence into ``([b, m, h, d], valid [b, m])``, ``m = ceil(n / stride)``.

    Pool ``j`` takes the positions ``j * stride + i`` for ``i < kernel_size`` that lie in the
    sequence and are not padding (``is_padding [b, n]`` bool); ``valid`` is False for a pool with
    none of them (its row is 0). ``kind``: ``"mean"``, ``"max"``, or ``"ldconv"`` (lightweight
    dynamic convolution: ``sum_i softmax_i(ldconv_logits[b, j, h, :]) * x[j * stride + i]``, the
    softmax over the pool's positions that count, weights shared by a head's channels).
    """
    b, n, h, d = x.shape
    windows, counted, valid = _windows(x, kernel_size, stride, is_padding)  # [b, m, h, d, k], [b, m, k], [b, m]
    inside = counted[:, :, None, None, :]
    if kind == "mean":
        total = windows.masked_fill(~inside, 0).sum(-1)
        pooled = total / inside.sum(-1).clamp_min(1).to(x.dtype)
    elif kind == "max":
        pooled = windows.masked_fill(~inside, float("-inf")).amax(-1)
        pooled = pooled.masked_fill(~valid[:, :, None, None], 0)
    elif kind == "ldconv":
        weights = _ldconv_weights(ldconv_logits, counted, valid, (b, valid.shape[1], h, kernel_size))
        # Elementwise, not einsum: that would be a batched matmul of b * m * h tiny [d, k] x [k] products.
        pooled = (windows * weights.to(x.dtype)[:, :, :, None, :]).sum(-1)
    else:
        raise ValueError(f"kind (pooling) must be one of {POOLING_KINDS}, got {kind!r}")
    return pooled, valid


def pool_then_project(
    y: torch.Tensor,
    projections,
    heads: int,
    kernel_size: int,
    stride: int,
    kind: str,
    is_padding: torch.Tensor | None = None,
    ldconv_logits: torch.Tensor | None = None,
):
    """``pool_sequence(projection(y) split into heads, ...)`` for each affine ``projection`` (an
    ``nn.Linear``, hidden -> hidden), for ``kind`` ``"mean"`` or ``"ldconv"``, computed the cheap way
    round: both pools are weighted sums with weights adding up to 1, so they commute with an affine
    map, and projecting the ``m = n / stride`` pooled rows costs ``1 / stride`` of projecting all
    ``n``. LDConv's weights differ per head, so ``y`` is pooled per head ``[b, m, h, hidden]`` and
    each head projected with its rows of the weight. Returns ``([b, m, h, d] per projection, valid)``.
    """
    b, n, hidden = y.shape
    windows, counted, valid = _windows(y, kernel_size, stride, is_padding)  # [b, m, hidden, k], [b, m, k], [b, m]
    if kind == "mean":
        weights = counted.to(y.dtype) / counted.sum(-1, keepdim=True).clamp_min(1).to(y.dtype)  # [b, m, k]
        pooled = (windows * weights[:, :, None, :]).sum(-1)  # [b, m, hidden]
        outputs = [dense.apply_linear(p, pooled).view(b, -1, heads, hidden // heads) for p in projections]
    elif kind == "ldconv":
        weights = _ldconv_weights(ldconv_logits, counted, valid, (b, valid.shape[1], heads, kernel_size))
        pooled = dense.einsum("bmck,bmhk->bmhc", windows, weights.to(y.dtype))  # [b, m, h, hidden]
        outputs = [
            dense.einsum("bmhc,hdc->bmhd", pooled, p.weight.view(heads, -1, hidden)) + p.bias.view(heads, -1)
            for p in projections
        ]
    else:
        raise ValueError(f"pool_then_project needs a linear pooling (mean or ldconv), got kind={kind!r}")
    return [x.masked_fill(~valid[:, :, None, None], 0) for x in outputs], valid


def pool_centres(seq_len: int, kernel_size: int, stride: int) -> torch.Tensor:
    """Each pool's centre token, ``j * stride + (kernel_size - 1) // 2`` clipped to the sequence
    (``[m]`` positions): where a layer reads the input its LDConv weights are computed from."""
    return (torch.arange(num_pools(seq_len, stride)) * stride + (kernel_size - 1) // 2).clamp_max(seq_len - 1)


def residue_intervals(window: int, kernel_size: int, stride: int, autoregressive: bool) -> list[tuple[int, int]]:
    """For each residue ``r`` of the query position mod ``stride``: ``(lo_r, hi_r)``, the offsets
    ``o = j - i // stride`` of the pools query ``i`` sees (empty when ``lo_r > hi_r``).

    Pool ``j``'s centre is ``j * stride + (kernel_size - 1) / 2``; it is seen when
    ``|centre - i| <= window``, i.e. ``|2 o stride + kernel_size - 1 - 2 r| <= 2 window``, and
    when autoregressive only if the pool ends at or before ``i``: ``o stride + kernel_size - 1 <= r``.
    """
    intervals = []
    for r in range(stride):
        lo = math.ceil((2 * r - kernel_size + 1 - 2 * window) / (2 * stride))
        hi = math.floor((2 * r - kernel_size + 1 + 2 * window) / (2 * stride))
        if autoregressive:
            hi = min(hi, math.floor((r - kernel_size + 1) / stride))
        intervals.append((lo, hi))
    return intervals


def _stack(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index [R, length]`` of ``x [b, rows, ...]``, one sequence per (residue, example):
    ``[R * b, length, ...]`` (residue-major)."""
    picked = x[:, index.flatten()].unflatten(1, index.shape)  # [b, R, length, ...]
    return picked.transpose(0, 1).flatten(0, 1)


def pooling_attention(
    q: torch.Tensor,
    pooled_k: torch.Tensor,
    pooled_v: torch.Tensor,
    window: int,
    kernel_size: int,
    stride: int,
    *,
    pool_valid: torch.Tensor | None = None,
    autoregressive: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Each query attends to the pooled keys within ``window`` tokens of it (see the module docstring).

    ``q [b, n, h, d]``; ``pooled_k``, ``pooled_v`` ``[b, m, h, d]`` with ``m = ceil(n / stride)``
    (from :func:`pool_sequence` with the same ``kernel_size`` and ``stride``); ``pool_valid [b, m]``
    bool (False: a pool no query sees). ``scale`` defaults to ``1 / sqrt(d)``; ``dropout_p`` as in
    :func:`longformer_ops.sliding_window_attention`. A query that sees no pool gets 0.
    Returns ``[b, n, h, d]``, differentiable in ``q``, ``pooled_k`` and ``pooled_v``.
    """
    b, n, h, d = q.shape
    m = num_pools(n, stride)
    if pooled_k.shape != (b, m, h, d) or pooled_v.shape != (b, m, h, d):
        raise ValueError(
            f"pooled_k and pooled_v must be [batch, ceil(seq_len / stride), heads, head_dim] = "
            f"{(b, m, h, d)}, got {tuple(pooled_k.shape)} and {tuple(pooled_v.shape)}"
        )
    device = q.device
    # A zero row appended to each input: what a stacked slot without a query or a pool gathers.
    zero_row = q.new_zeros(b, 1, h, d)
    q_ext = torch.cat([q, zero_row], dim=1)
    k_ext, v_ext = (torch.cat([x, zero_row.to(x.dtype)], dim=1) for x in (pooled_k, pooled_v))
    valid_ext = torch.cat(
        [
            torch.ones(b, m, dtype=torch.bool, device=device) if pool_valid is None else pool_valid,
            torch.zeros(b, 1, dtype=torch.bool, device=device),
        ],
        dim=1,
    )

    intervals = residue_intervals(window, kernel_size, stride, autoregressive)
    widths = sorted({hi - lo for lo, hi in intervals if hi >= lo})
    pieces, row_of = [], torch.full((n,), -1, dtype=torch.long)  # row_of[i]: i's row in cat(pieces) (-1: none)
    rows_so_far = 0
    for width in widths:
        residues = [r for r, (lo, hi) in enumerate(intervals) if hi - lo == width]
        shift = max(0, max(intervals[r][1] for r in residues))  # leading rows, so that pool 0 has a slot
        length = shift + m
        slots = torch.arange(length)
        query_index, key_index = [], []
        for slot, r in enumerate(residues):
            t = slots - shift  # slot u holds query r + stride * t ...
            position = r + stride * t
            query_index.append(torch.where((t >= 0) & (position < n), position, n))
            pool = t + intervals[r][1]  # ... and the pool t + hi_r as its key
            key_index.append(torch.where((pool >= 0) & (pool < m), pool, m))
            queries = len(range(r, n, stride))
            row_of[r::stride] = rows_so_far + slot * length + shift + torch.arange(queries)
        query_index, key_index = (torch.stack(x).to(device) for x in (query_index, key_index))  # [R, length]
        out = sliding_window_attention(
            _stack(q_ext, query_index),
            _stack(k_ext, key_index),
            _stack(v_ext, key_index),
            width,
            1,
            True,
            scale,
            key_padding_mask=~_stack(valid_ext, key_index),
            dropout_p=dropout_p,
        )
        pieces.append(out.view(len(residues), b, length, h, d).transpose(0, 1).reshape(b, len(residues) * length, h, d))
        rows_so_far += len(residues) * length
    pieces.append(q.new_zeros(b, 1, h, d))  # the row of queries that see no pool
    row_of = torch.where(row_of >= 0, row_of, rows_so_far).to(device)
    return torch.cat(pieces, dim=1).index_select(1, row_of)
