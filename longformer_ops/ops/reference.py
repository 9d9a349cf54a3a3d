"""Plain-PyTorch references for the banded products. No kernels in here.

- :func:`diagonaled_mm_reference`: a direct gather formulation of the exact
  semantics (any window, dilation, autoregressive); the oracle for tests.
- :func:`sliding_window_attention_reference` (and its probabilities,
  :func:`sliding_window_probs_reference`): local attention (scores, softmax, context) from it.
- :func:`sliding_chunks_qk` / :func:`sliding_chunks_pv`: the sliding-chunks
  algorithm (Hugging Face's), dense einsums over overlapping chunks of 2w.
  No dilation, no autoregressive mode; the layer's pure-PyTorch fallback and a
  benchmark baseline.
- :func:`pool_sequence_reference` / :func:`pooling_attention_reference`: Poolingformer's second
  level, pools built one by one and dense attention with an explicit mask.

Layout ``[batch, seq, heads, features]``; band tensors ``[batch, seq, heads, c]``
with ``c = 2w + 1`` (``w + 1`` when autoregressive).
"""

from __future__ import annotations

import math

import torch

from longformer_ops.runtime.band import invalid_locations, key_positions


def _per_head(d, heads: int, device) -> torch.Tensor:
    """An int, list or tensor of dilations -> int64 tensor [heads]."""
    if isinstance(d, int):
        return torch.full((heads,), d, dtype=torch.int64, device=device)
    return torch.as_tensor(d, dtype=torch.int64, device=device)


