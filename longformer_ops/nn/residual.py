"""A transformer block's way back into its residual stream, ``dropout(x W^T + b) + residual`` (the
sum a block's layer norm then takes), with the bias, the dropout and the residual in one pass of our
own after a bias-free GEMM.

    from longformer_ops.nn.residual import bias_dropout_add, linear_dropout_add

On the CPU libraries (``torch.ops.longformer_ops.bias_dropout_add``): torch's ``addmm`` copies the
bias into every fresh output before its GEMM, and the dropout and the residual's add are two more
passes over ``[rows, hidden]``; here they are one, whose backward is one more (the dropped-out
gradient and, on the way, its column sums: the bias's gradient). The dropout is
:func:`longformer_ops.ops.dropout.dropout`'s (the same mask for the same seed). Elsewhere (CUDA, a dtype
without a library) torch's ops.
"""

from __future__ import annotations

import torch
from torch import nn

from longformer_ops.nn import dense
from longformer_ops.ops.dropout import Dropout, dropout, dropout_seed
from longformer_ops.runtime import checks, kernels
from longformer_ops.runtime.output_cache import new_output


def bias_dropout_add(
    h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, p: float = 0.5, training: bool = True
) -> torch.Tensor:
    """``dropout(h + bias, p, training) + residual``, ``bias`` of size ``h.shape[-1]`` broadcast over
    the other dimensions, ``residual`` of ``h``'s shape. Differentiable in all three.

    Where the library for ``h``'s device and dtype has the kernel (the CPU libraries), one pass in
    the accumulation dtype (float32 for the half types), rounded once, its dropout mask that of
    :func:`longformer_ops.ops.dropout.dropout` (seeded by one draw from torch's default generator when
    ``training`` and ``p > 0``, none otherwise). Otherwise torch's ops.
    """
    checks.check_bias_dropout_add(h, bias, residual)
    p = checks.check_dropout_p(p, "p")
    checks.check_bool("training", training)
    if not kernels.available("bias_dropout_add", h.device, h.dtype):
        return dropout(h + bias, p, training) + residual
    p = p if training else 0.0
    seed = dropout_seed() if p > 0 else torch.zeros((), dtype=torch.int64)
    return torch.ops.longformer_ops.bias_dropout_add(h, bias, residual, seed, p)


def _plain_dropout(module: nn.Module) -> bool:
    """Whether ``module`` is our :class:`~longformer_ops.ops.dropout.Dropout` as it comes (no hooks, no
    ``forward`` of its own instance), so that its ``p`` and ``training`` say what it does."""
    return (
        isinstance(module, Dropout)
        and type(module).forward is Dropout.forward
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and "forward" not in module.__dict__
    )


def linear_dropout_add(x: torch.Tensor, linear: nn.Linear, drop: nn.Module, residual: torch.Tensor) -> torch.Tensor:
    """``drop(linear(x)) + residual``. Where the kernel serves (the CPU libraries), ``linear`` is a
    plain ``nn.Linear`` with a bias (``dense.plain_linear``: not an adapter, no hooks) and ``drop``
    our :class:`~longformer_ops.ops.dropout.Dropout` as it comes: the GEMM without its bias, then
    :func:`bias_dropout_add` with ``drop``'s ``p`` and mode; without autograd (and outside
    autocast) the GEMM writes into recycled memory and the rest runs there in place. Otherwise
    torch's ops as the modules would run them. Under ``torch.autocast`` the GEMM runs in autocast's
    dtype; a residual of another dtype (autocast's float32 stream) or shape (broadcast) takes torch's ops."""
    autocast = torch.is_autocast_enabled(x.device.type)
    dtype = dense.product_dtype(x)
    if not (
        dense.plain_linear(linear)
        and _plain_dropout(drop)
        and residual.dtype == dtype
        and residual.shape == (*x.shape[:-1], linear.out_features)  # (torch's add would broadcast)
        and kernels.available("bias_dropout_add", x.device, dtype)
    ):
        y = drop(dense.apply_linear(linear, x))
        # Without autograd the residual goes into the dense layer's fresh output: one hidden-size
        # temporary fewer.
        return y.add_(residual) if not torch.is_grad_enabled() and y.dtype == residual.dtype else y + residual
    weight, bias = linear.weight, linear.bias
    if not torch.is_grad_enabled() and not autocast and x.dtype == weight.dtype == bias.dtype:
        # The GEMM's output is ours: the bias, the dropout and the residual go into it in place.
        h = new_output(x, (*x.shape[:-1], weight.shape[0]))
        dense.mm_into(x.reshape(-1, x.shape[-1]), weight.t(), h.view(-1, weight.shape[0]))
        checks.check_bias_dropout_add(h, bias, residual)
        p = drop.p if drop.training else 0.0
        seed = dropout_seed() if p > 0 else torch.zeros((), dtype=torch.int64)
        torch.ops.longformer_ops.bias_dropout_add_(h, bias, residual, seed, p)
        return h
    h = dense.linear(x, weight)  # autocast, if on, picks this GEMM's dtype
    return bias_dropout_add(h, bias.to(h.dtype), residual, drop.p, drop.training)
