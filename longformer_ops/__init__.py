"""Longformer's banded attention products on prebuilt TVM kernels, for PyTorch.

    from longformer_ops import diagonaled_mm, mask_invalid_locations, band_softmax_, sliding_window_attention

Importing this package loads nothing compiled; kernels are loaded on first use
from ``prebuilt/`` (see :mod:`longformer_ops._loader`) and called through the
``torch.library`` custom ops ``torch.ops.longformer_ops.*`` (:mod:`longformer_ops.kernels`),
which ``torch.compile`` and ``torch.export`` trace. Plain-PyTorch references live in
:mod:`longformer_ops.reference`. ``longformer_ops.hf`` (transformers' own models on the kernels) and
``longformer_ops.info`` are imported on first access, so that importing this package never imports
transformers; so is ``longformer_ops.distributed`` (sequence parallelism on torch.distributed).
"""

import importlib

from longformer_ops._loader import KernelNotAvailableError, StaleKernelError
from longformer_ops._output_cache import empty_cache
from longformer_ops.attention import sliding_window_attention
from longformer_ops.checkpoint import from_hf_pretrained
from longformer_ops.config import AttentionMode, LongformerConfig, PoolingConfig
from longformer_ops.diagonaled import band_softmax_, diagonaled_mm, mask_invalid_locations
from longformer_ops.layer import LongformerSelfAttention, PoolingformerSelfAttention
from longformer_ops.model import LongformerModel
from longformer_ops.tasks import (LongformerForMaskedLM, LongformerForMultipleChoice, LongformerForQuestionAnswering,
                                  LongformerForSequenceClassification, LongformerForTokenClassification)

__all__ = ["diagonaled_mm", "mask_invalid_locations", "band_softmax_", "sliding_window_attention", "empty_cache", "KernelNotAvailableError",
           "StaleKernelError", "LongformerConfig", "PoolingConfig", "AttentionMode", "LongformerSelfAttention",
           "PoolingformerSelfAttention", "LongformerModel", "LongformerForMaskedLM",
           "LongformerForSequenceClassification", "LongformerForTokenClassification", "LongformerForQuestionAnswering",
           "LongformerForMultipleChoice", "from_hf_pretrained"]

_LAZY_SUBMODULES = ("hf", "info", "distributed")


def __getattr__(name: str):
    """``longformer_ops.hf.patch(model)`` after a plain ``import longformer_ops``: the submodule is
    imported here, on first access (PEP 562), not with the package."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
