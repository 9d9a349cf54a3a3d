"""Dropout of hidden states on the fused attention's counter-based generator.

    from longformer_ops.ops.dropout import Dropout, dropout

On the CPU libraries one vectorised pass (``torch.ops.longformer_ops.dropout``) instead of
torch's dropout, which draws its mask with ``bernoulli_`` on one thread. The mask is a
function of a seed and each element's position, so the backward regenerates it instead of
keeping it. Elsewhere (CUDA, a dtype without a library) this is ``torch.nn.functional.dropout``.
"""

from __future__ import annotations

import torch
from torch import nn

from longformer_ops.runtime import checks, kernels


def dropout_seed() -> torch.Tensor:
    """A seed for the counter-based masks: one draw from torch's default generator per call, as an
    int64 scalar tensor (the ops read its value; a Python int would be data-dependent under tracing).
    Drawn from torch's generator, so ``torch.manual_seed`` reproduces the masks and activation
    checkpointing, which replays the generator's state, replays them."""
    return torch.randint(0, 2**31 - 1, ())


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """As ``torch.nn.functional.dropout(x, p, training)``: each element zeroed with probability ``p``,
    the rest scaled by ``1 / (1 - p)``; ``x`` itself when not training or ``p`` is 0.

    Where the library for ``x``'s device and dtype has the kernel (the CPU libraries), the mask
    comes from the counter-based generator of the fused attention, seeded by one draw from
    torch's default generator (:func:`dropout_seed`), and the product is rounded once in
    ``x``'s dtype; the backward keeps only the seed. Otherwise torch's dropout (its own masks).
    Differentiable.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"x must be a floating-point torch.Tensor, got "
            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    p = checks.check_dropout_p(p, "p")
    checks.check_bool("training", training)
    if not training or p == 0:
        return x
    if kernels.available("dropout", x.device, x.dtype):
        return torch.ops.longformer_ops.dropout(x, dropout_seed(), p)
    return nn.functional.dropout(x, p, training=True)


class Dropout(nn.Dropout):
    """``torch.nn.Dropout`` on :func:`dropout` (the same attribute ``p``, no parameters or buffers:
    a model's ``state_dict`` is unchanged). ``inplace`` is not supported."""

    def __init__(self, p: float = 0.5):
        super().__init__(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)
