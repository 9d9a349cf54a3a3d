"""``sliding_window_attention``: Longformer's local attention (no global tokens) in one call.

``softmax(scale * Q.K^T restricted to each query's band) . V``, the same as ``diagonaled_mm``
(Q.K^T mode, ``padding=-inf``), a softmax over the band and ``diagonaled_mm`` (probs.V mode). Two
paths, one result, each a few custom ops of :mod:`longformer_ops.runtime.kernels`:

- on a library with the fused kernels (the CPU and CUDA libraries), one op
  computes scores, softmax and context per tile of queries, so the ``[b, n, h, 2w+1]`` band
  never exists in memory; it also gives each row's log-sum-exp, from which its backward op
  recomputes each tile's probabilities and gives dQ, dK and dV (FlashAttention's backward): no
  band in training either;
- otherwise (a library without them) the three steps above, differentiable through the
  band ops' own autograd, the softmax in place on the one band (:func:`longformer_ops.band_softmax_`).
"""

from __future__ import annotations

import torch

from longformer_ops.ops.diagonaled import band_softmax
from longformer_ops.ops.dropout import dropout_seed
from longformer_ops.runtime import checks, kernels

_ops = torch.ops.longformer_ops


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: int,
    d=1,
    autoregressive: bool = False,
    scale: float | None = None,
    *,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Local attention of Longformer: each query attends to the keys of its band only.

    ``q``, ``k``, ``v``: ``[batch, seq_len, heads, head_dim]``, one dtype and device (under
    ``torch.autocast``, float32 inputs run in autocast's dtype). ``k`` and ``v`` may have fewer
    heads, ``kv_heads`` dividing ``heads`` (grouped key/value heads, GQA/MQA): query head ``i``
    reads key/value head ``i // (heads // kv_heads)``, and their gradients sum over the group (the
    fused kernels read them as they lie; the three steps repeat them per query head first).
    Query ``i`` of head ``h`` attends to the keys ``i + d[h] * (j - w)`` for ``j = 0 .. 2w`` (``0 ..
    w`` when ``autoregressive``) that fall inside the sequence; ``d`` an int or one dilation >= 1
    per head (a list or an integer tensor, as in :func:`diagonaled_mm`). ``scale`` multiplies the
    scores (default ``1 / sqrt(head_dim)``). ``key_padding_mask``: optional bool ``[batch,
    seq_len]``, True for keys no query attends to (padding); a query left with no key gets 0.
    Returns ``[batch, seq_len, heads, head_dim]`` in the inputs' dtype.

    A NaN or infinity in the inputs is carried as a dense softmax carries it: a NaN or +inf score
    makes its row NaN, also at a key flagged in ``key_padding_mask`` (the mask is added as -inf,
    as torch's attention and transformers' Longformer add theirs). A non-finite value of ``v``
    also reaches the other rows of the kernel's tile of queries, whose band may not hold it (they
    multiply it by a probability of 0).

    Differentiable in ``q``, ``k``, ``v`` (once). Where the library has the fused kernels (CPU and
    CUDA), neither inference nor training keeps a band in memory (the backward recomputes each
    tile's probabilities from the rows' log-sum-exp).
    ``dropout_p``: attention dropout, as ``torch.nn.functional.dropout`` on the probabilities
    (each zeroed with probability ``dropout_p``, the rest scaled by ``1 / (1 - dropout_p)``);
    pass 0 outside training. On the fused kernels the mask comes from a counter-based generator
    seeded by one draw from torch's default generator (reproducible under ``torch.manual_seed``),
    so the backward regenerates it instead of keeping it; on the three steps it is torch's dropout.
    ``softcap``: logit soft-capping (Gemma 2): each score ``s`` (scaled) becomes ``softcap *
    tanh(s / softcap)`` before the key padding's ``-inf`` is added and the softmax taken; a
    positive number, or None for none (in the fused kernels, forward and backward).
    ``out``: a contiguous tensor of the result's shape, dtype and device to write into and return
    (not differentiable).

    ``return_lse``: return ``(result, lse)``, ``lse`` each row's log-sum-exp of its scaled scores
    over the keys it attends to, ``[batch, seq_len, heads]`` in float32 (float64 for float64
    inputs), ``-inf`` for a row with no key. With it a caller merges this result with attention
    over other keys (the layer's global tokens: ``result * exp(lse - total) + ...``).
    Differentiable too (its gradient joins the softmax's in the same backward).
    """
    q, k, v = kernels.autocast_inputs(q, k, v)
    w, dilations, scale = checks.check_sliding_window_attention(q, k, v, w, d, autoregressive, scale, key_padding_mask)
    dropout_p = checks.check_dropout_p(dropout_p)
    softcap = checks.check_softcap(softcap)
    checks.check_bool("return_lse", return_lse)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if out is not None:
        checks.check_out(out, tuple(q.shape), {"q": q, "k": k, "v": v})
    # (head_dim 0: the three steps, whose band of zero scores gives each row's log-sum-exp.)
    fused = q.shape[-1] > 0 and kernels.available("attention", q.device, q.dtype)
    if k.shape[2] != q.shape[2] and not fused:  # (the fused kernels read grouped heads as they lie)
        k, v = (kernels.repeat_heads(x, q.shape[2]) for x in (k, v))
    if fused:
        seed = dropout_seed() if dropout_p > 0 else torch.zeros((), dtype=torch.int64)
        # (The op narrows w to the keys the dilations reach: kernels.reachable_window.)
        args = (
            q,
            k,
            v,
            key_padding_mask,
            seed,
            w,
            kernels.dilation_argument(dilations),
            autoregressive,
            scale,
            dropout_p,
        )
        if out is None:
            result, lse = _ops.attention(*args, softcap)
        else:
            result, lse = out, _ops.attention_out(*args, out, softcap)
    else:
        result, lse = _three_steps(
            q,
            k,
            v,
            w,
            dilations,
            autoregressive,
            scale,
            key_padding_mask,
            dropout_p,
            softcap,
            out,
            return_lse,
            needs_grad,
        )
    return (result, lse) if return_lse else result


def _three_steps(
    q, k, v, w, dilations, autoregressive, scale, key_padding_mask, dropout_p, softcap, out, return_lse, needs_grad
):
    """Band scores (soft-capped), softmax, band times values, on the band ops (arguments checked by the caller)."""
    if isinstance(dilations, tuple):  # (under torch.compile a dilation tensor's values are not known here)
        w = kernels.reachable_window(w, dilations, q.shape[1])
    dilation = kernels.dilation_argument(dilations)
    scores = _ops.band_qk(q * scale, k, w, dilation, autoregressive, float("-inf"))
    if softcap:  # (-inf outside the sequence becomes -softcap: the softmax masks those keys itself)
        scores = softcap * torch.tanh(scores / softcap)
    probs, lse = band_softmax(scores, key_padding_mask, w, dilations, autoregressive, need_lse=return_lse)
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, dropout_p, training=True, inplace=not needs_grad)
    probs = probs.to(v.dtype)  # (CUDA autocast runs softmax in float32)
    if out is None:
        return _ops.band_pv(probs, v, w, dilation, autoregressive), (lse if return_lse else None)
    _ops.band_pv_out(probs, v, w, dilation, autoregressive, out)
    return out, (lse if return_lse else None)
