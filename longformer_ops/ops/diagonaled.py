"""``diagonaled_mm``, ``mask_invalid_locations`` and ``band_softmax_``: the public banded ops, checked
and differentiable; and ``fill_band_at_keys_``, which removes flagged keys from a band.

Each public function checks every argument (:mod:`longformer_ops.runtime.checks`), applies autocast's
dtype, and calls one custom op of :mod:`longformer_ops.runtime.kernels` (which holds the kernels and
their autograd).
"""

from __future__ import annotations

import torch

from longformer_ops.runtime import checks, kernels
from longformer_ops.runtime.band import band_width, fill_invalid_locations_, key_positions

_ops = torch.ops.longformer_ops


def diagonaled_mm(
    t1: torch.Tensor,
    t2: torch.Tensor,
    w: int,
    d,
    is_t1_diagonaled: bool = False,
    padding: float = 0,
    autoregressive: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
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
    dilation >= 1 per head (under ``torch.compile`` too: a tensor's values are then checked
    when the compiled code runs). dtypes: float32, float64, float16, bfloat16
    on CPU; float32, float16, bfloat16 on CUDA; half types accumulate in float32. Under
    ``torch.autocast``, float32 inputs run in autocast's dtype. Differentiable in ``t1`` and
    ``t2`` (twice: the backward is made of the same ops). Inputs need not be contiguous.

    ``out``: a contiguous tensor of the result's shape, dtype and device to write into and
    return, sharing no memory with ``t1``/``t2``; not differentiable. For code that manages its
    own buffers; without it, large CPU outputs come from recycled memory already
    (:mod:`longformer_ops.runtime.output_cache`).
    """
    t1, t2 = kernels.autocast_inputs(t1, t2)
    w, dilations, band = checks.check_diagonaled_mm(t1, t2, w, d, is_t1_diagonaled, padding, autoregressive)
    dilations = kernels.dilation_argument(dilations)
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


def transposed_product(
    t1: torch.Tensor, t2: torch.Tensor, w: int, d, autoregressive: bool = False, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The backward's banded product on its own: ``t1`` a band ``[b, n, h, c]``, ``t2`` rows
    ``[b, n, h, f]``; ``out[b, p, h] = sum of t1[b, i, h, j] * t2[b, i, h]`` over the ``(i, j)``
    whose key ``i + d[h] * (j - w)`` is ``p`` (``dV = P^T dO`` for probs.V).

    Same arguments (``out`` included) and checks as :func:`diagonaled_mm` in probs.V mode; not
    differentiable (it is what the gradients call). Exposed to benchmark that kernel and for custom
    backward passes.
    """
    t1, t2 = kernels.autocast_inputs(t1, t2)
    w, dilations, _ = checks.check_diagonaled_mm(t1, t2, w, d, True, 0, autoregressive)
    dilations = kernels.dilation_argument(dilations)
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


def band_softmax_(
    scores: torch.Tensor,
    w: int,
    d,
    autoregressive: bool = False,
    *,
    key_padding_mask: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Softmax over each query's band, in place, invalid locations removed; returns ``scores``.

    What :func:`mask_invalid_locations` then ``torch.softmax(scores, dim=-1)`` give, in one pass over
    the band and without a second band: ``scores [b, n, h, c]`` (contiguous, as returned by
    :func:`diagonaled_mm` in Q.K^T mode) becomes each row's softmax over the keys inside the
    sequence, exactly 0 at the others. ``key_padding_mask``: optional bool ``[batch, seq_len]``, True
    for keys no query attends to (removed too). A row with no key left gets 0 (``torch.softmax``
    would give NaN). Half types are computed in float32 and rounded once.

    ``return_lse``: return ``(probs, lse)``, ``lse`` each row's log-sum-exp over its keys
    ``[b, n, h]`` in float32 (float64 for float64), ``-inf`` for a row with no key.
    Differentiable once in ``scores``: the backward keeps only the probabilities (the band itself).
    On a library without the kernel (CUDA today) the same result from torch ops (a masked fill and
    ``torch.softmax``; with autograd, that path holds a second band).
    """
    w, dilations = checks.check_band_softmax(scores, w, d, autoregressive, key_padding_mask)
    checks.check_bool("return_lse", return_lse)
    probs, lse = band_softmax(scores, key_padding_mask, w, dilations, autoregressive, need_lse=return_lse)
    return (probs, lse) if return_lse else probs


def band_softmax(scores, key_padding_mask, w, dilations, autoregressive, need_lse: bool):
    """:func:`band_softmax_` on checked arguments: ``(probs, lse)``, in place where the library has the
    kernel (which gives lse for free); on torch ops lse is None unless ``need_lse`` (for half types it
    costs a float32 copy of the band)."""
    needs_grad = torch.is_grad_enabled() and scores.requires_grad
    if kernels.available("band_softmax", scores.device, scores.dtype):
        dilation = kernels.dilation_argument(dilations)
        if not needs_grad:  # (the op alone: Dynamo traces an autograd.Function's mark_dirty only when it records)
            return scores, torch.ops.longformer_ops.band_softmax_(scores, key_padding_mask, w, dilation, autoregressive)
        return kernels.BandSoftmax.apply(scores, key_padding_mask, w, dilation, autoregressive)
    fill_invalid_locations_(scores, w, dilations, autoregressive, float("-inf"))
    no_key = None
    if key_padding_mask is not None:
        # The lowest finite score, not -inf, so that a row of masked keys gives no NaN (in the
        # softmax or its backward); such a row is then set to 0.
        lowest = torch.finfo(scores.dtype).min
        fill_band_at_keys_(scores, key_padding_mask, w, dilations, autoregressive, lowest)
        no_key = scores.amax(-1, keepdim=True) <= lowest
    lse = torch.logsumexp(scores.to(kernels.accumulation_dtype(scores.dtype)), dim=-1) if need_lse else None
    # In the input dtype: torch's softmax accumulates half types in float32 and rounds once.
    probs = torch.softmax(scores, dim=-1) if needs_grad else torch.softmax(scores, dim=-1, out=scores)
    if no_key is not None:
        lse = None if lse is None else lse.masked_fill(no_key[..., 0], float("-inf"))
        probs = probs.masked_fill(no_key, 0) if needs_grad else probs.masked_fill_(no_key, 0)
    return probs, lse


def fill_band_at_keys_(
    band: torch.Tensor, flags: torch.Tensor, w: int, dilation: tuple[int, ...], autoregressive: bool, value: float
) -> torch.Tensor:
    """In place, ``band [b, n, h, c]`` = ``value`` wherever the key of (i, h, j), ``i + d[h] * (j - w)``,
    is inside the sequence and flagged in ``flags [b, n]`` (bool); returns ``band``. Differentiable
    (the gradient is 0 at the filled positions).

    Rows go in blocks of ``FLAG_BLOCK_ROWS``: each block's flags, a strided view of the zero-padded
    flags per head, become a bool mask of that block (``[.., 1, c]`` when every head has the same
    dilation), then one ``masked_fill_``; in eager mode only blocks with a flagged key within reach
    are touched (one host sync: padding at the end and a few global tokens leave most blocks alone).
    No int64 index (at n = 4096 it alone was 200 MiB and a third of the layer's time) and no
    band-shaped mask. Under autograd one custom function does the fills, so that autograd does
    not copy the band's gradient per in-place fill of a slice; its backward zeroes the same blocks
    of a copy of the incoming gradient (the gradient is the one band it allocates).
    """
    if isinstance(dilation, torch.Tensor):  # under torch.compile, values unseen: one fill the compiler fuses
        n = flags.shape[1]
        keys = key_positions(n, w, dilation.to(band.device), autoregressive)
        return band.masked_fill_(flags[:, keys.clamp(0, max(n - 1, 0))] & (keys >= 0) & (keys < n), value)
    if torch.is_grad_enabled() and band.requires_grad:
        return _FillAtKeys.apply(band, flags, w, tuple(dilation), autoregressive, value)
    return _fill_at_keys_in_blocks(band, flags, w, tuple(dilation), autoregressive, value)


class _FillAtKeys(torch.autograd.Function):
    @staticmethod
    def forward(ctx, band, flags, w, dilation, autoregressive, value):
        _fill_at_keys_in_blocks(band, flags, w, dilation, autoregressive, value)
        ctx.mark_dirty(band)
        ctx.save_for_backward(flags)
        ctx.fill_config = (w, dilation, autoregressive)
        return band

    @staticmethod
    def backward(ctx, grad):
        (flags,) = ctx.saved_tensors
        grad_band = _fill_at_keys_in_blocks(
            grad.clone(memory_format=torch.contiguous_format), flags, *ctx.fill_config, 0.0
        )
        return grad_band, None, None, None, None, None


FLAG_BLOCK_ROWS = 512


def _fill_at_keys_in_blocks(band, flags, w, dilation, autoregressive, value):
    b, n = flags.shape
    c = band_width(w, autoregressive)
    # A dilation of n or more reaches no key but the row's own, as n does: the flags' padding below
    # (w * d each side) stays within w * n, not gigabytes for a dilation near 2^31.
    dilation = tuple(min(d, max(n, 1)) for d in dilation)
    groups = [(0, dilation[0])] if len(set(dilation)) == 1 else list(enumerate(dilation))
    padded = {
        d: torch.nn.functional.pad(flags, (w * d, w * d)).contiguous() for d in set(dilation)
    }  # [i + w*d] = flags[i]
    starts = list(range(0, n, FLAG_BLOCK_ROWS))
    if starts and not torch.compiler.is_compiling():
        reach = w * max(dilation)
        flagged_before = torch.nn.functional.pad(
            flags.any(0).to(torch.int32).cumsum(0), (1, 0)
        )  # [p]: flagged keys < p
        low = torch.tensor([max(0, r - reach) for r in starts], device=flags.device)
        high = torch.tensor([min(n, r + FLAG_BLOCK_ROWS + reach) for r in starts], device=flags.device)
        needed = (flagged_before[high] > flagged_before[low]).tolist()
        starts = [r for r, need in zip(starts, needed) if need]
    for start in starts:
        stop = min(start + FLAG_BLOCK_ROWS, n)
        at_flagged_keys = torch.empty((b, stop - start, len(groups), c), dtype=torch.bool, device=band.device)
        for group, d in groups:
            keys = padded[d][:, start:]  # row start + i, column j reads padded[start + i + d*j]
            at_flagged_keys[:, :, group] = keys.as_strided((b, stop - start, c), (keys.stride(0), 1, d))
        band[:, start:stop].masked_fill_(at_flagged_keys, value)
    return band
