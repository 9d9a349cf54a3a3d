"""``diagonaled_mm`` and ``mask_invalid_locations``: the public banded ops, with autograd
(and ``fill_band_at_keys_``, which removes flagged keys from a band).

Three layers, as in most kernel libraries:
- ``_launch``: one call of a prebuilt kernel (padding head_dim to what the
  library accepts, allocating the output);
- ``_DiagonaledMM``: a ``torch.autograd.Function`` whose backward uses the same
  prebuilt kernels (no dense fallback);
- ``diagonaled_mm``: the public function, checking every argument first.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.autograd.function import once_differentiable

from longformer_ops import checks
from longformer_ops._loader import library_for
from longformer_ops._manifest import function_name
from longformer_ops._output_cache import new_output
from longformer_ops.reference import band_width, invalid_locations


@functools.lru_cache(maxsize=256)
def _dilation_tensor(dilations: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Cached so that a layer called every step does not copy its dilations to the GPU each time.
    return torch.tensor(dilations, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=64)
def _invalid_mask(seq_len: int, w: int, dilations: tuple[int, ...], autoregressive: bool, device: torch.device):
    return invalid_locations(seq_len, w, torch.tensor(dilations, device=device), autoregressive)


def _pad_features(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


def _launch(op: str, t1: torch.Tensor, t2: torch.Tensor, w: int, dilations: tuple[int, ...],
            autoregressive: bool, padding: float = 0.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run one prebuilt kernel. ``op`` is 'qk' (t1, t2 rows), 'pv' or 'transposed' (t1 the band).
    Writes into ``out`` (checked by the caller) when given, else into a new tensor."""
    b, n, h, f = t2.shape
    band = w + (0 if autoregressive else w) + 1
    if out is None:
        out = new_output(t2, (b, n, h, band) if op == "qk" else (b, n, h, f))
    if b * n * h == 0 or (op != "qk" and f == 0):  # the output is empty
        return out
    if op == "qk" and f == 0:  # empty dot products: 0 where the key is valid
        return out.zero_().masked_fill_(_invalid_mask(n, w, dilations, autoregressive, t2.device), padding)
    library = library_for(t2.device, str(t2.dtype).removeprefix("torch."))
    kernel = library.function(function_name(op, autoregressive))
    dilation = _dilation_tensor(dilations, t2.device)
    t1, t2 = t1.contiguous(), t2.contiguous()
    t2 = _pad_features(t2, library.feature_multiple)
    with torch.cuda.device(t2.device) if t2.device.type == "cuda" else contextlib.nullcontext():
        if op == "qk":
            kernel(_pad_features(t1, library.feature_multiple), t2, dilation, float(padding), out)
        elif t2.shape[-1] == f:
            kernel(t1, t2, dilation, out)
        else:  # head_dim padded for the kernel: its output has the padded width
            padded_out = new_output(t2, t2.shape)
            kernel(t1, t2, dilation, padded_out)
            out.copy_(padded_out[..., :f])
    return out


