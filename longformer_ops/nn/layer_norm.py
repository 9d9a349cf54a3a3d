"""Layer normalisation over the last dimension on a kernel of our own (CPU libraries).

    from longformer_ops.nn.layer_norm import LayerNorm, layer_norm

On the CPU libraries (``torch.ops.longformer_ops.layer_norm``): one pass per row each way, the
backward's weight and bias gradients summed in the same pass, outputs from recycled memory.
Elsewhere (CUDA, a dtype without a library, under
autocast, parameters of another dtype) torch's ``layer_norm``.
"""

from __future__ import annotations

import torch
from torch import nn

from longformer_ops.runtime import checks, kernels


def _kernel_serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    return (
        weight.dtype == bias.dtype == x.dtype
        and not torch.is_autocast_enabled(x.device.type)
        and kernels.available("layer_norm", x.device, x.dtype)
    )


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)``. Differentiable in all
    three. Where the kernel serves (a library for ``x``'s device and dtype has it, the parameters
    are of ``x``'s dtype, autocast is off), the statistics and the normalisation are computed in the
    accumulation dtype (float32 for the half types) and rounded once; otherwise torch's op."""
    checks.check_layer_norm(x, weight, bias, eps)
    if not _kernel_serves(x, weight, bias):
        return nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return torch.ops.longformer_ops.layer_norm(x, weight, bias, float(eps))[0]


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` on :func:`layer_norm` where it applies (the same parameters and state
    dict): normalised over the last dimension, with a weight and a bias. Other configurations
    (several normalised dimensions, no affine parameters or no bias) run torch's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            len(self.normalized_shape) == 1
            and self.weight is not None
            and self.bias is not None
            and isinstance(x, torch.Tensor)
            and x.dim() >= 1
            and x.shape[-1] == self.normalized_shape[0]
        ):
            return layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)
