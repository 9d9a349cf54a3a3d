"""``sliding_window_attention``: Longformer's local attention (no global tokens) in one call.

``softmax(scale * Q.K^T restricted to each query's band) . V``, the same as
``diagonaled_mm`` (Q.K^T mode, ``padding=-inf``), a softmax over the band and
``diagonaled_mm`` (probs.V mode). Two paths, one result:

- on a library with the fused kernels (the CPU libraries), inference runs one kernel that
  computes scores, softmax and context per tile of queries, so the ``[b, n, h, 2w+1]`` band
  never exists in memory (at n = 4096, 12 heads, w = 256: 100 MiB not allocated, faulted in
  and written; ``bench/NOTES.md``); training runs the same kernel, which also gives each row's
  log-sum-exp, and a backward kernel that recomputes each tile's probabilities from it and gives
  dQ, dK and dV (FlashAttention's backward): no band in training either;
- otherwise (a library without them: CUDA) the three steps above, differentiable through
  :func:`diagonaled_mm`'s kernels.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from longformer_ops import checks
from longformer_ops._loader import library_for
from longformer_ops._manifest import function_name
from longformer_ops._output_cache import new_output
from longformer_ops.diagonaled import _dilation_tensor, _pad_features, diagonaled_mm, fill_band_at_keys_

# The fused kernels' op names in the libraries (tvm_kernels.variants.FUSED_ATTENTION).
FUSED = "attention"
FUSED_BACKWARD = "attention_backward"


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, d=1,
                             autoregressive: bool = False, scale: float | None = None, *,
                             key_padding_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                             out: torch.Tensor | None = None, return_lse: bool = False):
    """Local attention of Longformer: each query attends to the keys of its band only.

    ``q``, ``k``, ``v``: ``[batch, seq_len, heads, head_dim]``, one dtype and device. Query ``i``
    of head ``h`` attends to the keys ``i + d[h] * (j - w)`` for ``j = 0 .. 2w`` (``0 .. w`` when
    ``autoregressive``) that fall inside the sequence; ``d`` an int or one dilation >= 1 per
    head (as in :func:`diagonaled_mm`). ``scale`` multiplies the scores (default
    ``1 / sqrt(head_dim)``). ``key_padding_mask``: optional bool ``[batch, seq_len]``, True for keys
    no query attends to (padding); a query left with no key gets 0. Returns
    ``[batch, seq_len, heads, head_dim]`` in the inputs' dtype.

    Differentiable in ``q``, ``k``, ``v`` (once). Where the library has the fused kernels (CPU),
    neither inference nor training keeps a band in memory (the backward recomputes each tile's
    probabilities from the rows' log-sum-exp).
    ``dropout_p``: attention dropout, as ``torch.nn.functional.dropout`` on the probabilities
    (each zeroed with probability ``dropout_p``, the rest scaled by ``1 / (1 - dropout_p)``);
    pass 0 outside training. On the fused kernels the mask comes from a counter-based generator
    seeded from torch's default generator (reproducible under ``torch.manual_seed``), so the
    backward regenerates it instead of keeping it; on the three steps it is torch's dropout.
    ``out``: a contiguous tensor of the result's shape, dtype and device to write into and return
    (not differentiable).

    ``return_lse``: return ``(result, lse)``, ``lse`` each row's log-sum-exp of its scaled scores
    over the keys it attends to, ``[batch, seq_len, heads]`` in float32 (float64 for float64
    inputs), ``-inf`` for a row with no key. With it a caller merges this result with attention
    over other keys (the layer's global tokens: ``result * exp(lse - total) + ...``).
    Differentiable too (its gradient joins the softmax's in the same backward).
    """
    w, dilations, scale = checks.check_sliding_window_attention(q, k, v, w, d, autoregressive, scale, key_padding_mask)
    dropout_p = checks.check_dropout_p(dropout_p)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    checks.check_bool("return_lse", return_lse)
    if out is not None:
        checks.check_out(out, tuple(q.shape), {"q": q, "k": k, "v": v})
    if q.numel() == 0 and not needs_grad:
        result = out if out is not None else q.new_empty(q.shape)
        return (result, q.new_empty(q.shape[:3], dtype=_accumulation_dtype(q))) if return_lse else result
    library = library_for(q.device, str(q.dtype).removeprefix("torch.")) if q.numel() else None
    fused = [function_name(op, autoregressive) for op in ((FUSED, FUSED_BACKWARD) if needs_grad else (FUSED,))]
    if library is not None and all(library.has(name) for name in fused):
        f = q.shape[-1]
        # Zero features change no score and give zero output columns, dropped below.
        q, k, v = (_pad_features(x, library.feature_multiple) for x in (q, k, v))
        bias = _key_bias(key_padding_mask, q)
        dropout = (dropout_p, _dropout_seed() if dropout_p > 0 else 0)
        if needs_grad:
            result, lse = _FusedAttention.apply(q, k, v, bias, w, dilations, autoregressive, scale, dropout, library)
            return (result[..., :f], lse) if return_lse else result[..., :f]
        result, lse = _launch_fused(library, q.contiguous(), k.contiguous(), v.contiguous(), bias, f, w, dilations,
                                    autoregressive, scale, dropout, out)
        return (result, lse) if return_lse else result
    scores = diagonaled_mm(q * scale, k, w, dilations, False, float("-inf"), autoregressive)
    no_key = None
    if key_padding_mask is not None:
        # The lowest finite score, not -inf, so that a row of masked keys gives no NaN; such a row
        # then gives 0, as in the fused kernels.
        lowest = torch.finfo(scores.dtype).min
        scores = fill_band_at_keys_(scores, key_padding_mask, w, dilations, autoregressive, lowest)
        no_key = scores.amax(-1, keepdim=True) <= lowest
    lse = None
    if return_lse:  # before the in-place softmax below overwrites the scores
        lse = torch.logsumexp(scores.to(_accumulation_dtype(q)), dim=-1)
        if no_key is not None:
            lse = lse.masked_fill(no_key[..., 0], float("-inf"))
    # In the input dtype: torch's softmax accumulates half types in float32 and rounds once.
    probs = torch.softmax(scores, dim=-1) if needs_grad else torch.softmax(scores, dim=-1, out=scores)
    if no_key is not None:
        probs = probs.masked_fill(no_key, 0) if needs_grad else probs.masked_fill_(no_key, 0)
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, dropout_p, training=True, inplace=not needs_grad)
    result = diagonaled_mm(probs, v, w, dilations, True, autoregressive=autoregressive, out=out)
    return (result, lse) if return_lse else result


def _dropout_seed() -> int:
    """The fused kernels' dropout seed: one draw from torch's default generator per call with dropout."""
    return int(torch.randint(0, 2**31 - 1, ()))


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """The kernels' accumulation dtype for inputs like ``x``: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _key_bias(key_padding_mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The fused kernels' additive score bias per key, ``[b, n]`` in the accumulation dtype: -inf at masked keys."""
    bias = torch.zeros(q.shape[:2], dtype=_accumulation_dtype(q), device=q.device)
    return bias if key_padding_mask is None else bias.masked_fill_(key_padding_mask, float("-inf"))


def _launch_fused(library, q, k, v, bias, f: int, w: int, dilations: tuple[int, ...], autoregressive: bool, scale: float,
                  dropout: tuple[float, int], out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel on contiguous inputs padded to the library's head_dim multiple (``f``: the real one),
    ``dropout`` = (p, seed); returns the result and the rows' log-sum-exp."""
    kernel_out = out if out is not None and q.shape[-1] == f else new_output(q, q.shape)
    lse = q.new_empty(q.shape[:3], dtype=_accumulation_dtype(q))
    library.function(function_name(FUSED, autoregressive))(
        q, k, v, bias, _dilation_tensor(dilations, q.device), w, scale, *dropout, kernel_out, lse)
    if kernel_out.shape[-1] == f:
        return kernel_out, lse
    if out is None:
        return kernel_out[..., :f].contiguous(), lse
    return out.copy_(kernel_out[..., :f]), lse


class _FusedAttention(torch.autograd.Function):
    """Forward: the inference kernel (context O and the rows' log-sum-exp). Backward: one kernel gives
    dQ, dK and dV, FlashAttention-style: per tile it recomputes the scores and P = exp(score - lse),
    then dP = dO . V^T, dS = P * (dP - delta), dQ = scale * dS . K, and accumulates dV += P^T dO and
    dK += scale * dS^T Q; no band is kept between the passes or made in either. delta is
    rowsum(dO * O) less the log-sum-exp's own gradient (d lse / d score = P, so it joins dS there),
    computed per tile in the kernel (in torch it was three passes over [b, n, h, f] in float32).
    With dropout (mask Z regenerated from the seed) dP = (dO . V^T) * Z and dV += (P * Z)^T dO."""

    @staticmethod
    def forward(ctx, q, k, v, bias, w, dilations, autoregressive, scale, dropout, library):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _launch_fused(library, q, k, v, bias, q.shape[-1], w, dilations, autoregressive, scale, dropout, None)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.config = (w, dilations, autoregressive, scale, dropout, library)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_lse):
        q, k, v, bias, out, lse = ctx.saved_tensors
        w, dilations, autoregressive, scale, dropout, library = ctx.config
        grad_q, grad_k, grad_v = (new_output(q, q.shape) for _ in range(3))
        library.function(function_name(FUSED_BACKWARD, autoregressive))(
            grad.contiguous(), q, k, v, bias, out, lse, grad_lse.contiguous(), _dilation_tensor(dilations, q.device), w,
            scale, *dropout, grad_q, grad_k, grad_v)
        needs = ctx.needs_input_grad
        return (grad_q if needs[0] else None, grad_k if needs[1] else None, grad_v if needs[2] else None,
                None, None, None, None, None, None, None)
