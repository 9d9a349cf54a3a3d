"""The one file that calls the prebuilt kernels: each kernel entry as a ``torch.library`` custom op.

Every op here is registered under ``torch.ops.longformer_ops`` with a fake (meta) implementation,
so ``torch.compile`` and ``torch.export`` trace through it as one opaque node (no graph break,
symbolic sizes), and the differentiable ones have their autograd registered on the op, with
backward passes made of these same ops (so a compiled backward traces too). What tracing must
not see stays inside the ops: the loader (file reads, ``dlopen``), the output cache (``mmap``,
finalisers) and the dropout seed's conversion to an int.

Ops (``[b, n, h, f]`` rows, ``[b, n, h, c]`` bands; ``dilation`` an integer tensor of one value per
head, :func:`dilation_argument`, its values checked by each op as it runs; arguments
already checked by the public functions in :mod:`longformer_ops.ops.diagonaled` and
:mod:`longformer_ops.ops.attention`):

- ``band_qk(q, k, w, dilation, autoregressive, padding) -> band``: Q.K^T on the band;
- ``band_pv(band, v, w, dilation, autoregressive) -> rows``: probs.V;
- ``band_transposed(band, x, w, dilation, autoregressive) -> rows``: the backward's P^T.dO;
- ``attention(q, k, v, key_padding_mask, seed, w, dilation, autoregressive, scale, dropout_p,
  softcap=0.0) -> (out, lse)`` and ``attention_backward(...)``: the fused local attention (CPU
  and CUDA libraries; k and v may have fewer heads, dividing q's);
- ``band_softmax_(band, key_padding_mask, w, dilation, autoregressive) -> lse`` (in place) and
  ``band_softmax_backward(...)``: the band softmax of the unfused path (CPU libraries), whose
  autograd is :class:`BandSoftmax` (an op that mutates cannot carry its own);
- ``dropout(x, seed, p) -> out``: hidden-state dropout with the fused kernels' counter-based mask
  (CPU libraries), its backward the same op on the gradient;
- ``bias_dropout_add(h, bias, residual, seed, p) -> out``: ``dropout(h + bias) + residual`` with
  the same mask, a block's dense output on its way into the residual's layer norm (CPU
  libraries), ``bias_dropout_add_`` in place into ``h``; its backward ``dropout_column_sums(grad,
  seed, p) -> (dropout(grad), its column sums)`` (the bias's gradient in the same pass);
- ``bias_gelu(h, bias) -> out``: ``gelu(h + bias)`` (exact GELU) over the last dimension, the
  FFN's activation after a bias-free GEMM (CPU libraries); its backward ``bias_gelu_backward``
  (both gradients: the bias's summed in the same pass);
  ``bias_gelu_(h, bias)`` the same in place, for inference;
- ``global_merge(context, a, omega, values) -> out``: the layer's merge of global keys into the band's
  attention, ``a context + sum_g omega_g values_g`` (CPU libraries), ``global_merge_`` in place;
  ``global_merge_backward(grad, context, values, a) -> (grad a, <grad, context>, <grad, values_g>)``;
  their autograd is the layer's ``_GlobalKeyMerge``;
- ``layer_norm(x, weight, bias, eps) -> (out, mean, rstd)``: layer normalisation over the last
  dimension (CPU libraries); its backward ``layer_norm_backward(grad, x, weight, mean, rstd) ->
  (grad x, grad weight, grad bias)`` in one pass;
- ``few_rows_mm(a, b) -> a @ b`` and ``few_rows_mm_nt(a, bt) -> a @ bt^T`` of ``[batch, rows, inner]``
  ``a`` of a few rows (a generation step's attention products over its key/value cache, half types
  widened in registers; CPU libraries); inference only, no autograd;
- ``*_out`` variants of each forward op write into a given ``out`` (``mutates_args=("out",)``;
  not differentiable, as custom ops that mutate cannot have autograd).

Each op impl is one Python function for every device: it asks the loader for the library of the
tensors' (device, dtype), pads head_dim to the library's multiple, and calls the kernel.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch import Tensor

from longformer_ops.runtime.band import band_width, fill_invalid_locations_
from longformer_ops.runtime.checks import check_dilation
from longformer_ops.runtime.loader import KernelNotAvailableError, library_for
from longformer_ops.runtime.manifest import KERNEL_FAMILIES, function_name, function_names
from longformer_ops.runtime.output_cache import new_output

NAMESPACE = "longformer_ops"
# The libraries' op names, from the one table of kernel families (runtime/manifest.py).
FUSED, FUSED_BACKWARD = KERNEL_FAMILIES["attention"].ops
BAND_SOFTMAX, BAND_SOFTMAX_BACKWARD = KERNEL_FAMILIES["band_softmax"].ops
(DROPOUT,) = KERNEL_FAMILIES["dropout"].ops
BIAS_DROPOUT_ADD, DROPOUT_COLUMN_SUMS = KERNEL_FAMILIES["bias_dropout_add"].ops
BIAS_GELU, BIAS_GELU_BACKWARD = KERNEL_FAMILIES["bias_gelu"].ops
GLOBAL_MERGE, GLOBAL_MERGE_BACKWARD = KERNEL_FAMILIES["global_merge"].ops
LAYER_NORM, LAYER_NORM_BACKWARD = KERNEL_FAMILIES["layer_norm"].ops
FEW_ROWS_MM, FEW_ROWS_MM_NT = KERNEL_FAMILIES["few_row_products"].ops


# ----------------------------------------------------------------------------- op registration
_library_fragment = torch.library.Library(NAMESPACE, "FRAGMENT")


def _custom_op(name: str, mutates_args: tuple[str, ...]):
    """``torch.library.custom_op`` by its parts (``define`` and ``impl``, the schema inferred from the
    function's annotations), returning the ``OpOverload``: custom_op wraps each implementation in
    ``torch._disable_dynamo``, which imports ``torch._dynamo`` (about 1 s) at the first kernel call of
    every process, compiling or not. Dynamo never traces the implementation: under ``torch.compile``
    the op is one node of the graph and runs from the compiled code, as custom_op's does. As custom_op
    does, an op that writes into an argument bumps that tensor's version counter (autograd's check that
    a tensor saved for a backward was not modified since)."""

    def register(fn):
        _library_fragment.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        torch.library.impl(f"{NAMESPACE}::{name}", "CompositeExplicitAutograd", fn, lib=_library_fragment)
        op = getattr(getattr(torch.ops, NAMESPACE), name).default
        if mutates_args:
            names = [argument.name for argument in op._schema.arguments]

            def bump_versions(keyset, *args, **kwargs):
                given = dict(zip(names, args)) | kwargs
                for argument in mutates_args:
                    torch.autograd.graph.increment_version(given[argument])
                return op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs)

            _library_fragment.impl(name, bump_versions, "ADInplaceOrView", with_keyset=True)
        return op

    return register


# ----------------------------------------------------------------------------- helpers (eager only)
def _library(x: Tensor):
    return library_for(x.device, str(x.dtype).removeprefix("torch."))


def _pad_features(x: Tensor, multiple: int) -> Tensor:
    """Zero features up to a multiple of ``multiple``: they change no dot product."""
    extra = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


def _fused_input(x: Tensor, multiple: int) -> Tensor:
    """``x`` as the fused kernels read it: features zero-padded to ``multiple``, contiguous, and its
    data 16-byte aligned (the CUDA kernels stage 16 bytes per load; a contiguous view may start
    anywhere in its storage, and is then copied)."""
    x = _pad_features(x, multiple).contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


@functools.lru_cache(maxsize=256)
def _dilation_tensor(dilation: tuple[int, ...], device: torch.device) -> Tensor:
    # Cached so that a layer called every step does not copy its dilations to the GPU each time.
    return torch.tensor(dilation, dtype=torch.int32, device=device)


def dilation_argument(dilations: tuple[int, ...] | Tensor) -> Tensor:
    """The ops' ``dilation`` argument, one integer per head, from checked values (a tuple: a cached
    int32 CPU tensor, or a constant of the graph under ``torch.compile``) or, under ``torch.compile``,
    the caller's own tensor (:func:`longformer_ops.runtime.checks.check_dilation`), whose values the ops check
    when they run: so a dilation tensor compiles into the graph with no break."""
    if isinstance(dilations, Tensor):
        return dilations
    # (Under a FakeTensorMode, outside compilation too, the ops accept none of its real tensors.)
    if torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return torch.tensor(dilations, dtype=torch.int32)
    return _dilation_tensor(tuple(dilations), torch.device("cpu"))


def reachable_window(w: int, dilations: tuple[int, ...], n: int) -> int:
    """The narrowest window with the same keys: offsets past (n - 1) // min(d) reach no key of any
    head, and the kernels' scratch grows with w (w = 10^8 at n = 20 had asked for gigabytes). The
    dropout mask is that of this window's band columns."""
    return min(w, max(n - 1, 0) // min(dilations)) if dilations else w


def _on_device(x: Tensor):
    """Kernels launch on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' accumulation dtype (and the log-sum-exp's): float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def has_family(device_type: str, dtype: torch.dtype, family: str) -> bool:
    """Whether the library for (device, dtype) has every op of kernel family ``family`` (a key of
    ``KERNEL_FAMILIES``; band ops symmetric and causal). Where no library serves (device, dtype), a
    family with a torch fallback answers False and the others raise the loader's error."""
    try:
        library = library_for(torch.device(device_type), str(dtype).removeprefix("torch."))
    except KernelNotAvailableError:
        if KERNEL_FAMILIES[family].torch_fallback:
            return False
        raise
    return all(library.has(function) for op in KERNEL_FAMILIES[family].ops for function in function_names(op))


def _constant_under_compilation(fn):
    """``torch.compiler.assume_constant_result(fn)`` without its import of ``torch._dynamo`` (0.9 s,
    which every script importing this package would pay, compiling or not): the same mark on ``fn``,
    which Dynamo reads when it traces a call (tests/test_compile.py checks it is the decorator's).
    Dynamo must not trace the loader (file reads, dlopen): it calls ``fn`` once, eagerly, and keeps
    the answer."""
    fn._dynamo_marked_constant = True
    return fn


_family_decision = _constant_under_compilation(has_family)


def available(family: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether kernel family ``family`` serves (device, dtype): :func:`has_family`, decided once per
    (device type, dtype, family) while ``torch.compile`` traces, its answer part of the graph."""
    if family not in KERNEL_FAMILIES:
        raise ValueError(f"family must be one of {list(KERNEL_FAMILIES)}, got {family!r}")
    if torch.compiler.is_compiling():
        return _family_decision(device.type, dtype, family)
    return has_family(device.type, dtype, family)


MIN_QUERIES_PER_RUN = 256


@functools.lru_cache(maxsize=256)  # per call otherwise: up to n / 513 candidates tried each time
def query_runs(batch_heads: int, n: int, w: int, threads: int) -> int:
    """How many runs of consecutive queries the CPU kernels split each (batch, head) into, so that
    batch x heads x runs tasks spread evenly over ``threads`` (their parallel loop gives each thread
    one contiguous share: 12 heads on 8 threads left 2 of them idle): the fewest runs with the least
    work on the busiest thread, each run at least ``MIN_QUERIES_PER_RUN`` and 2w + 1 queries long
    (the kernels' own minimum)."""
    if batch_heads <= 0 or threads <= 1:
        return 1
    most = max(1, n // max(MIN_QUERIES_PER_RUN, 2 * w + 1))
    # A thread's work in heads' worth: ceil(tasks / threads) tasks of 1/runs of a head each.
    return min(range(1, most + 1), key=lambda runs: -(-batch_heads * runs // threads) / runs)


def repeat_heads(x: Tensor, heads: int) -> Tensor:
    """``[b, n, h_kv, f]`` -> ``[b, n, heads, f]``, each key/value head repeated for its group of
    ``heads // h_kv`` query heads (query head ``i`` reads ``i // group``, as transformers' ``repeat_kv``):
    for the band products, which take equal heads (the fused kernels read grouped heads as they lie)."""
    b, n, kv_heads, f = x.shape
    if kv_heads == heads:
        return x
    return x[:, :, :, None, :].expand(b, n, kv_heads, heads // kv_heads, f).reshape(b, n, heads, f)


def _check_key_heads(q: Tensor, k: Tensor, v: Tensor) -> None:
    """The fused ops' k and v: q's batch, length and features, and key/value heads dividing q's heads
    (a kernel would read past k's heads otherwise)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    if not (
        v.shape == k.shape
        and k.shape[:2] == q.shape[:2]
        and k.shape[3] == q.shape[3]
        and kv_heads > 0
        and heads % kv_heads == 0
    ):
        raise ValueError(
            f"k and v must be [batch, seq_len, kv_heads, head_dim] with q's batch, seq_len and head_dim "
            f"{(q.shape[0], q.shape[1], q.shape[3])} and kv_heads dividing q's {heads} heads, "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )


def _cpu_runs(x: Tensor, w: int) -> tuple:
    """The CPU kernels' last argument (:func:`query_runs` for torch's thread count); none on CUDA."""
    if x.device.type != "cpu":
        return ()
    return (query_runs(x.shape[0] * x.shape[2], x.shape[1], w, torch.get_num_threads()),)


def _band_kernel(
    op: str, t1: Tensor, t2: Tensor, w: int, dilation: Tensor, autoregressive: bool, padding: float, out: Tensor
) -> Tensor:
    """One banded product into ``out``: 'qk' (t1, t2 rows), 'pv' or 'transposed' (t1 the band)."""
    b, n, h, f = t2.shape
    dilation = check_dilation(dilation, h)
    if b * n * h == 0 or (op != "qk" and f == 0):  # the output is empty (or all zero: no features)
        return out.zero_()
    if op == "qk" and f == 0:  # empty dot products: 0 where the key is valid
        return fill_invalid_locations_(out.zero_(), w, dilation, autoregressive, padding)
    library = _library(t2)
    kernel = library.function(function_name(op, autoregressive))
    dilation_tensor = _dilation_tensor(dilation, t2.device)
    t1, t2 = t1.contiguous(), _pad_features(t2.contiguous(), library.feature_multiple)
    runs = _cpu_runs(t2, w)
    with _on_device(t2):
        if op == "qk":
            kernel(_pad_features(t1, library.feature_multiple), t2, dilation_tensor, float(padding), out, *runs)
        elif t2.shape[-1] == f:
            kernel(t1, t2, dilation_tensor, out, *runs)
        else:  # head_dim padded for the kernel: its output has the padded width
            padded_out = new_output(t2, t2.shape)
            kernel(t1, t2, dilation_tensor, padded_out, *runs)
            out.copy_(padded_out[..., :f])
    return out


def _band_shape(rows: Tensor, w: int, autoregressive: bool) -> tuple[int, ...]:
    return (*rows.shape[:3], band_width(w, autoregressive))


# ----------------------------------------------------------------------------- band products
@_custom_op("band_qk", mutates_args=())
def band_qk(q: Tensor, k: Tensor, w: int, dilation: Tensor, autoregressive: bool, padding: float) -> Tensor:
    """Scores ``[b, n, h, c]``: ``q . k`` of each query with the keys of its band; ``padding`` where invalid."""
    out = new_output(k, _band_shape(k, w, autoregressive))
    return _band_kernel("qk", q, k, w, dilation, autoregressive, padding, out)


@_custom_op("band_pv", mutates_args=())
def band_pv(band: Tensor, v: Tensor, w: int, dilation: Tensor, autoregressive: bool) -> Tensor:
    """Rows ``[b, n, h, f]``: each query's band weights times the values of its keys (valid keys only)."""
    return _band_kernel("pv", band, v, w, dilation, autoregressive, 0.0, new_output(v, v.shape))


@_custom_op("band_transposed", mutates_args=())
def band_transposed(band: Tensor, x: Tensor, w: int, dilation: Tensor, autoregressive: bool) -> Tensor:
    """Rows ``[b, n, h, f]``: ``out[p] = sum of band[i, j] * x[i]`` over the (i, j) whose key is p."""
    return _band_kernel("transposed", band, x, w, dilation, autoregressive, 0.0, new_output(x, x.shape))


@_custom_op("band_qk_out", mutates_args=("out",))
def band_qk_out(
    q: Tensor, k: Tensor, w: int, dilation: Tensor, autoregressive: bool, padding: float, out: Tensor
) -> None:
    _band_kernel("qk", q, k, w, dilation, autoregressive, padding, out)


@_custom_op("band_pv_out", mutates_args=("out",))
def band_pv_out(band: Tensor, v: Tensor, w: int, dilation: Tensor, autoregressive: bool, out: Tensor) -> None:
    _band_kernel("pv", band, v, w, dilation, autoregressive, 0.0, out)


@_custom_op("band_transposed_out", mutates_args=("out",))
def band_transposed_out(band: Tensor, x: Tensor, w: int, dilation: Tensor, autoregressive: bool, out: Tensor) -> None:
    _band_kernel("transposed", band, x, w, dilation, autoregressive, 0.0, out)


@torch.library.register_fake(band_qk)
def _(q, k, w, dilation, autoregressive, padding):
    return k.new_empty(_band_shape(k, w, autoregressive))


@torch.library.register_fake(band_pv)
def _(band, v, w, dilation, autoregressive):
    return v.new_empty(v.shape)


@torch.library.register_fake(band_transposed)
def _(band, x, w, dilation, autoregressive):
    return x.new_empty(x.shape)


for _out_op in (band_qk_out, band_pv_out, band_transposed_out):
    torch.library.register_fake(_out_op)(lambda *args: None)


# Autograd. S = qk(Q, K): dQ = pv(dS, K), dK = transposed(dS, Q).
#           O = pv(P, V): dP = qk(dO, V) (0 at invalid positions), dV = transposed(P, dO).
#           R = transposed(P, X): dP = qk(X, dR) (0 at invalid positions), dX = pv(P, dR).
# Made of the ops themselves, so they are differentiable again (double backward) and traceable.
def _save_band_inputs(ctx, inputs, output):
    t1, t2, w, dilation, autoregressive = inputs[:5]
    ctx.save_for_backward(t1, t2, dilation)
    ctx.band_config = (w, autoregressive)


def _band_qk_backward(ctx, grad):
    q, k, dilation = ctx.saved_tensors
    w, autoregressive = ctx.band_config
    grad = grad.contiguous()
    grad_q = band_pv(grad, k, w, dilation, autoregressive) if ctx.needs_input_grad[0] else None
    grad_k = band_transposed(grad, q, w, dilation, autoregressive) if ctx.needs_input_grad[1] else None
    return grad_q, grad_k, None, None, None, None


def _band_pv_backward(ctx, grad):
    band, v, dilation = ctx.saved_tensors
    w, autoregressive = ctx.band_config
    grad = grad.contiguous()
    grad_band = band_qk(grad, v, w, dilation, autoregressive, 0.0) if ctx.needs_input_grad[0] else None
    grad_v = band_transposed(band, grad, w, dilation, autoregressive) if ctx.needs_input_grad[1] else None
    return grad_band, grad_v, None, None, None


def _band_transposed_backward(ctx, grad):
    band, x, dilation = ctx.saved_tensors
    w, autoregressive = ctx.band_config
    grad = grad.contiguous()
    grad_band = band_qk(x, grad, w, dilation, autoregressive, 0.0) if ctx.needs_input_grad[0] else None
    grad_x = band_pv(band, grad, w, dilation, autoregressive) if ctx.needs_input_grad[1] else None
    return grad_band, grad_x, None, None, None


torch.library.register_autograd(band_qk, _band_qk_backward, setup_context=_save_band_inputs)
torch.library.register_autograd(band_transposed, _band_transposed_backward, setup_context=_save_band_inputs)
torch.library.register_autograd(band_pv, _band_pv_backward, setup_context=_save_band_inputs)


# ----------------------------------------------------------------------------- fused local attention
def _key_bias(key_padding_mask: Optional[Tensor], q: Tensor) -> Tensor:
    """The fused kernels' additive score bias per key, ``[b, n]`` in the accumulation dtype: -inf at masked keys."""
    bias = torch.zeros(q.shape[:2], dtype=accumulation_dtype(q.dtype), device=q.device)
    return bias if key_padding_mask is None else bias.masked_fill_(key_padding_mask, float("-inf"))


def _attention_kernel(q, k, v, key_padding_mask, seed, w, dilation, autoregressive, scale, dropout_p, out, softcap=0.0):
    """The forward kernel into ``out`` (``[b, n, h, f]``); returns the rows' log-sum-exp."""
    lse = q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))
    _check_key_heads(q, k, v)
    dilation = check_dilation(dilation, q.shape[2])
    w = reachable_window(w, dilation, q.shape[1])
    if lse.numel() == 0:
        return lse
    library = _library(q)
    f = q.shape[-1]
    # Zero features change no score and give zero output columns, dropped below.
    q, k, v = (_fused_input(x, library.feature_multiple) for x in (q, k, v))
    kernel_out = out if q.shape[-1] == f else new_output(q, q.shape)
    library.function(function_name(FUSED, autoregressive))(
        q,
        k,
        v,
        _key_bias(key_padding_mask, q),
        _dilation_tensor(dilation, q.device),
        w,
        scale,
        softcap,
        dropout_p,
        int(seed),
        kernel_out,
        lse,
        *_cpu_runs(q, w),
    )
    if kernel_out is not out:
        out.copy_(kernel_out[..., :f])
    return lse


@_custom_op("attention", mutates_args=())
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
    seed: Tensor,
    w: int,
    dilation: Tensor,
    autoregressive: bool,
    scale: float,
    dropout_p: float,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Fused local attention: ``(out [b, n, h, f], lse [b, n, h])``. ``seed`` (an int64 scalar tensor)
    seeds the dropout mask, which the backward regenerates from it: its low 32 bits the mask, its
    high 32 bits an offset added to every row (a shard's first row in the whole sequence).
    ``softcap`` > 0: each score s becomes ``softcap * tanh(s / softcap)`` before the softmax (0: none)."""
    out = new_output(q, q.shape)
    return out, _attention_kernel(
        q, k, v, key_padding_mask, seed, w, dilation, autoregressive, scale, dropout_p, out, softcap
    )


@_custom_op("attention_out", mutates_args=("out",))
def attention_out(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
    seed: Tensor,
    w: int,
    dilation: Tensor,
    autoregressive: bool,
    scale: float,
    dropout_p: float,
    out: Tensor,
    softcap: float = 0.0,
) -> Tensor:
    """:func:`attention` into ``out``; returns the log-sum-exp."""
    return _attention_kernel(
        q, k, v, key_padding_mask, seed, w, dilation, autoregressive, scale, dropout_p, out, softcap
    )


@_custom_op("attention_backward", mutates_args=())
def attention_backward(
    grad: Tensor,
    grad_lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
    seed: Tensor,
    out: Tensor,
    lse: Tensor,
    w: int,
    dilation: Tensor,
    autoregressive: bool,
    scale: float,
    dropout_p: float,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV)`` (shaped as q, k and v: grouped key/value heads get their query heads' sums) in
    one kernel, FlashAttention-style: per tile it recomputes the scores and
    P = exp(score - lse), then dP = dO . V^T, dS = P * (dP - delta), dQ = scale * dS . K, and
    accumulates dV += P^T dO and dK += scale * dS^T Q; no band is kept between the passes or made
    in either. delta is rowsum(dO * O) less the log-sum-exp's own gradient (d lse / d score = P, so
    it joins dS there), computed per tile in the kernel. With dropout (mask Z regenerated from the
    seed) dP = (dO . V^T) * Z and dV += (P * Z)^T dO. With a ``softcap``, P comes from the capped
    scores and dS is multiplied by the cap's derivative before dQ and dK."""
    _check_key_heads(q, k, v)
    dilation = check_dilation(dilation, q.shape[2])
    w = reachable_window(w, dilation, q.shape[1])
    if lse.numel() == 0:
        return new_output(q, q.shape), new_output(k, k.shape), new_output(v, v.shape)
    library = _library(q)
    f = q.shape[-1]
    padded = [_fused_input(x, library.feature_multiple) for x in (grad, q, k, v, out)]
    grads = tuple(new_output(padded[1], padded[1].shape) for _ in range(3))  # (dK, dV per query head)
    grad, q, k, v, out = padded
    library.function(function_name(FUSED_BACKWARD, autoregressive))(
        grad,
        q,
        k,
        v,
        _key_bias(key_padding_mask, q),
        out,
        lse,
        grad_lse.contiguous(),
        _dilation_tensor(dilation, q.device),
        w,
        scale,
        softcap,
        dropout_p,
        int(seed),
        *grads,
        *_cpu_runs(q, w),
    )
    grad_q, grad_k, grad_v = (g[..., :f] for g in grads)
    if k.shape[2] != q.shape[2]:  # grouped key/value heads: each sums its query heads' gradients
        b, n, kv_heads = k.shape[:3]
        grad_k, grad_v = (g.reshape(b, n, kv_heads, q.shape[2] // kv_heads, f).sum(3) for g in (grad_k, grad_v))
    return tuple(g.contiguous() for g in (grad_q, grad_k, grad_v))


@torch.library.register_fake(attention)
def _(q, k, v, key_padding_mask, seed, w, dilation, autoregressive, scale, dropout_p, softcap=0.0):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))


@torch.library.register_fake(attention_out)
def _(q, k, v, key_padding_mask, seed, w, dilation, autoregressive, scale, dropout_p, out, softcap=0.0):
    return q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))


@torch.library.register_fake(attention_backward)
def _(
    grad,
    grad_lse,
    q,
    k,
    v,
    key_padding_mask,
    seed,
    out,
    lse,
    w,
    dilation,
    autoregressive,
    scale,
    dropout_p,
    softcap=0.0,
):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_attention(ctx, inputs, output):
    q, k, v, key_padding_mask, seed, w, dilation, *config = inputs
    ctx.save_for_backward(q, k, v, key_padding_mask, seed, dilation, *output)
    ctx.attention_config = (w, *config)


def _attention_backward(ctx, grad, grad_lse):
    q, k, v, key_padding_mask, seed, dilation, out, lse = ctx.saved_tensors
    w, *config = ctx.attention_config
    grad_q, grad_k, grad_v = attention_backward(
        grad, grad_lse, q, k, v, key_padding_mask, seed, out, lse, w, dilation, *config
    )
    needs = ctx.needs_input_grad
    return (
        grad_q if needs[0] else None,
        grad_k if needs[1] else None,
        grad_v if needs[2] else None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


torch.library.register_autograd(attention, _attention_backward, setup_context=_save_attention)


# ----------------------------------------------------------------------------- band softmax
@_custom_op("band_softmax_", mutates_args=("band",))
def band_softmax_(
    band: Tensor, key_padding_mask: Optional[Tensor], w: int, dilation: Tensor, autoregressive: bool
) -> Tensor:
    """In place: ``band`` (contiguous) becomes the softmax of each row over its valid keys (keys of
    ``key_padding_mask`` removed; 0 at removed and invalid keys, a row with none left all 0). Returns
    each row's log-sum-exp ``[b, n, h]`` in the accumulation dtype (-inf for a row with no key)."""
    lse = band.new_empty(band.shape[:3], dtype=accumulation_dtype(band.dtype))
    if lse.numel() == 0:
        return lse
    kernel = _library(band).function(function_name(BAND_SOFTMAX, autoregressive))
    with _on_device(band):
        kernel(
            band,
            _key_bias(key_padding_mask, band),
            int(key_padding_mask is not None),
            _dilation_tensor(check_dilation(dilation, band.shape[2]), band.device),
            lse,
        )
    return lse


@_custom_op("band_softmax_backward", mutates_args=())
def band_softmax_backward(
    probs: Tensor, grad: Tensor, grad_lse: Tensor, w: int, dilation: Tensor, autoregressive: bool
) -> Tensor:
    """The scores' gradient ``P * (dP - rowsum(dP * P) + dlse)`` at valid keys, 0 elsewhere."""
    out = new_output(probs, probs.shape)
    if out.numel() == 0:
        return out
    kernel = _library(probs).function(function_name(BAND_SOFTMAX_BACKWARD, autoregressive))
    with _on_device(probs):
        kernel(
            probs,
            grad.contiguous(),
            grad_lse.contiguous(),
            _dilation_tensor(check_dilation(dilation, probs.shape[2]), probs.device),
            out,
        )
    return out


@torch.library.register_fake(band_softmax_)
def _(band, key_padding_mask, w, dilation, autoregressive):
    return band.new_empty(band.shape[:3], dtype=accumulation_dtype(band.dtype))


@torch.library.register_fake(band_softmax_backward)
def _(probs, grad, grad_lse, w, dilation, autoregressive):
    return probs.new_empty(probs.shape)


class BandSoftmax(torch.autograd.Function):
    """Autograd of the in-place :func:`band_softmax_` (an op that mutates cannot carry its own):
    ``apply(scores, key_padding_mask, w, dilation, autoregressive) -> (scores, lse)``, ``scores``
    overwritten by the probabilities, which are all the backward keeps (no second band).
    Differentiable once."""

    @staticmethod
    def forward(ctx, scores, key_padding_mask, w, dilation, autoregressive):
        lse = torch.ops.longformer_ops.band_softmax_(scores, key_padding_mask, w, dilation, autoregressive)
        ctx.mark_dirty(scores)
        ctx.save_for_backward(scores, dilation)
        ctx.band_config = (w, autoregressive)
        return scores, lse

    @staticmethod
    def backward(ctx, grad, grad_lse):
        probs, dilation = ctx.saved_tensors
        w, autoregressive = ctx.band_config
        grad_scores = torch.ops.longformer_ops.band_softmax_backward(probs, grad, grad_lse, w, dilation, autoregressive)
        return grad_scores, None, None, None, None


# ----------------------------------------------------------------------------- hidden dropout
@_custom_op("dropout", mutates_args=())
def dropout(x: Tensor, seed: Tensor, p: float) -> Tensor:
    """``x`` times a factor per element, ``1 / (1 - p)`` (kept) or 0 (dropped), from the fused
    attention's counter-based generator: ``x`` viewed as ``[rows, x.shape[-1]]``, element (r, c)
    is kept as band column c of query row r of batch-head 0 would be (``seed`` an int64 scalar
    tensor; ``reference.dropout_factor_reference``). A function of (seed, r, c): the backward
    applies the same factors to the gradient, from the seed, with no mask kept."""
    out = new_output(x, x.shape)
    if out.numel() == 0:
        return out
    columns = x.shape[-1] if x.dim() else 1
    with _on_device(x):
        _library(x).function(DROPOUT)(x.contiguous().view(-1, columns), float(p), int(seed), out.view(-1, columns))
    return out


@torch.library.register_fake(dropout)
def _(x, seed, p):
    return x.new_empty(x.shape)


def _save_dropout(ctx, inputs, output):
    _, seed, p = inputs
    ctx.save_for_backward(seed)
    ctx.p = p


def _dropout_backward(ctx, grad):
    (seed,) = ctx.saved_tensors
    return dropout(grad, seed, ctx.p), None, None


torch.library.register_autograd(dropout, _dropout_backward, setup_context=_save_dropout)


@_custom_op("bias_dropout_add", mutates_args=())
def bias_dropout_add(h: Tensor, bias: Tensor, residual: Tensor, seed: Tensor, p: float) -> Tensor:
    """``dropout(h + bias, seed, p) + residual`` (:func:`dropout`'s mask for ``h`` of that shape),
    ``bias`` ``[h.shape[-1]]`` broadcast over the rows, ``residual`` of ``h``'s shape; in the
    accumulation dtype, rounded once."""
    out = new_output(h, h.shape)
    if out.numel() == 0:
        return out
    with _on_device(h):
        _library(h).function(BIAS_DROPOUT_ADD)(
            _rows(h), bias.contiguous(), _rows(residual), float(p), int(seed), out.view(-1, h.shape[-1])
        )
    return out


@torch.library.register_fake(bias_dropout_add)
def _(h, bias, residual, seed, p):
    return h.new_empty(h.shape)


@_custom_op("bias_dropout_add_", mutates_args=("h",))
def bias_dropout_add_(h: Tensor, bias: Tensor, residual: Tensor, seed: Tensor, p: float) -> None:
    """:func:`bias_dropout_add` in place, into ``h`` (contiguous); not differentiable."""
    _check_contiguous("h", h)
    if h.numel():
        with _on_device(h):
            _library(h).function(BIAS_DROPOUT_ADD)(
                h.view(-1, h.shape[-1]),
                bias.contiguous(),
                _rows(residual),
                float(p),
                int(seed),
                h.view(-1, h.shape[-1]),
            )


@torch.library.register_fake(bias_dropout_add_)
def _(h, bias, residual, seed, p):
    return None


# Row chunks of the kernels that sum columns on the way (dropout_column_sums, bias_gelu_backward),
# each a thread's at a time with its sums in L1: enough to share among many cores, few enough that
# summing the chunks' sums after costs nothing.
_SUM_CHUNKS = 64


def _chunk_sums(x: Tensor) -> Tensor:
    """The per-chunk column sums those kernels write, for ``x`` (not empty) as ``[rows, x.shape[-1]]``."""
    rows = x.numel() // x.shape[-1]
    return torch.empty(min(rows, _SUM_CHUNKS), x.shape[-1], dtype=accumulation_dtype(x.dtype), device=x.device)


@_custom_op("dropout_column_sums", mutates_args=())
def dropout_column_sums(x: Tensor, seed: Tensor, p: float) -> tuple[Tensor, Tensor]:
    """``(dropout(x, seed, p), its sums over all but the last dimension)``, the sums of the rounded
    elements in the accumulation dtype, rounded once to ``x``'s: the backward of
    :func:`bias_dropout_add` (the gradient of ``h`` and of the bias) in one pass."""
    out = new_output(x, x.shape)
    if out.numel() == 0:
        return out, x.new_zeros(x.shape[-1])
    sums = _chunk_sums(x)
    with _on_device(x):
        _library(x).function(DROPOUT_COLUMN_SUMS)(_rows(x), float(p), int(seed), out.view(-1, x.shape[-1]), sums)
    return out, sums.sum(0).to(x.dtype)


@torch.library.register_fake(dropout_column_sums)
def _(x, seed, p):
    return x.new_empty(x.shape), x.new_empty(x.shape[-1:])


def _save_bias_dropout_add(ctx, inputs, output):
    _, _, _, seed, p = inputs
    ctx.save_for_backward(seed)
    ctx.p = p


def _bias_dropout_add_autograd(ctx, grad):
    (seed,) = ctx.saved_tensors
    if ctx.needs_input_grad[1]:
        grad_h, grad_bias = dropout_column_sums(grad, seed, ctx.p)
    else:
        grad_h, grad_bias = dropout(grad, seed, ctx.p), None
    return grad_h, grad_bias, grad if ctx.needs_input_grad[2] else None, None, None


torch.library.register_autograd(bias_dropout_add, _bias_dropout_add_autograd, setup_context=_save_bias_dropout_add)


# ----------------------------------------------------------------------------- the FFN's bias and GELU
def _check_contiguous(name: str, x: Tensor) -> None:
    """The in-place ops write through the tensor's own memory as one block."""
    if not x.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous to be written in place, got strides {x.stride()} for shape {tuple(x.shape)}"
        )


def _rows(x: Tensor) -> Tensor:
    """``x`` (contiguous) as ``[rows, x.shape[-1]]``."""
    return x.contiguous().view(-1, x.shape[-1])


@_custom_op("bias_gelu", mutates_args=())
def bias_gelu(h: Tensor, bias: Tensor) -> Tensor:
    """``gelu(h + bias)``, the exact GELU, ``bias`` ``[h.shape[-1]]`` broadcast over the rows; the
    sum and the GELU in the accumulation dtype, rounded once."""
    out = new_output(h, h.shape)
    if out.numel() == 0:
        return out
    with _on_device(h):
        _library(h).function(BIAS_GELU)(_rows(h), bias.contiguous(), out.view(-1, h.shape[-1]))
    return out


@torch.library.register_fake(bias_gelu)
def _(h, bias):
    return h.new_empty(h.shape)


@_custom_op("bias_gelu_", mutates_args=("h",))
def bias_gelu_(h: Tensor, bias: Tensor) -> None:
    """:func:`bias_gelu` in place, into ``h`` (contiguous); not differentiable."""
    _check_contiguous("h", h)
    if h.numel():
        with _on_device(h):
            _library(h).function(BIAS_GELU)(h.view(-1, h.shape[-1]), bias.contiguous(), h.view(-1, h.shape[-1]))


@torch.library.register_fake(bias_gelu_)
def _(h, bias):
    return None


@_custom_op("bias_gelu_backward", mutates_args=())
def bias_gelu_backward(grad: Tensor, h: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`bias_gelu`: ``grad * gelu'(h + bias)`` for ``h`` and its sums over
    all but the last dimension for ``bias`` (of the rounded elements, in the accumulation dtype,
    rounded once), in one pass."""
    grad_h = new_output(h, h.shape)
    if grad_h.numel() == 0:
        return grad_h, h.new_zeros(h.shape[-1])
    sums = _chunk_sums(h)
    with _on_device(h):
        _library(h).function(BIAS_GELU_BACKWARD)(
            _rows(grad), _rows(h), bias.contiguous(), grad_h.view(-1, h.shape[-1]), sums
        )
    return grad_h, sums.sum(0).to(h.dtype)


@torch.library.register_fake(bias_gelu_backward)
def _(grad, h, bias):
    return h.new_empty(h.shape), h.new_empty(h.shape[-1:])


def _save_bias_gelu(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _bias_gelu_autograd(ctx, grad):
    h, bias = ctx.saved_tensors
    grad_h, grad_bias = bias_gelu_backward(grad, h, bias)
    return grad_h, grad_bias if ctx.needs_input_grad[1] else None


torch.library.register_autograd(bias_gelu, _bias_gelu_autograd, setup_context=_save_bias_gelu)


# ----------------------------------------------------------------------------- the layer's global-key merge
def _slots(x: Tensor) -> Tensor:
    """A global-slot operand (``omega``, ``values``, ``t``) contiguous, and where it has no elements (no
    global tokens) with the row-major strides TVM checks its arguments against, which torch does not
    give it (``[1, 5, 2, 0]``: torch's strides ``(10, 2, 1, 1)``, TVM's ``(0, 0, 0, 1)``)."""
    x = x.contiguous()
    if x.numel():
        return x
    strides, step = [], 1
    for size in reversed(x.shape):
        strides.insert(0, step)
        step *= size
    return x.as_strided(x.shape, strides)


@_custom_op("global_merge", mutates_args=())
def global_merge(context: Tensor, a: Tensor, omega: Tensor, values: Tensor) -> Tensor:
    """``a[..., None] context + sum_g omega[..., g, None] values[:, g]`` over ``context [b, n, h, d]``,
    ``a [b, n, h]``, ``omega [b, n, h, g]`` (both in the accumulation dtype) and ``values [b, g, h, d]``;
    in the accumulation dtype, rounded once to ``context``'s."""
    out = new_output(context, context.shape)
    if out.numel():
        with _on_device(context):
            _library(context).function(GLOBAL_MERGE)(
                context.contiguous(), a.contiguous(), _slots(omega), _slots(values), out
            )
    return out


@torch.library.register_fake(global_merge)
def _(context, a, omega, values):
    return context.new_empty(context.shape)


@_custom_op("global_merge_", mutates_args=("context",))
def global_merge_(context: Tensor, a: Tensor, omega: Tensor, values: Tensor) -> None:
    """:func:`global_merge` in place, into ``context`` (contiguous); not differentiable."""
    _check_contiguous("context", context)
    if context.numel():
        with _on_device(context):
            _library(context).function(GLOBAL_MERGE)(context, a.contiguous(), _slots(omega), _slots(values), context)


@torch.library.register_fake(global_merge_)
def _(context, a, omega, values):
    return None


@_custom_op("global_merge_backward", mutates_args=())
def global_merge_backward(grad: Tensor, context: Tensor, values: Tensor, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For :func:`global_merge`'s output gradient ``grad``: ``grad a`` (``context``'s dtype), and in
    ``a``'s dtype ``u [b, n, h] = <grad, context>`` and ``t [b, n, h, g] = <grad, values_g>`` over the
    features (products and sums in ``a``'s dtype)."""
    grad_context = new_output(context, context.shape)
    u = a.new_empty(a.shape)
    t = a.new_empty((*a.shape, values.shape[1]))
    if grad_context.numel():
        with _on_device(context):
            _library(context).function(GLOBAL_MERGE_BACKWARD)(
                grad.contiguous(), context.contiguous(), _slots(values), a.contiguous(), grad_context, u, _slots(t)
            )
    else:
        u.zero_()
        t.zero_()
    return grad_context, u, t


@torch.library.register_fake(global_merge_backward)
def _(grad, context, values, a):
    return context.new_empty(context.shape), a.new_empty(a.shape), a.new_empty((*a.shape, values.shape[1]))


# ----------------------------------------------------------------------------- autocast
def autocast_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Under ``torch.autocast`` for the tensors' device, its dtype for every floating input but
    float64 (autocast's own rule for matmul-like ops), so the half-precision kernels run.

    Done here, in the public functions, rather than with ``torch.library.register_autocast``,
    which casts to one dtype fixed at registration; autocast's dtype is the user's choice
    (bfloat16 or float16).
    """
    if not all(isinstance(x, Tensor) for x in tensors):
        return tensors  # the checks that follow name the bad argument
    device_type = tensors[0].device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(x.to(dtype) if x.is_floating_point() and x.dtype != torch.float64 else x for x in tensors)


# ----------------------------------------------------------------------------- layer norm
@_custom_op("layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension (biased variance),
    with each row's mean and ``rstd = 1 / sqrt(var + eps)`` (accumulation dtype, ``x.shape[:-1]``)
    for the backward; statistics and arithmetic in the accumulation dtype, rounded once."""
    out = new_output(x, x.shape)
    mean = x.new_empty(x.shape[:-1], dtype=accumulation_dtype(x.dtype))
    rstd = torch.empty_like(mean)
    if out.numel():
        with _on_device(x):
            _library(x).function(LAYER_NORM)(
                _rows(x),
                weight.contiguous(),
                bias.contiguous(),
                float(eps),
                out.view(-1, x.shape[-1]),
                mean.view(-1),
                rstd.view(-1),
            )
    return out, mean, rstd


@torch.library.register_fake(layer_norm)
def _(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=accumulation_dtype(x.dtype))
    return x.new_empty(x.shape), stats, torch.empty_like(stats)


@_custom_op("layer_norm_backward", mutates_args=())
def layer_norm_backward(
    grad: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`layer_norm` for ``x``, ``weight`` and ``bias`` from its ``mean`` and
    ``rstd``, in one pass (the parameters' sums over the rows on the way, unrounded terms in the
    accumulation dtype, each sum rounded once)."""
    grad_x = new_output(x, x.shape)
    if grad_x.numel() == 0:
        return grad_x, weight.new_zeros(weight.shape), weight.new_zeros(weight.shape)
    sums_weight, sums_bias = _chunk_sums(x), _chunk_sums(x)
    with _on_device(x):
        _library(x).function(LAYER_NORM_BACKWARD)(
            _rows(grad),
            _rows(x),
            weight.contiguous(),
            mean.reshape(-1),
            rstd.reshape(-1),
            grad_x.view(-1, x.shape[-1]),
            sums_weight,
            sums_bias,
        )
    return grad_x, sums_weight.sum(0).to(weight.dtype), sums_bias.sum(0).to(weight.dtype)


@torch.library.register_fake(layer_norm_backward)
def _(grad, x, weight, mean, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _save_layer_norm(ctx, inputs, output):
    x, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)


def _layer_norm_autograd(ctx, grad, grad_mean, grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = layer_norm_backward(grad, x, weight, mean, rstd)
    return grad_x, grad_weight, grad_bias, None


torch.library.register_autograd(layer_norm, _layer_norm_autograd, setup_context=_save_layer_norm)


# ----------------------------------------------------------------------------- few-row products
def _few_rows_product(function: str, a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (few_rows_mm) or ``a @ b^T`` (few_rows_mm_nt) after checking the operands."""
    transposed = function == FEW_ROWS_MM_NT
    form = "[batch, cols, inner]" if transposed else "[batch, inner, cols]"
    if (
        a.dim() != 3
        or b.dim() != 3
        or b.shape[0] != a.shape[0]
        or b.shape[2 if transposed else 1] != a.shape[2]
        or b.dtype != a.dtype
        or b.device != a.device
    ):
        raise ValueError(
            f"{function}: expected a [batch, rows, inner] and b {form} of one dtype and device, "
            f"got a {tuple(a.shape)} {a.dtype} on {a.device}, b {tuple(b.shape)} {b.dtype} on {b.device}"
        )
    cols = b.shape[1 if transposed else 2]
    out = new_output(a, (a.shape[0], a.shape[1], cols))
    if out.numel() == 0:
        return out
    if a.shape[2] == 0:  # (no terms: the kernels would not write)
        return out.zero_()
    with _on_device(a):
        _library(a).function(function)(a.contiguous(), b.contiguous(), out.view(-1, cols))
    return out


@_custom_op("few_rows_mm", mutates_args=())
def few_rows_mm(a: Tensor, b: Tensor) -> Tensor:
    """``torch.bmm(a, b)`` of ``a`` ``[batch, rows, inner]`` (a few rows) and ``b`` ``[batch, inner,
    cols]`` of the same dtype, sums in the accumulation dtype, rounded once; no autograd."""
    return _few_rows_product(FEW_ROWS_MM, a, b)


@torch.library.register_fake(few_rows_mm)
def _(a, b):
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2])


@_custom_op("few_rows_mm_nt", mutates_args=())
def few_rows_mm_nt(a: Tensor, bt: Tensor) -> Tensor:
    """``torch.bmm(a, bt.transpose(1, 2))`` of ``a`` ``[batch, rows, inner]`` (a few rows) and ``bt``
    ``[batch, cols, inner]`` (a key cache as it is stored) of the same dtype, as :func:`few_rows_mm`."""
    return _few_rows_product(FEW_ROWS_MM_NT, a, bt)


@torch.library.register_fake(few_rows_mm_nt)
def _(a, bt):
    return a.new_empty(a.shape[0], a.shape[1], bt.shape[1])
