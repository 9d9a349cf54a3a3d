"""The transformer FFN's first half, ``gelu(x W^T + b)`` (exact GELU), with the bias and the GELU
in one pass of our own after a bias-free GEMM.

    from longformer_ops.nn.gelu import bias_gelu, linear_gelu

On the CPU libraries (``torch.ops.longformer_ops.bias_gelu``): torch's ``addmm`` copies the bias
into every fresh output before its GEMM, its GELU is a second pass, and its bfloat16 GELU backward
is slow; here the bias meets the GEMM's output on the way into the GELU, the backward is one pass
from the same pre-activation, and outputs come from recycled memory. Elsewhere (CUDA, a dtype
without a library) torch's ops.
"""

from __future__ import annotations

import torch
from torch import nn

from longformer_ops.nn import dense
from longformer_ops.runtime import checks, kernels
from longformer_ops.runtime.output_cache import new_output


def bias_gelu(h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.gelu(h + bias)`` (``approximate="none"``), ``bias`` of size
    ``h.shape[-1]`` broadcast over the other dimensions. Differentiable in both.

    Where the library for ``h``'s device and dtype has the kernel (the CPU libraries), the sum and
    the GELU are computed in the accumulation dtype (float32 for the half types) and rounded once,
    so a half-type ``h + bias`` is not rounded before the GELU as torch's two ops round it.
    """
    checks.check_bias_gelu(h, bias)
    if kernels.available("bias_gelu", h.device, h.dtype):
        return torch.ops.longformer_ops.bias_gelu(h, bias)
    return nn.functional.gelu(h + bias)


def linear_gelu(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``gelu(linear(x))`` (exact GELU). Where the kernel serves (the CPU libraries) and ``linear``
    is a plain ``nn.Linear`` with a bias (not a subclass or a wrapper such as an adapter, no hooks:
    ``dense.plain_linear``), the GEMM without its bias, then :func:`bias_gelu`; without autograd
    (and outside autocast) the GEMM writes into recycled memory and the GELU runs there in place.
    Otherwise torch's ops as the module would run them (on CUDA the bias is the GEMM's epilogue).
    Under ``torch.autocast`` the GEMM runs in autocast's dtype and the bias is cast to it, as
    ``addmm`` casts it."""
    autocast = torch.is_autocast_enabled(x.device.type)
    dtype = dense.product_dtype(x)
    if not dense.plain_linear(linear):
        return nn.functional.gelu(linear(x))
    if not kernels.available("bias_gelu", x.device, dtype):
        h = dense.apply_linear(linear, x)
        # Without autograd the GELU goes into the GEMM's fresh output: no second [rows, 4 x hidden].
        return nn.functional.gelu(h) if torch.is_grad_enabled() else torch.ops.aten.gelu_(h)
    weight, bias = linear.weight, linear.bias
    if not torch.is_grad_enabled() and not autocast and x.dtype == weight.dtype == bias.dtype:
        # [rows, 4 x hidden]: at n = 4096 in float32 48 MiB, past malloc's mmap threshold, so
        # fresh pages on every call where recycled memory has them in place.
        h = new_output(x, (*x.shape[:-1], weight.shape[0]))
        dense.mm_into(x.reshape(-1, x.shape[-1]), weight.t(), h.view(-1, weight.shape[0]))
        checks.check_bias_gelu(h, bias)
        torch.ops.longformer_ops.bias_gelu_(h, bias)
        return h
    h = dense.linear(x, weight)  # autocast, if on, picks this GEMM's dtype
    return bias_gelu(h, bias.to(h.dtype))
