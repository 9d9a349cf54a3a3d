"""Longformer's banded attention products on prebuilt TVM kernels, for PyTorch.

    from longformer_ops import diagonaled_mm, mask_invalid_locations, band_softmax_, sliding_window_attention

The package's layers, each importing only those before it (``tests/test_layering.py``):

1. :mod:`longformer_ops.runtime`: prebuilt kernels loaded and registered as ``torch.ops.longformer_ops.*``;
2. :mod:`longformer_ops.ops`: the functions, and their plain-PyTorch references;
3. :mod:`longformer_ops.nn`: the encoder's building blocks;
4. :mod:`longformer_ops.models`: Longformer's and Poolingformer's layers, the encoder, the task heads;
5. the integrations: :mod:`longformer_ops.hf` (transformers' own models on the kernels, and the
   attention backend of its sliding-window models) and :mod:`longformer_ops.distributed` (sequence
   parallelism on torch.distributed).

Importing this package loads nothing compiled: kernels are loaded from ``prebuilt/`` on first use.
The integrations and ``longformer_ops.info`` are imported on first access, so that importing this
package never imports transformers.
"""

import importlib

from longformer_ops.models.checkpoint import from_hf_pretrained
from longformer_ops.models.config import AttentionMode, LongformerConfig, PoolingConfig
from longformer_ops.models.layer import LongformerSelfAttention, PoolingformerSelfAttention
from longformer_ops.models.model import LongformerModel
from longformer_ops.models.tasks import (
    LongformerForMaskedLM,
    LongformerForMultipleChoice,
    LongformerForQuestionAnswering,
    LongformerForSequenceClassification,
    LongformerForTokenClassification,
)
from longformer_ops.ops.attention import sliding_window_attention
from longformer_ops.ops.diagonaled import band_softmax_, diagonaled_mm, mask_invalid_locations
from longformer_ops.runtime.loader import KernelNotAvailableError, StaleKernelError
from longformer_ops.runtime.output_cache import empty_cache

__all__ = [
    "diagonaled_mm",
    "mask_invalid_locations",
    "band_softmax_",
    "sliding_window_attention",
    "empty_cache",
    "KernelNotAvailableError",
    "StaleKernelError",
    "LongformerConfig",
    "PoolingConfig",
    "AttentionMode",
    "LongformerSelfAttention",
    "PoolingformerSelfAttention",
    "LongformerModel",
    "LongformerForMaskedLM",
    "LongformerForSequenceClassification",
    "LongformerForTokenClassification",
    "LongformerForQuestionAnswering",
    "LongformerForMultipleChoice",
    "from_hf_pretrained",
]

_LAZY_SUBMODULES = ("hf", "info", "distributed")


def __getattr__(name: str):
    """``longformer_ops.hf.patch(model)`` after a plain ``import longformer_ops``: the submodule is
    imported here, on first access (PEP 562), not with the package."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
