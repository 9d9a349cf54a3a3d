"""``LongformerConfig``: a typed, validated configuration for the layer and the model.

RoBERTa-style fields (the names of Hugging Face's ``LongformerConfig``) plus
Longformer's own: a ONE-SIDED ``attention_window`` per layer (Hugging Face's is
two-sided: HF 512 == 256 here), ``attention_dilation`` per layer (and per head),
``autoregressive``, ``attention_mode`` and (Poolingformer) ``pooling``. Every invalid value or combination is
rejected when the config is built, with a message naming the field.

    cfg = LongformerConfig(hidden_size=768, num_attention_heads=12, attention_window=256)
    cfg = LongformerConfig.from_hf(hf_config)        # transformers.LongformerConfig (or its dict)
    hf_config = cfg.to_hf()                          # back to transformers (needs it installed)
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from dataclasses import dataclass
from typing import Any, cast

# Activations the feed-forward block accepts (Hugging Face's names; "gelu" is the exact erf form).
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish", "tanh")
# Losses of sequence classification (transformers' names); None: chosen from the labels.
PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")
# How Poolingformer's second level compresses keys and values (longformer_ops.models.pooling.pool_sequence).
POOLING_KINDS = ("mean", "max", "ldconv")


class AttentionMode(str, enum.Enum):
    """How the local (sliding-window) attention is computed; all give the same numbers.

    - ``TVM``: the prebuilt banded kernels (:func:`longformer_ops.diagonaled_mm`); any
      window, per-head dilation, autoregressive. The default.
    - ``SLIDING_CHUNKS``: Hugging Face's pure-PyTorch algorithm
      (:func:`longformer_ops.ops.reference.sliding_chunks_qk`); no dilation, not autoregressive.
    - ``FULL``: dense ``n x n`` attention with an explicit mask; a reference, O(n^2) memory.
    """

    TVM = "tvm"
    SLIDING_CHUNKS = "sliding_chunks"
    FULL = "full"


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _per_layer(name: str, value, layers: int) -> list:
    """An int (all layers) or a sequence with one entry per layer -> list of length ``layers``."""
    if isinstance(value, (list, tuple)):
        if len(value) != layers:
            raise ValueError(
                f"{name} must have one entry per layer: expected {layers} "
                f"(num_hidden_layers), got {len(value)}: {list(value)!r}"
            )
        return list(value)
    return [value] * layers


@dataclass
class PoolingConfig:
    """Poolingformer's second level (:class:`longformer_ops.PoolingformerSelfAttention`) and where it runs.

    ``window``: ONE-SIDED, in tokens: query ``i`` attends to the pools whose centres lie within
    ``window`` of ``i`` (the paper's two-sided w2 = 512 is 256 here). Pool ``j`` covers the
    ``kernel_size`` positions from ``j * stride``; ``kind`` is ``"mean"``, ``"max"`` or
    ``"ldconv"`` (lightweight dynamic convolution), the three the paper compares. ``layers``: the
    layers that are Poolingformer layers; None means the top quarter of the encoder (at least one),
    the paper's best setting. The others stay Longformer layers.
    """

    window: int = 256
    kernel_size: int = 4
    stride: int = 4
    kind: str = "mean"
    layers: list[int] | None = None

    def __post_init__(self):
        for name, low in (("window", 0), ("kernel_size", 1), ("stride", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"pooling {name} must be an int >= {low}, got {value!r}")
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"pooling kind must be one of {POOLING_KINDS}, got {self.kind!r}")
        if self.layers is not None:
            if not isinstance(self.layers, (list, tuple)) or not all(_is_int(i) for i in self.layers):
                raise TypeError(f"pooling layers must be a list of layer indices or None, got {self.layers!r}")
            self.layers = sorted(set(int(i) for i in self.layers))


@dataclass
class LongformerConfig:
    """Configuration of :class:`LongformerModel` and the task models (:mod:`longformer_ops.models.tasks`).

    After construction ``attention_window`` is a list with one ONE-SIDED window per
    layer and ``attention_dilation`` a list with one entry per layer (an int, or a
    list with one dilation per head); :meth:`layer_dilation` gives a layer's
    per-head tuple. ``attention_mode`` accepts an :class:`AttentionMode` or its value.
    Defaults are those of ``allenai/longformer-base-4096``.
    """

    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 4098
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    # Task heads (longformer_ops.models.tasks): classes of the classifiers (2 for question answering: start
    # and end), the loss of sequence classification (None: inferred from the labels on the first
    # call, as transformers does), and the separator id that places question answering's and
    # multiple choice's default global tokens.
    num_labels: int = 2
    problem_type: str | None = None
    sep_token_id: int = 2
    # Longformer
    attention_window: int | list[int] = 256  # one-sided: each token sees w left, itself, w right
    attention_dilation: int | list[int | list[int]] = 1
    autoregressive: bool = False  # keys only at or before the query (global ones too)
    attention_mode: AttentionMode = AttentionMode.TVM
    # Poolingformer: a PoolingConfig (or its dict) makes some layers (default: the top quarter) two-level
    pooling: PoolingConfig | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if not _is_int(self.pad_token_id) or not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id must be an int in [0, vocab_size={self.vocab_size}), got {self.pad_token_id!r}"
            )
        if not _is_int(self.num_labels) or self.num_labels < 1:
            raise ValueError(f"num_labels must be a positive int, got {self.num_labels!r}")
        if self.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"problem_type must be one of {PROBLEM_TYPES}, got {self.problem_type!r}")
        if not _is_int(self.sep_token_id) or not 0 <= self.sep_token_id < self.vocab_size:
            raise ValueError(
                f"sep_token_id must be an int in [0, vocab_size={self.vocab_size}), got {self.sep_token_id!r}"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
                raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
        if (
            isinstance(self.layer_norm_eps, bool)
            or not isinstance(self.layer_norm_eps, numbers.Real)
            or self.layer_norm_eps <= 0
        ):
            raise ValueError(f"layer_norm_eps must be a positive float, got {self.layer_norm_eps!r}")
        if not isinstance(self.autoregressive, bool):
            raise TypeError(
                f"autoregressive must be a bool, got {type(self.autoregressive).__name__}: {self.autoregressive!r}"
            )
        if not isinstance(self.tie_word_embeddings, bool):
            raise TypeError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        try:
            self.attention_mode = AttentionMode(self.attention_mode)
        except ValueError:
            raise ValueError(
                f"attention_mode must be one of {[m.value for m in AttentionMode]}, got {self.attention_mode!r}"
            ) from None

        layers, heads = self.num_hidden_layers, self.num_attention_heads
        self.attention_window = _per_layer("attention_window", self.attention_window, layers)
        for i, w in enumerate(self.attention_window):
            if not _is_int(w) or w < 0:
                raise ValueError(f"attention_window (one-sided) must hold ints >= 0, got {w!r} for layer {i}")
        self.attention_window = [int(w) for w in self.attention_window]

        dilation = self.attention_dilation
        if (
            isinstance(dilation, (list, tuple))
            and len(dilation) != layers
            and all(_is_int(d) for d in dilation)
            and len(dilation) == heads
        ):
            raise ValueError(
                f"attention_dilation is a list of {heads} ints but num_hidden_layers={layers}: give one "
                f"entry per layer, e.g. [{list(dilation)!r}] * {layers} for per-head dilations"
            )
        self.attention_dilation = _per_layer("attention_dilation", dilation, layers)
        for i, d in enumerate(self.attention_dilation):
            per_head = list(d) if isinstance(d, (list, tuple)) else [d] * heads
            if len(per_head) != heads or not all(_is_int(x) and x >= 1 for x in per_head):
                raise ValueError(
                    f"attention_dilation for layer {i} must be an int >= 1 or a list of "
                    f"{heads} (num_attention_heads) ints >= 1, got {d!r}"
                )
            self.attention_dilation[i] = list(map(int, d)) if isinstance(d, (list, tuple)) else int(d)

        if isinstance(self.pooling, dict):
            self.pooling = PoolingConfig(**self.pooling)
        if self.pooling is not None:
            if not isinstance(self.pooling, PoolingConfig):
                raise TypeError(f"pooling must be a PoolingConfig, its dict, or None, got {self.pooling!r}")
            if self.pooling.layers is None:  # the top quarter, as the paper found best
                self.pooling = dataclasses.replace(
                    self.pooling, layers=list(range(layers - max(1, layers // 4), layers))
                )
            outside = [i for i in self.pooling.layers if not 0 <= i < layers]
            if outside:
                raise ValueError(f"pooling layers must be in [0, num_hidden_layers={layers}), got {outside}")

        if self.attention_mode is AttentionMode.SLIDING_CHUNKS:
            where = "attention_mode='sliding_chunks' (use 'tvm' or 'full')"
            if self.autoregressive:
                raise ValueError(f"autoregressive=True is not supported with {where}")
            for i in range(layers):
                if set(self.layer_dilation(i)) != {1}:
                    raise ValueError(
                        f"attention_dilation={self.attention_dilation[i]!r} (layer {i}) is not "
                        f"supported with {where}: it needs dilation 1"
                    )
                if self.attention_window[i] < 1:
                    raise ValueError(
                        f"attention_window=0 (layer {i}) is not supported with {where}: "
                        f"it needs a one-sided window >= 1"
                    )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_dilation(self, layer: int) -> tuple[int, ...]:
        """Per-head dilations of ``layer``: a tuple of ``num_attention_heads`` ints."""
        d = cast(list, self.attention_dilation)[layer]  # one entry per layer after __post_init__
        return tuple(d) if isinstance(d, list) else (d,) * self.num_attention_heads

    def is_pooling_layer(self, layer: int) -> bool:
        """Whether ``layer`` is a Poolingformer layer (two-level attention)."""
        return self.pooling is not None and layer in (self.pooling.layers or ())

    def replace(self, **changes) -> LongformerConfig:
        """A validated copy with some fields changed (e.g. ``attention_mode``)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ Hugging Face
    _HF_FIELDS = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "hidden_act",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "max_position_embeddings",
        "type_vocab_size",
        "layer_norm_eps",
        "pad_token_id",
        "initializer_range",
        "tie_word_embeddings",
        "problem_type",
        "sep_token_id",
    )

    @classmethod
    def from_hf(cls, hf_config: Any, **overrides) -> LongformerConfig:
        """From a ``transformers.LongformerConfig`` (or its ``to_dict()`` / config.json dict).

        Hugging Face's ``attention_window`` is two-sided and even: layer windows become
        ``hf_window // 2``. ``overrides`` set any field (``attention_mode=...``, ...).
        """
        hf = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        kwargs = {name: hf[name] for name in cls._HF_FIELDS if name in hf and hf[name] is not None}
        # transformers keeps the number of labels as the length of id2label (num_labels in older files)
        if hf.get("id2label"):
            kwargs["num_labels"] = len(hf["id2label"])
        elif hf.get("num_labels") is not None:
            kwargs["num_labels"] = hf["num_labels"]
        layers = kwargs.get("num_hidden_layers", cls.num_hidden_layers)
        windows = _per_layer("attention_window", hf.get("attention_window", 512), layers)
        for i, w in enumerate(windows):
            if not _is_int(w) or w <= 0 or w % 2:
                raise ValueError(
                    f"Hugging Face attention_window (two-sided) must be a positive even int, got {w!r} for layer {i}"
                )
        kwargs["attention_window"] = [w // 2 for w in windows]
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self):
        """A ``transformers.LongformerConfig`` (two-sided windows ``2 * w``).

        Raises ``ValueError`` for what transformers cannot express: dilation,
        autoregressive attention, a window of 0.
        """
        if any(set(self.layer_dilation(i)) != {1} for i in range(self.num_hidden_layers)):
            raise ValueError(
                f"to_hf: transformers' Longformer has no dilation, got attention_dilation={self.attention_dilation!r}"
            )
        if self.autoregressive:
            raise ValueError("to_hf: transformers' Longformer has no autoregressive attention, got autoregressive=True")
        if 0 in self.attention_window:
            raise ValueError(f"to_hf: transformers needs windows >= 1, got attention_window={self.attention_window!r}")
        if self.pooling is not None:
            raise ValueError("to_hf: transformers has no Poolingformer layers, got pooling=" + repr(self.pooling))
        import transformers  # lazily: only this conversion needs it

        kwargs = {name: getattr(self, name) for name in self._HF_FIELDS}
        return transformers.LongformerConfig(
            num_labels=self.num_labels, attention_window=[2 * w for w in self.attention_window], **kwargs
        )
