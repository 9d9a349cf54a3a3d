"""``diagonaled_mm`` and ``mask_invalid_locations``: the public banded ops, checked and differentiable.

Each public function checks every argument (:mod:`longformer_ops.checks`), applies autocast's
dtype, and calls one custom op of :mod:`longformer_ops.kernels` (which holds the kernels and
their autograd).
"""

from __future__ import annotations

import torch

from longformer_ops import checks, kernels
from longformer_ops.reference import fill_invalid_locations_

_ops = torch.ops.longformer_ops


def diagonaled_mm(t1: torch.Tensor, t2: torch.Tensor, w: int, d, is_t1_diagonaled: bool = False,
                  padding: float = 0, autoregressive: bool = False, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Banded matrix product of Longformer attention, on the prebuilt TVM kernels.

    Layout ``[batch, seq_len, heads, features]``; ``w`` is the one-sided window;
    the band has ``c = 2w + 1`` columns (``w + 1`` when ``autoregressive``: keys
    only to the left and self). Band column ``j`` of query ``i`` in head ``h``
    is the key ``i + d[h] * (j - w)``; keys outside ``[0, seq_len)`` are invalid.

    - ``is_t1_diagonaled=False`` (Q.K^T mode): ``t1 = Q [b, n, h, f]``,
      ``t2 = K [b, n, h, f]`` -> scores ``[b, n, h, c]``; invalid positions hold
      exactly ``padding``.
    - ``is_t1_diagonaled=True`` (probs.V mode): ``t1 = P [b, n, h, c]``,
      ``t2 = V [b, n, h, f]`` -> ``[b, n, h, f]``, summing over valid keys only.

    ``d`` is an int (all heads) or a 1-D integer tensor (or list) with one
    dilation >= 1 per head; under ``torch.compile`` pass an int or a list (a tensor's
    values are data the compiler cannot see). dtypes: float32, float64, float16, bfloat16
    on CPU; float32, float16, bfloat16 on CUDA; half types accumulate in float32. Under
    ``torch.autocast``, float32 inputs run in autocast's dtype. Differentiable in ``t1`` and
    ``t2`` (twice: the backward is made of the same ops). Inputs need not be contiguous.

    ``out``: a contiguous tensor of the result's shape, dtype and device to write into and
    return, sharing no memory with ``t1``/``t2``; not differentiable. For code that manages its
    own buffers; without it, large CPU outputs come from recycled memory already
    (:mod:`longformer_ops._output_cache`).
    """
    t1, t2 = kernels.autocast_inputs(t1, t2)
    w, dilations, band = checks.check_diagonaled_mm(t1, t2, w, d, is_t1_diagonaled, padding, autoregressive)
    if out is not None:
        checks.check_out(out, (*t2.shape[:3], t2.shape[3] if is_t1_diagonaled else band), {"t1": t1, "t2": t2})
        if is_t1_diagonaled:
            _ops.band_pv_out(t1, t2, w, dilations, autoregressive, out)
        else:
            _ops.band_qk_out(t1, t2, w, dilations, autoregressive, float(padding), out)
        return out
    if is_t1_diagonaled:
        return _ops.band_pv(t1, t2, w, dilations, autoregressive)
    return _ops.band_qk(t1, t2, w, dilations, autoregressive, float(padding))


def transposed_product(t1: torch.Tensor, t2: torch.Tensor, w: int, d, autoregressive: bool = False, *,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """The backward's banded product on its own: ``t1`` a band ``[b, n, h, c]``, ``t2`` rows
    ``[b, n, h, f]``; ``out[b, p, h] = sum of t1[b, i, h, j] * t2[b, i, h]`` over the ``(i, j)``
    whose key ``i + d[h] * (j - w)`` is ``p`` (``dV = P^T dO`` for probs.V).

    Same arguments (``out`` included) and checks as :func:`diagonaled_mm` in probs.V mode; not
    differentiable (it is what the gradients call). Exposed to benchmark that kernel and for custom
    backward passes.
    """
    t1, t2 = kernels.autocast_inputs(t1, t2)
    w, dilations, _ = checks.check_diagonaled_mm(t1, t2, w, d, True, 0, autoregressive)
    if out is None:
        return _ops.band_transposed(t1.detach(), t2.detach(), w, dilations, autoregressive)
    checks.check_out(out, tuple(t2.shape), {"t1": t1, "t2": t2}, differentiable=False)
    _ops.band_transposed_out(t1, t2, w, dilations, autoregressive, out)
    return out


def mask_invalid_locations(scores: torch.Tensor, w: int, d, autoregressive: bool) -> torch.Tensor:
    """Set, in place, band positions whose key falls outside the sequence to ``-inf``; return ``scores``.

    ``scores`` is ``[b, n, h, c]`` as returned by :func:`diagonaled_mm` in Q.K^T mode. Only the
    first and last ``w * max(d)`` rows can hold such positions, and only those are touched: the
    mask is of their size, not the band's. Plain torch ops (differentiable, and traced by
    ``torch.compile``).
    """
    w, dilations = checks.check_mask_invalid_locations(scores, w, d, autoregressive)
    return fill_invalid_locations_(scores, w, dilations, autoregressive, float("-inf"))
