"""Input validation for the public ops: every check, every message, in one place.

Each check raises before any kernel is reached, naming the argument, what was
expected and what was found.
"""

from __future__ import annotations

import math
import numbers

import torch

KERNEL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_INT32 = 2**31 - 1
# The CUDA kernels launch a grid row per (batch, head) (tvm_kernels/schedules/cuda/), and a
# grid's y dimension holds at most 65535 rows.
CUDA_MAX_BATCH_HEADS = 65535


def check_window(w) -> int:
    if isinstance(w, bool) or not isinstance(w, numbers.Integral):
        raise TypeError(f"w (one-sided window) must be an int, got {type(w).__name__}: {w!r}")
    if w < 0:
        raise ValueError(f"w (one-sided window) must be >= 0, got w={w}")
    if w > _MAX_INT32 // 2:
        raise ValueError(f"w (one-sided window) must be <= {_MAX_INT32 // 2}, got w={w}")
    return int(w)


def check_dilation(d, heads: int) -> tuple[int, ...] | torch.Tensor:
    """Per-head dilations as a tuple of Python ints, from an int or a 1-D integer tensor/sequence.

    A CUDA tensor is copied to the host to be checked (one synchronisation);
    pass an int, a list or a CPU tensor to avoid it. Under ``torch.compile`` a tensor's values are
    data the tracer cannot see: its dtype and shape are checked here and the tensor is returned, and
    the ops check its values (this function again) when they run.
    """
    if isinstance(d, torch.Tensor):
        if d.dtype.is_floating_point or d.dtype.is_complex or d.dtype == torch.bool:
            raise TypeError(f"d (dilation) must be an integer tensor, got dtype={d.dtype}")
        if d.dim() != 1:
            raise ValueError(
                f"d (dilation) must be an int or a 1-D tensor with one value per head, got shape {tuple(d.shape)}"
            )
        if torch.compiler.is_compiling():
            if d.shape[0] != heads:
                raise ValueError(
                    f"d (dilation) must have one value per head: expected length {heads}, got {d.shape[0]}"
                )
            # Checked where the compiled code runs (the ops check again, naming the values).
            torch._assert_async(
                ((d >= 1) & (d <= _MAX_INT32)).all(), f"d (dilation) values must be in [1, {_MAX_INT32}]"
            )
            return d
        values = tuple(int(v) for v in d.tolist())
    elif isinstance(d, (list, tuple)):
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in d):
            raise TypeError(f"d (dilation) sequence must hold ints, got {d!r}")
        values = tuple(int(v) for v in d)
    elif isinstance(d, numbers.Integral) and not isinstance(d, bool):
        values = (int(d),) * heads
    else:
        raise TypeError(f"d (dilation) must be an int or a 1-D integer tensor, got {type(d).__name__}: {d!r}")
    if len(values) != heads:
        raise ValueError(f"d (dilation) must have one value per head: expected length {heads}, got {len(values)}")
    bad = [v for v in values if not 1 <= v <= _MAX_INT32]
    if bad:
        raise ValueError(f"d (dilation) values must be in [1, {_MAX_INT32}], got {list(values)}")
    return values


def check_bool(name: str, value) -> bool:
    """A flag that must be a real bool (not 0/1 or None)."""
    if not isinstance(value, bool):
        kind = type(value)  # numpy's bool is also named "bool": name its module
        named = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"{name} must be a bool, got {named}")
    return value


def _check_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D [batch, seq_len, heads, features], got shape {tuple(x.shape)}")
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be one of {[str(t) for t in KERNEL_DTYPES]}, got dtype={x.dtype}")
    if x.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"{name} is on device {x.device}; supported devices: cpu, cuda")
    if x.device.type == "cuda" and x.shape[0] * x.shape[2] > CUDA_MAX_BATCH_HEADS:
        raise ValueError(
            f"{name} has batch * heads = {x.shape[0]} * {x.shape[2]} = {x.shape[0] * x.shape[2]}; on CUDA "
            f"the kernels take at most {CUDA_MAX_BATCH_HEADS} (a grid row each): split the batch"
        )
    return x


