"""``sliding_window_attention``: Longformer's local attention (no global tokens) in one call.

``softmax(scale * Q.K^T restricted to each query's band) . V``, the same as
``diagonaled_mm`` (Q.K^T mode, ``padding=-inf``), a softmax over the band and
``diagonaled_mm`` (probs.V mode). Two paths, one result:

- inference (no gradient needed) on a library with the fused kernel (the CPU libraries):
  one kernel computes scores, softmax and context per tile of queries, so the
  ``[b, n, h, 2w+1]`` band never exists in memory (at n = 4096, 12 heads, w = 256:
  100 MiB not allocated, faulted in and written; ``bench/NOTES.md``);
- otherwise (gradients, or a library without it: CUDA) the three steps above, differentiable
  through :func:`diagonaled_mm`'s kernels.
"""

from __future__ import annotations

import torch

from longformer_ops import checks
from longformer_ops._loader import library_for
from longformer_ops._manifest import function_name
from longformer_ops.diagonaled import _dilation_tensor, _new_output, _pad_features, diagonaled_mm

FUSED = "attention"  # the fused kernel's op name in the libraries (tvm_kernels.variants.FUSED_ATTENTION)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, d=1,
                             autoregressive: bool = False, scale: float | None = None, *,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Local attention of Longformer: each query attends to the keys of its band only.

    ``q``, ``k``, ``v``: ``[batch, seq_len, heads, head_dim]``, one dtype and device. Query ``i``
    of head ``h`` attends to the keys ``i + d[h] * (j - w)`` for ``j = 0 .. 2w`` (``0 .. w`` when
    ``autoregressive``) that fall inside the sequence; ``d`` an int or one dilation >= 1 per
    head (as in :func:`diagonaled_mm`). ``scale`` multiplies the scores (default
    ``1 / sqrt(head_dim)``). Returns ``[batch, seq_len, heads, head_dim]`` in the inputs' dtype.

    Differentiable in ``q``, ``k``, ``v``. Without gradients it runs the fused kernel where the
    library has one (CPU), with no band in memory. ``out``: a contiguous tensor of the result's
    shape, dtype and device to write into and return (not differentiable).
    """
    w, dilations, scale = checks.check_sliding_window_attention(q, k, v, w, d, autoregressive, scale)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if out is not None:
        checks.check_out(out, tuple(q.shape), {"q": q, "k": k, "v": v})
    if q.numel() == 0:
        return out if out is not None else q.new_empty(q.shape)
    if not needs_grad:
        library = library_for(q.device, str(q.dtype).removeprefix("torch."))
        if library.has(function_name(FUSED, autoregressive)):
            return _launch_fused(library, q, k, v, w, dilations, autoregressive, scale, out)
    scores = diagonaled_mm(q * scale, k, w, dilations, False, float("-inf"), autoregressive)
    # In the input dtype: torch's softmax accumulates half types in float32 and rounds once.
    probs = torch.softmax(scores, dim=-1) if needs_grad else torch.softmax(scores, dim=-1, out=scores)
    return diagonaled_mm(probs, v, w, dilations, True, autoregressive=autoregressive, out=out)


def _launch_fused(library, q, k, v, w: int, dilations: tuple[int, ...], autoregressive: bool, scale: float,
                  out: torch.Tensor | None) -> torch.Tensor:
    f = q.shape[-1]
    # Zero features change no score and give zero output columns, dropped below.
    q, k, v = (_pad_features(x.contiguous(), library.feature_multiple) for x in (q, k, v))
    kernel_out = out if out is not None and q.shape[-1] == f else _new_output(q, q.shape)
    library.function(function_name(FUSED, autoregressive))(
        q, k, v, _dilation_tensor(dilations, q.device), w, scale, kernel_out)
    if kernel_out.shape[-1] == f:
        return kernel_out
    if out is None:
        return kernel_out[..., :f].contiguous()
    return out.copy_(kernel_out[..., :f])