class _DiagonaledMM(torch.autograd.Function):
    """Forward: qk (S = Q.K^T band) or pv (O = P.V). Backward, with the same kernels:
    S = qk(Q, K): dQ = pv(dS, K), dK = transposed(dS, Q);
    O = pv(P, V): dP = qk(dO, V) (0 at invalid positions), dV = transposed(P, dO).
    """

    @staticmethod
    def forward(ctx, t1, t2, w, dilations, is_t1_diagonaled, padding, autoregressive):
        ctx.save_for_backward(t1, t2)
        ctx.config = (w, dilations, is_t1_diagonaled, autoregressive)
        return _launch("pv" if is_t1_diagonaled else "qk", t1, t2, w, dilations, autoregressive, padding)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        t1, t2 = ctx.saved_tensors
        w, dilations, is_t1_diagonaled, autoregressive = ctx.config
        need_t1, need_t2 = ctx.needs_input_grad[:2]
        grad = grad.contiguous()
        grad_t1 = grad_t2 = None
        if is_t1_diagonaled:
            if need_t1:
                grad_t1 = _launch("qk", grad, t2, w, dilations, autoregressive, 0.0)
            if need_t2:
                grad_t2 = _launch("transposed", t1, grad, w, dilations, autoregressive)
        else:
            if need_t1:
                grad_t1 = _launch("pv", grad, t2, w, dilations, autoregressive)
            if need_t2:
                grad_t2 = _launch("transposed", grad, t1, w, dilations, autoregressive)
        return grad_t1, grad_t2, None, None, None, None, None


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
    dilation >= 1 per head. dtypes: float32, float64, float16, bfloat16 on CPU;
    float32, float16, bfloat16 on CUDA; half types accumulate in float32.
    Differentiable in ``t1`` and ``t2`` (once). Inputs need not be contiguous.

    ``out``: a contiguous tensor of the result's shape, dtype and device to write into and
    return, sharing no memory with ``t1``/``t2``; not differentiable. For code that manages its
    own buffers; without it, large CPU outputs come from recycled memory already
    (:mod:`longformer_ops._output_cache`).
    """
    w, dilations, band = checks.check_diagonaled_mm(t1, t2, w, d, is_t1_diagonaled, padding, autoregressive)
    if out is not None:
        op = "pv" if is_t1_diagonaled else "qk"
        checks.check_out(out, (*t2.shape[:3], t2.shape[3] if is_t1_diagonaled else band), {"t1": t1, "t2": t2})
        return _launch(op, t1, t2, w, dilations, autoregressive, float(padding), out)
    return _DiagonaledMM.apply(t1, t2, w, dilations, is_t1_diagonaled, float(padding), autoregressive)


def transposed_product(t1: torch.Tensor, t2: torch.Tensor, w: int, d, autoregressive: bool = False, *,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """The backward's banded product on its own: ``t1`` a band ``[b, n, h, c]``, ``t2`` rows
    ``[b, n, h, f]``; ``out[b, p, h] = sum of t1[b, i, h, j] * t2[b, i, h]`` over the ``(i, j)``
    whose key ``i + d[h] * (j - w)`` is ``p`` (``dV = P^T dO`` for probs.V).

    Same arguments (``out`` included) and checks as :func:`diagonaled_mm` in probs.V mode; not
    differentiable (it is what the gradients call). Exposed to benchmark that kernel and for custom
    backward passes.
    """
    w, dilations, _ = checks.check_diagonaled_mm(t1, t2, w, d, True, 0, autoregressive)
    if out is not None:
        checks.check_out(out, tuple(t2.shape), {"t1": t1, "t2": t2}, differentiable=False)
    return _launch("transposed", t1.detach(), t2.detach(), w, dilations, autoregressive, out=out)


def mask_invalid_locations(scores: torch.Tensor, w: int, d, autoregressive: bool) -> torch.Tensor:
    """Set, in place, band positions whose key falls outside the sequence to ``-inf``; return ``scores``.

    ``scores`` is ``[b, n, h, c]`` as returned by :func:`diagonaled_mm` in Q.K^T mode.
    """
    w, dilations = checks.check_mask_invalid_locations(scores, w, d, autoregressive)
    mask = _invalid_mask(scores.shape[1], w, dilations, autoregressive, scores.device)
    return scores.masked_fill_(mask, float("-inf"))


def fill_band_at_keys_(band: torch.Tensor, flags: torch.Tensor, w: int, dilation: tuple[int, ...],
                        autoregressive: bool, value: float) -> torch.Tensor:
    """In place, ``band [b, n, h, c]`` = ``value`` wherever the key of (i, h, j), ``i + d[h] * (j - w)``,
    is inside the sequence and flagged in ``flags [b, n]`` (bool); returns ``band``.

    Each head's flags are a strided view of the zero-padded flags, copied into one bool mask of
    the band's shape (a quarter of a float32 band), then one ``masked_fill_``. No int64 index
    (at n = 4096 it alone was 200 MiB and a third of the layer's time), and no in-place fill per
    head: on a band that requires grad each of those makes autograd copy the whole band's
    gradient once more (12 heads: ~0.7 s of a 2.4 s layer forward+backward at n = 4096).
    """
    b, n = flags.shape
    c = band_width(w, autoregressive)
    at_flagged_keys = torch.empty(band.shape, dtype=torch.bool, device=band.device)
    for head, d in enumerate(dilation):
        padded = torch.nn.functional.pad(flags, (w * d, w * d)).contiguous()      # padded[i + w*d] = flags[i]
        at_flagged_keys[:, :, head] = padded.as_strided((b, n, c), (padded.stride(0), 1, d))  # padded[i + d*j]
    return band.masked_fill_(at_flagged_keys, value)