def check_diagonaled_mm(t1, t2, w, d, is_t1_diagonaled, padding, autoregressive):
    """Validate diagonaled_mm's arguments; return ``(w, dilations, band)``."""
    _check_tensor("t1", t1)
    _check_tensor("t2", t2)
    if t1.dtype != t2.dtype:
        raise TypeError(f"t1 and t2 must have the same dtype, got t1.dtype={t1.dtype}, t2.dtype={t2.dtype}")
    if t1.device != t2.device:
        raise ValueError(f"t1 and t2 must be on the same device, got t1.device={t1.device}, t2.device={t2.device}")
    check_bool("is_t1_diagonaled", is_t1_diagonaled)
    check_bool("autoregressive", autoregressive)
    if isinstance(padding, bool) or not isinstance(padding, numbers.Real):
        raise TypeError(f"padding must be a real number, got {type(padding).__name__}: {padding!r}")
    w = check_window(w)
    if t1.shape[:3] != t2.shape[:3]:
        raise ValueError(
            f"t1 and t2 must agree in [batch, seq_len, heads], got t1.shape={tuple(t1.shape)}, t2.shape={tuple(t2.shape)}"
        )
    band = w + (0 if autoregressive else w) + 1
    if is_t1_diagonaled:
        if t1.shape[3] != band:
            raise ValueError(
                f"t1 (the band) must have last dimension c = {band} for w={w}, autoregressive={autoregressive}; "
                f"got t1.shape={tuple(t1.shape)}"
            )
    elif t1.shape[3] != t2.shape[3]:
        raise ValueError(
            f"t1 and t2 must have the same head_dim, got t1.shape={tuple(t1.shape)}, t2.shape={tuple(t2.shape)}"
        )
    dilations = check_dilation(d, t2.shape[2])
    return w, dilations, band


def check_sliding_window_attention(q, k, v, w, d, autoregressive, scale, key_padding_mask=None):
    """Validate sliding_window_attention's arguments; return ``(w, dilations, scale)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    heads = q.shape[2]
    for name, x in (("k", k), ("v", v)):
        grouped = x.shape[:2] == q.shape[:2] and x.shape[3] == q.shape[3] and x.shape[2] > 0 and heads % x.shape[2] == 0
        if x.shape != q.shape and not grouped:
            raise ValueError(
                f"{name} must have q's shape {tuple(q.shape)} [batch, seq_len, heads, head_dim], or "
                f"fewer heads dividing q's {heads} (grouped key/value heads), got {name}.shape={tuple(x.shape)}"
            )
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {name}.dtype={x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {name}.device={x.device}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got v.shape={tuple(v.shape)}")
    check_bool("autoregressive", autoregressive)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3]) if q.shape[3] else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite real number or None (1/sqrt(head_dim)), got {scale!r}")
    check_key_padding_mask(key_padding_mask, q, "q")
    return check_window(w), check_dilation(d, q.shape[2]), float(scale)


def check_key_padding_mask(key_padding_mask, like: torch.Tensor, like_name: str) -> None:
    """None, or a bool ``[batch, seq_len]`` tensor on ``like``'s device (``like`` is ``[batch, seq_len, ...]``)."""
    if key_padding_mask is None:
        return
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        raise TypeError(
            "key_padding_mask must be a bool tensor [batch, seq_len] (True: a key no query attends to), "
            f"got {getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}"
        )
    if tuple(key_padding_mask.shape) != tuple(like.shape[:2]):
        raise ValueError(
            f"key_padding_mask must be [batch, seq_len] = {tuple(like.shape[:2])}, "
            f"got shape {tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.device != like.device:
        raise ValueError(
            f"key_padding_mask must be on {like_name}'s device {like.device}, got {key_padding_mask.device}"
        )


def check_dropout_p(dropout_p, name: str = "dropout_p") -> float:
    """Validate a dropout probability (the argument ``name``); return it as a float."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0 <= dropout_p <= 1:
        raise ValueError(f"{name} must be a probability in [0, 1], got {dropout_p!r}")
    return float(dropout_p)


def check_softcap(softcap) -> float:
    """None (no soft-cap: returned as 0) or a positive finite number; return it as a float."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be a positive finite number or None (no soft-capping), got {softcap!r}")
    return float(softcap)


