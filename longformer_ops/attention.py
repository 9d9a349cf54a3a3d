"""``sliding_window_attention``: Longformer's local attention (no global tokens) in one call.

``softmax(scale * Q.K^T restricted to each query's band) . V``, the same as
``diagonaled_mm`` (Q.K^T mode, ``padding=-inf``), a softmax over the band and
``diagonaled_mm`` (probs.V mode). Two paths, one result:

- on a library with the fused kernels (the CPU libraries), inference runs one kernel that
  computes scores, softmax and context per tile of queries, so the ``[b, n, h, 2w+1]`` band
  never exists in memory (at n = 4096, 12 heads, w = 256: 100 MiB not allocated, faulted in
  and written; ``bench/NOTES.md``); training runs a kernel that also writes the probabilities,
  and a backward kernel for dQ and dS (softmax backward included), then the transposed product
  for dK and dV;
- otherwise (a library without them: CUDA) the three steps above, differentiable through
  :func:`diagonaled_mm`'s kernels.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from longformer_ops import checks
from longformer_ops._loader import library_for
from longformer_ops._manifest import function_name
from longformer_ops.diagonaled import _dilation_tensor, _launch, _new_output, _pad_features, diagonaled_mm, fill_band_at_keys_
from longformer_ops.reference import band_width

# The fused kernels' op names in the libraries (tvm_kernels.variants.FUSED_ATTENTION).
FUSED = ("attention",)
FUSED_TRAINING = ("attention_train", "attention_backward")


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, d=1,
                             autoregressive: bool = False, scale: float | None = None, *,
                             key_padding_mask: torch.Tensor | None = None,
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
    inference keeps no band in memory, and training keeps only the probabilities for the backward.
    ``out``: a contiguous tensor of the result's shape, dtype and device to write into and return
    (not differentiable).

    ``return_lse``: return ``(result, lse)``, ``lse`` each row's log-sum-exp of its scaled scores
    over the keys it attends to, ``[batch, seq_len, heads]`` in float32 (float64 for float64
    inputs), ``-inf`` for a row with no key. With it a caller merges this result with attention
    over other keys (the layer's global tokens: ``result * exp(lse - total) + ...``). Without
    gradients only (no gradient flows through it).
    """
    w, dilations, scale = checks.check_sliding_window_attention(q, k, v, w, d, autoregressive, scale, key_padding_mask)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if return_lse and needs_grad:
        raise ValueError("return_lse=True is for inference only: call it under torch.no_grad() or with inputs "
                         "that do not require grad (no gradient flows through the log-sum-exp)")
    if out is not None:
        checks.check_out(out, tuple(q.shape), {"q": q, "k": k, "v": v})
    if q.numel() == 0 and not needs_grad:
        result = out if out is not None else q.new_empty(q.shape)
        return (result, q.new_empty(q.shape[:3], dtype=_accumulation_dtype(q))) if return_lse else result
    library = library_for(q.device, str(q.dtype).removeprefix("torch.")) if q.numel() else None
    fused = [function_name(op, autoregressive) for op in (FUSED_TRAINING if needs_grad else FUSED)]
    if library is not None and all(library.has(name) for name in fused):
        f = q.shape[-1]
        # Zero features change no score and give zero output columns, dropped below.
        q, k, v = (_pad_features(x, library.feature_multiple) for x in (q, k, v))
        bias = _key_bias(key_padding_mask, q)
        if needs_grad:
            return _FusedAttention.apply(q, k, v, bias, w, dilations, autoregressive, scale, library)[..., :f]
        result, lse = _launch_fused(library, q.contiguous(), k.contiguous(), v.contiguous(), bias, f, w, dilations,
                                    autoregressive, scale, out)
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
            lse = lse.masked_fill_(no_key[..., 0], float("-inf"))
    # In the input dtype: torch's softmax accumulates half types in float32 and rounds once.
    probs = torch.softmax(scores, dim=-1) if needs_grad else torch.softmax(scores, dim=-1, out=scores)
    if no_key is not None:
        probs = probs.masked_fill(no_key, 0) if needs_grad else probs.masked_fill_(no_key, 0)
    result = diagonaled_mm(probs, v, w, dilations, True, autoregressive=autoregressive, out=out)
    return (result, lse) if return_lse else result


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """The kernels' accumulation dtype for inputs like ``x``: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _key_bias(key_padding_mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The fused kernels' additive score bias per key, ``[b, n]`` in the accumulation dtype: -inf at masked keys."""
    bias = torch.zeros(q.shape[:2], dtype=_accumulation_dtype(q), device=q.device)
    return bias if key_padding_mask is None else bias.masked_fill_(key_padding_mask, float("-inf"))


def _launch_fused(library, q, k, v, bias, f: int, w: int, dilations: tuple[int, ...], autoregressive: bool, scale: float,
                  out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The inference kernel on contiguous inputs padded to the library's head_dim multiple (``f``: the real one);
    returns the result and the rows' log-sum-exp."""
    kernel_out = out if out is not None and q.shape[-1] == f else _new_output(q, q.shape)
    lse = q.new_empty(q.shape[:3], dtype=_accumulation_dtype(q))
    library.function(function_name(FUSED[0], autoregressive))(
        q, k, v, bias, _dilation_tensor(dilations, q.device), w, scale, kernel_out, lse)
    if kernel_out.shape[-1] == f:
        return kernel_out, lse
    if out is None:
        return kernel_out[..., :f].contiguous(), lse
    return out.copy_(kernel_out[..., :f]), lse


class _FusedAttention(torch.autograd.Function):
    """Forward: the training kernel (context and the probabilities P). Backward: the backward kernel
    gives dQ and dS = P * (dP - rowsum(dO * O)) in one pass (dP = dO . V^T per tile, never stored),
    then dK = scale * dS^T Q and dV = P^T dO are the transposed product."""

    @staticmethod
    def forward(ctx, q, k, v, bias, w, dilations, autoregressive, scale, library):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = _new_output(q, q.shape)
        probs = _new_output(q, (*q.shape[:3], band_width(w, autoregressive)))
        library.function(function_name(FUSED_TRAINING[0], autoregressive))(
            q, k, v, bias, _dilation_tensor(dilations, q.device), w, scale, out, probs)
        ctx.save_for_backward(q, k, v, out, probs)
        ctx.config = (w, dilations, autoregressive, scale, library)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, out, probs = ctx.saved_tensors
        w, dilations, autoregressive, scale, library = ctx.config
        grad = grad.contiguous()
        grad_q = grad_k = grad_v = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            accumulation = _accumulation_dtype(q)
            delta = (grad.to(accumulation) * out.to(accumulation)).sum(-1)  # [b, n, h]
            grad_q = _new_output(q, q.shape)
            grad_scores = _new_output(q, probs.shape)
            library.function(function_name(FUSED_TRAINING[1], autoregressive))(
                grad, v, k, probs, delta, _dilation_tensor(dilations, q.device), w, scale, grad_q, grad_scores)
            if ctx.needs_input_grad[1]:
                grad_k = _launch("transposed", grad_scores, q, w, dilations, autoregressive).mul_(scale)
        if ctx.needs_input_grad[2]:
            grad_v = _launch("transposed", probs, grad, w, dilations, autoregressive)
        return grad_q, grad_k, grad_v, None, None, None, None, None, None