def _gather_keys(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """x ``[b, n, h, f]``, keys ``[n, h, c]`` (clamped) -> ``[b, n, h, c, f]``."""
    b, n, h, f = x.shape
    c = keys.shape[-1]
    index = keys.permute(1, 0, 2).reshape(1, h, n * c, 1).expand(b, h, n * c, f)
    gathered = torch.gather(x.transpose(1, 2), 2, index)  # [b, h, n*c, f]
    return gathered.view(b, h, n, c, f).transpose(1, 2)


def diagonaled_mm_reference(
    t1, t2, w: int, d, is_t1_diagonaled: bool = False, padding: float = 0, autoregressive: bool = False
) -> torch.Tensor:
    """Same contract as :func:`longformer_ops.diagonaled_mm`, in plain PyTorch (memory ``O(n*c*f)``).

    Q.K^T mode: ``out[b,i,h,j] = sum_f t1[b,i,h,f] * t2[b, i + d[h]*(j-w), h, f]``, invalid
    positions = ``padding``. probs.V mode: ``out[b,i,h,f] = sum_j t1[b,i,h,j] * t2[b, key, h, f]``
    over valid keys. Differentiable with autograd.
    """
    b, n, h, _ = t2.shape
    dil = _per_head(d, h, t2.device)
    keys = key_positions(n, w, dil, autoregressive)
    invalid = (keys < 0) | (keys >= n)
    gathered = _gather_keys(t2, keys.clamp(0, n - 1))  # [b, n, h, c, f]
    if is_t1_diagonaled:
        probs = t1.masked_fill(invalid, 0)
        return torch.einsum("bihj,bihjf->bihf", probs, gathered)
    scores = torch.einsum("bihf,bihjf->bihj", t1, gathered)
    return scores.masked_fill(invalid, padding)


def _sliding_window_scores(
    q, k, w: int, d, autoregressive: bool, scale: float | None, key_padding_mask, softcap: float | None = None
) -> torch.Tensor:
    """Band scores ``[b, n, h, c]`` of ``scale * Q.K^T`` (soft-capped to ``softcap * tanh(s /
    softcap)`` where ``softcap`` is given), ``-inf`` at keys outside the sequence, and ``-inf``
    added at keys flagged in ``key_padding_mask`` (added, as torch's attention and transformers'
    Longformer add their masks: a NaN or +inf score of a flagged key stays NaN)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = diagonaled_mm_reference(q * scale, k, w, d, False, float("-inf"), autoregressive)
    b, n, h, _ = q.shape
    keys = key_positions(n, w, _per_head(d, h, q.device), autoregressive)  # [n, h, c]
    inside = (keys >= 0) & (keys < n)
    if softcap is not None:
        scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~inside, float("-inf"))
    if key_padding_mask is not None:
        masked = key_padding_mask[:, keys.clamp(0, max(n - 1, 0))] & inside  # [b, n, h, c]
        scores = scores + scores.new_zeros(masked.shape).masked_fill_(masked, float("-inf"))
    return scores


def sliding_window_probs_reference(
    q,
    k,
    w: int,
    d,
    autoregressive: bool = False,
    scale: float | None = None,
    key_padding_mask=None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The band probabilities of :func:`sliding_window_attention_reference`, ``[b, n, h, c]``: a softmax
    of the scores with ``-inf`` at keys outside the sequence or flagged in ``key_padding_mask``
    (a row with no key left: 0; a NaN or +inf score makes its row NaN, as a dense softmax does)."""
    scores = _sliding_window_scores(q, k, w, d, autoregressive, scale, key_padding_mask, softcap)
    no_key = (scores == float("-inf")).all(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(no_key, 0), dim=-1).masked_fill(no_key, 0)


def sliding_window_lse_reference(
    q,
    k,
    w: int,
    d,
    autoregressive: bool = False,
    scale: float | None = None,
    key_padding_mask=None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each row's log-sum-exp of the same scores, ``[b, n, h]`` (``-inf`` for a row with no key left):
    what ``sliding_window_attention(..., return_lse=True)`` returns beside the result. Differentiable,
    with gradient 0 (not NaN) at rows with no key."""
    scores = _sliding_window_scores(q, k, w, d, autoregressive, scale, key_padding_mask, softcap)
    empty = (scores == float("-inf")).all(-1)
    return torch.logsumexp(scores.masked_fill(empty[..., None], 0), dim=-1).masked_fill(empty, float("-inf"))


def sliding_window_attention_reference(
    q,
    k,
    v,
    w: int,
    d,
    autoregressive: bool = False,
    scale: float | None = None,
    key_padding_mask=None,
    dropout_factor: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as :func:`longformer_ops.sliding_window_attention`: the probabilities of
    :func:`sliding_window_probs_reference` (times ``dropout_factor``, ``[b, n, h, c]``, if given)
    times V."""
    probs = sliding_window_probs_reference(q, k, w, d, autoregressive, scale, key_padding_mask, softcap)
    if dropout_factor is not None:
        probs = probs * dropout_factor.to(probs.dtype)
    return diagonaled_mm_reference(probs, v, w, d, True, 0, autoregressive)


_UINT32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix32 on int64 tensors holding uint32 values (products wrap; the low 32 bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _UINT32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _UINT32
    return x ^ (x >> 16)


def dropout_factor_reference(seed: int, batch: int, seq_len: int, heads: int, band: int, p: float) -> torch.Tensor:
    """The fused kernels' dropout mask as factors ``[b, n, h, c]`` in float64: ``1 / (1 - p)`` where band
    column j of query i in head h of example b is kept, else 0. Each row's key is murmur3's finaliser
    chained over (seed, b * heads + h, i); column j is kept when the top 24 bits of
    mix(key + j * 0x9E3779B9) are >= int(p * 2^24) (``tvm_kernels/compute.py``, ``dropout_factor``).
    The seed's low 32 bits seed it; its high 32 bits are added to each row i (a shard's first row in
    a longer sequence)."""
    bh = (torch.arange(batch)[:, None] * heads + torch.arange(heads)[None, :])[:, None, :]  # [b, 1, h]
    row = (torch.arange(seq_len)[None, :, None] + (seed >> 32)) & _UINT32  # [1, n, 1]
    key = _mix32((seed & _UINT32) ^ _mix32(((bh * _GOLDEN) & _UINT32) ^ _mix32(row)))  # [b, n, h]
    bits = _mix32((key[..., None] + torch.arange(band) * _GOLDEN) & _UINT32) >> 8  # [b, n, h, c]
    kept = bits >= int(p * 2**24)
    return kept.to(torch.float64) * (1.0 / (1.0 - p) if p < 1 else 0.0)


# ---------------------------------------------------------------------------
# Sliding chunks (Hugging Face's algorithm), w >= 1, dilation 1, symmetric only.
# ---------------------------------------------------------------------------


def _chunk(x: torch.Tensor, w: int) -> torch.Tensor:
    """[bh, n, f] with n % (2w) == 0 -> overlapping chunks [bh, n/w - 1, 2w, f], stride w."""
    bh, n, f = x.shape
    return x.as_strided(
        size=(bh, n // w - 1, 2 * w, f), stride=(x.stride(0), w * x.stride(1), x.stride(1), x.stride(2))
    )


def _pad_to_multiple(x: torch.Tensor, multiple: int) -> torch.Tensor:
    n = x.shape[1]
    extra = (-n) % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, extra)) if extra else x


def _to_bh(x: torch.Tensor) -> torch.Tensor:
    b, n, h, f = x.shape
    return x.transpose(1, 2).reshape(b * h, n, f)


def sliding_chunks_qk(q: torch.Tensor, k: torch.Tensor, w: int, padding: float = 0) -> torch.Tensor:
    """Band scores ``[b, n, h, 2w+1]`` via dense matmuls over overlapping chunks (about 2x the band's FLOPs).

    Chunk ``c`` covers positions ``[c*w, c*w + 2w)``. Queries of block ``c`` (positions
    ``[c*w, c*w + w)``) find their left keys and themselves in chunk ``c-1`` and their right
    keys in chunk ``c``. The sequence is padded to a multiple of 2w and un-padded on return;
    invalid positions hold ``padding``.
    """
    if w < 1:
        raise ValueError(f"sliding chunks needs w >= 1, got w={w}")
    b, n, h, _ = q.shape
    if n == 0:  # (no chunk to view)
        return q.new_empty(b, 0, h, 2 * w + 1)
    qc = _chunk(_to_bh(_pad_to_multiple(q, 2 * w)), w)
    kc = _chunk(_to_bh(_pad_to_multiple(k, 2 * w)), w)
    chunk_scores = torch.einsum("bcxf,bcyf->bcxy", qc, kc)  # [bh, chunks, 2w, 2w]
    bh, chunks = chunk_scores.shape[:2]
    # Diagonal j of query row x is chunk column x + j - w.
    x = torch.arange(2 * w, device=q.device).view(-1, 1)
    col = x + torch.arange(2 * w + 1, device=q.device).view(1, -1) - w  # [2w, 2w+1]
    diagonals = torch.gather(chunk_scores, 3, col.clamp(0, 2 * w - 1).expand(bh, chunks, 2 * w, 2 * w + 1))
    scores = chunk_scores.new_empty(bh, chunks + 1, w, 2 * w + 1)  # [bh, blocks, w, 2w+1]
    scores[:, 1:, :, : w + 1] = diagonals[:, :, w:, : w + 1]
    scores[:, :-1, :, w + 1 :] = diagonals[:, :, :w, w + 1 :]
    scores[:, 0, :, : w + 1] = diagonals[:, 0, :w, : w + 1]  # first block: no chunk to its left
    scores[:, -1, :, w + 1 :] = diagonals[:, -1, w:, w + 1 :]  # last block: no chunk to its right
    scores = scores.view(b, h, -1, 2 * w + 1)[:, :, :n].transpose(1, 2)
    invalid = invalid_locations(n, w, torch.ones(h, dtype=torch.int64, device=q.device), False)
    return scores.masked_fill(invalid, padding)


def sliding_chunks_pv(probs: torch.Tensor, v: torch.Tensor, w: int) -> torch.Tensor:
    """Context ``[b, n, h, f]`` from band probabilities ``[b, n, h, 2w+1]`` via chunked matmuls.

    Block ``c`` of w queries reads the 3w values ``[c*w - w, c*w + 2w)``; the band is skewed
    so that diagonal ``j`` of row ``x`` lands in chunk column ``x + j``. Invalid positions of
    ``probs`` are ignored.
    """
    if w < 1:
        raise ValueError(f"sliding chunks needs w >= 1, got w={w}")
    b, n, h, f = v.shape
    if n == 0:
        return v.new_empty(b, 0, h, f)
    invalid = invalid_locations(n, w, torch.ones(h, dtype=torch.int64, device=v.device), False)
    p = _to_bh(_pad_to_multiple(probs.masked_fill(invalid, 0), w))  # [bh, np, 2w+1]
    bh, np_, _ = p.shape
    blocks = np_ // w
    # Skew: pad each row by w+1, flatten, drop w, re-view with row length 3w+1 -> column x + j.
    skewed = torch.nn.functional.pad(p.view(bh, blocks, w, 2 * w + 1), (0, w + 1))
    skewed = skewed.view(bh, blocks, -1)[:, :, : w * (3 * w + 1)].view(bh, blocks, w, 3 * w + 1)[..., : 3 * w]
    vp = torch.nn.functional.pad(_to_bh(_pad_to_multiple(v, w)), (0, 0, w, w))  # [bh, np + 2w, f]
    vc = vp.as_strided((bh, blocks, 3 * w, f), (vp.stride(0), w * vp.stride(1), vp.stride(1), vp.stride(2)))
    context = torch.einsum("bcxy,bcyf->bcxf", skewed, vc)  # [bh, blocks, w, f]
    return context.reshape(b, h, np_, f)[:, :, :n].transpose(1, 2)


# ----------------------------------------------------------------------------- Poolingformer's level 2
def pool_sequence_reference(x, kernel_size: int, stride: int, kind: str, is_padding=None, ldconv_logits=None):
    """Pools built one at a time: ``([b, m, h, d], valid [b, m])`` as :func:`longformer_ops.models.pooling.pool_sequence`
    defines them (positions ``j * stride + i``, ``i < kernel_size``, inside the sequence and not padding)."""
    b, n, h, d = x.shape
    m = -(-n // stride)
    rows, valid = [], torch.zeros(b, m, dtype=torch.bool)
    for example in range(b):
        pools = []
        for j in range(m):
            offsets = [
                i
                for i in range(kernel_size)
                if j * stride + i < n and (is_padding is None or not bool(is_padding[example, j * stride + i]))
            ]
            if not offsets:
                pools.append(x.new_zeros(h, d))
                continue
            valid[example, j] = True
            window = x[example, [j * stride + i for i in offsets]]  # [len, h, d]
            if kind == "mean":
                pools.append(window.mean(0))
            elif kind == "max":
                pools.append(window.amax(0))
            else:  # ldconv: a softmax over the pool's positions, one weight per head
                weights = torch.softmax(ldconv_logits[example, j][:, offsets], dim=-1)  # [h, len]
                pools.append(torch.einsum("hl,lhd->hd", weights, window))
        rows.append(torch.stack(pools))
    return torch.stack(rows), valid.to(x.device)


def pooling_attention_reference(
    q,
    pooled_k,
    pooled_v,
    window: int,
    kernel_size: int,
    stride: int,
    pool_valid=None,
    autoregressive: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
):
    """Dense level-2 attention: query ``i`` sees pool ``j`` iff ``|j * stride + (kernel_size - 1) / 2 - i| <= window``
    (and, autoregressive, ``j * stride + kernel_size - 1 <= i``) and the pool is valid; an explicit
    ``[n, m]`` mask, one softmax per row (then torch's dropout); a row that sees nothing gets 0."""
    b, n, h, d = q.shape
    m = pooled_k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(m, device=q.device)[None, :]
    allowed = (2 * j * stride + kernel_size - 1 - 2 * i).abs() <= 2 * window  # [n, m]
    if autoregressive:
        allowed = allowed & (j * stride + kernel_size - 1 <= i)
    allowed = allowed[None, None] if pool_valid is None else allowed[None, None] & pool_valid[:, None, None, :]
    scores = torch.einsum("bnhd,bmhd->bhnm", q, pooled_k) * scale
    # The lowest finite value, not -inf: a row that sees nothing stays finite (and gets 0 below).
    probs = torch.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1) * allowed
    probs = torch.nn.functional.dropout(probs, dropout_p, training=dropout_p > 0)
    return torch.einsum("bhnm,bmhd->bnhd", probs, pooled_v)