def _check_features(name: str, x, along: str) -> None:
    """``x`` (the argument ``name``) a floating tensor with a last dimension of features (``along``
    says what is done along it)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point torch.Tensor, got "
            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (the features, {along}), got a scalar")


def _check_per_feature(name: str, vector, of: str, x, same_dtype: bool = True) -> None:
    """``vector`` (the argument ``name``) one value per feature of ``x`` (the argument ``of``), on its
    device and, with ``same_dtype``, of its dtype."""
    if not isinstance(vector, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(vector).__name__}")
    if vector.shape != x.shape[-1:]:
        raise ValueError(f"{name} must have shape [{x.shape[-1]}] ({of}'s last dimension), got {list(vector.shape)}")
    if same_dtype and vector.dtype != x.dtype:
        raise TypeError(f"{name} must have {of}'s dtype {x.dtype}, got {vector.dtype}")
    if vector.device != x.device:
        raise ValueError(f"{name} must be on {of}'s device {x.device}, got {vector.device}")


def check_hidden_states(hidden_states, hidden_size: int, weight: torch.Tensor) -> None:
    """A layer's input: a floating ``[batch, seq_len, hidden_size]`` tensor on its weights' device."""
    if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
        raise TypeError(
            f"hidden_states must be a floating-point torch.Tensor, got "
            f"{hidden_states.dtype if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__}"
        )
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != hidden_size:
        raise ValueError(
            f"hidden_states must be [batch, seq_len, hidden_size = {hidden_size}], "
            f"got shape {tuple(hidden_states.shape)}"
        )
    if hidden_states.device != weight.device:
        raise ValueError(f"hidden_states must be on the layer's device {weight.device}, got {hidden_states.device}")


def check_bias_gelu(h, bias) -> None:
    """``h`` a floating tensor of at least one dimension, ``bias`` of size ``h.shape[-1]`` on its
    device and of its dtype."""
    _check_features("h", h, "which bias is added along")
    _check_per_feature("bias", bias, "h", h)


def check_bias_dropout_add(h, bias, residual) -> None:
    """:func:`check_bias_gelu` for ``h`` and ``bias``; ``residual`` a tensor of ``h``'s shape, dtype and device."""
    check_bias_gelu(h, bias)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.shape != h.shape:
        raise ValueError(f"residual must have h's shape {list(h.shape)}, got {list(residual.shape)}")
    if residual.dtype != h.dtype:
        raise TypeError(f"residual must have h's dtype {h.dtype}, got {residual.dtype}")
    if residual.device != h.device:
        raise ValueError(f"residual must be on h's device {h.device}, got {residual.device}")


def check_layer_norm(x, weight, bias, eps) -> None:
    """``x`` a floating tensor of at least one dimension, ``weight`` and ``bias`` of size
    ``x.shape[-1]`` on its device (of any floating dtype: another falls back to torch), ``eps`` >= 0."""
    _check_features("x", x, "which it normalises over")
    _check_per_feature("weight", weight, "x", x, same_dtype=False)
    _check_per_feature("bias", bias, "x", x, same_dtype=False)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")


def check_out(out, shape: tuple[int, ...], inputs: dict[str, torch.Tensor], differentiable: bool = True) -> None:
    """Validate an ``out=`` tensor for a result of ``shape`` computed from ``inputs`` (by name)."""
    first = next(iter(inputs.values()))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have the result's shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != first.dtype:
        raise TypeError(f"out must have the inputs' dtype {first.dtype}, got dtype={out.dtype}")
    if out.device != first.device:
        raise ValueError(f"out must be on the inputs' device {first.device}, got out.device={out.device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous (the kernels write it in place), got strides {out.stride()}")
    storage = out.untyped_storage().data_ptr()
    if out.numel() and any(t.numel() and t.untyped_storage().data_ptr() == storage for t in inputs.values()):
        raise ValueError(
            f"out must not share memory with {' or '.join(inputs)} (the kernels read them while writing out)"
        )
    if out.requires_grad or (
        differentiable and torch.is_grad_enabled() and any(t.requires_grad for t in inputs.values())
    ):
        raise RuntimeError(
            "out= is not differentiable: call under torch.no_grad() (or torch.inference_mode()) "
            "with an out that does not require grad, or leave out=None to get gradients"
        )


def check_mask_invalid_locations(scores, w, d, autoregressive):
    """Validate mask_invalid_locations' arguments; return ``(w, dilations)``."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 4:
        raise ValueError(f"scores must be 4-D [batch, seq_len, heads, c], got shape {tuple(scores.shape)}")
    if not scores.dtype.is_floating_point:
        raise TypeError(f"scores must be a floating-point tensor (it receives -inf), got dtype={scores.dtype}")
    if any(stride == 0 and size > 1 for size, stride in zip(scores.shape, scores.stride())):
        # (an expanded tensor: writing one row's -inf would write it into every row sharing it)
        raise ValueError(
            f"scores must not have elements sharing memory (it is written in place), got shape "
            f"{tuple(scores.shape)} with strides {scores.stride()}: pass scores.contiguous()"
        )
    check_bool("autoregressive", autoregressive)
    w = check_window(w)
    band = w + (0 if autoregressive else w) + 1
    if scores.shape[3] != band:
        raise ValueError(
            f"scores must have last dimension c = {band} for w={w}, autoregressive={autoregressive}; "
            f"got shape {tuple(scores.shape)}"
        )
    return w, check_dilation(d, scores.shape[2])


def check_band_softmax(scores, w, d, autoregressive, key_padding_mask):
    """Validate band_softmax_'s arguments; return ``(w, dilations)``."""
    w, dilations = check_mask_invalid_locations(scores, w, d, autoregressive)
    if not scores.is_contiguous():
        raise ValueError(
            f"scores must be contiguous (the softmax is written in place), got strides {scores.stride()} "
            f"for shape {tuple(scores.shape)}"
        )
    check_key_padding_mask(key_padding_mask, scores, "scores")
    return w, dilations
