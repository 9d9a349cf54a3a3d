"""Loading Hugging Face Longformer checkpoint directories: no transformers, no network.

    model = from_hf_pretrained("path/to/checkpoint")           # the class its config.json names
    model = from_hf_pretrained(path, LongformerForSequenceClassification, num_labels=3)

A checkpoint is a directory with ``config.json`` and the weights (``model.safetensors`` or
``pytorch_model.bin``, sharded or not), as ``save_pretrained`` writes it. Without ``model_class``
the class is the one ``config.json``'s ``architectures`` names. Any of our model classes loads
from any Longformer checkpoint, as in transformers: the encoder must match exactly, a head the
checkpoint lacks (a classifier on a pretrained encoder), or has with another shape (another number
of labels), starts fresh, and one it has but the class does not (the MLM head under a classifier)
is dropped; all are named in a warning (transformers would raise on a shape, unless told
``ignore_mismatched_sizes``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from longformer_ops.models.config import LongformerConfig
from longformer_ops.models.model import LongformerModel
from longformer_ops.models.tasks import TASK_MODELS, LongformerForMaskedLM, LongformerForQuestionAnswering

# transformers' class names (config.json "architectures") -> ours
ARCHITECTURES = {cls.__name__: cls for cls in (LongformerModel, *TASK_MODELS)}
_ENCODER = "longformer."  # the task models' encoder prefix (transformers' base_model_prefix)
_TIED = (
    ("lm_head.decoder.weight", "longformer.embeddings.word_embeddings.weight"),
    ("lm_head.decoder.bias", "lm_head.bias"),
)
_IGNORED_SUFFIXES = ("embeddings.position_ids",)  # a buffer some older checkpoints saved
_LEVEL2_PARAMETERS = ("query2", "key2", "value2", "ldconv")  # PoolingformerSelfAttention's own modules


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face checkpoint directory (safetensors or .bin, sharded or not)."""
    for single, index, kind in (
        ("model.safetensors", "model.safetensors.index.json", "safetensors"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json", "bin"),
    ):
        if (directory / index).is_file():
            files = sorted(set(json.loads((directory / index).read_text())["weight_map"].values()))
        elif (directory / single).is_file():
            files = [single]
        else:
            continue
        state: dict[str, torch.Tensor] = {}
        for name in files:
            if kind == "safetensors":
                try:
                    from safetensors.torch import load_file
                except ImportError:
                    raise ImportError(
                        f"{directory / name} is a safetensors file: `pip install safetensors` to read it"
                    ) from None
                state.update(load_file(str(directory / name), device="cpu"))
            else:
                state.update(torch.load(directory / name, map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(
        f"no weights in {directory}: expected model.safetensors or pytorch_model.bin (or a sharded *.index.json)"
    )


def _class_of(hf_config: dict, config_file: Path, state: dict) -> type:
    """The class ``config.json``'s ``architectures`` names; without one, the masked LM when the
    weights have an ``lm_head``, else the base model."""
    architectures = hf_config.get("architectures") or []
    if not architectures:
        return LongformerForMaskedLM if any(k.startswith("lm_head.") for k in state) else LongformerModel
    name = architectures[0]
    if name not in ARCHITECTURES:
        raise ValueError(
            f"{config_file}: architectures={architectures!r} names a class longformer_ops does not "
            f"have (it has {sorted(ARCHITECTURES)}); pass model_class= to load the checkpoint "
            f"into one of them"
        )
    return ARCHITECTURES[name]


def _encoder_keys_for(model_class: type, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The checkpoint's key names as ``model_class`` has them (a base model's checkpoint has no
    ``longformer.`` prefix, a task model's has), and the keys of the heads a base model drops."""
    prefixed = any(k.startswith(_ENCODER) for k in state)
    if model_class is LongformerModel and prefixed:
        return (
            {k.removeprefix(_ENCODER): v for k, v in state.items() if k.startswith(_ENCODER)},
            [k for k in state if not k.startswith(_ENCODER)],
        )
    if model_class is LongformerModel or prefixed:
        return state, []
    return {_ENCODER + k: v for k, v in state.items()}, []


def from_hf_pretrained(path, model_class: type | None = None, *, dtype: torch.dtype | None = None, **config_overrides):
    """Load a local Hugging Face Longformer checkpoint directory (config.json + weights); no network.

    ``model_class``: :class:`LongformerModel` or one of the task models
    (:mod:`longformer_ops.models.tasks`); by default the class named in ``config.json``'s
    ``architectures`` (for files without it: the masked LM when the weights have an ``lm_head``,
    else the base model). Heads the checkpoint lacks, or has with another shape, start fresh and
    heads it has that the class does not are dropped, with a warning naming them; the encoder must
    match. Question answering gets its two outputs (start, end) whatever labels the checkpoint
    had, unless ``num_labels`` is given. A base model loaded
    from a checkpoint without pooler weights (a masked LM's) keeps a fresh pooler, with a warning.
    ``config_overrides`` change config fields, e.g. ``attention_mode="sliding_chunks"`` or
    ``num_labels=5`` for a new classifier; the default mode is the TVM kernels. With
    ``pooling=PoolingConfig(...)`` (or its dict) a Longformer checkpoint loads into a
    Poolingformer: its layers keep their Longformer weights and the second level's (``query2``,
    ``key2``, ``value2``, ``ldconv``) start fresh, named in a warning. Returns the model in eval mode.
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {directory} (expected a Hugging Face checkpoint directory)")
    hf_config = json.loads(config_file.read_text())
    if hf_config.get("model_type", "longformer") != "longformer":
        raise ValueError(f"{config_file} has model_type={hf_config['model_type']!r}, expected 'longformer'")
    config = LongformerConfig.from_hf(hf_config, **config_overrides)

    state = {k: v for k, v in _read_weights(directory).items() if not k.endswith(_IGNORED_SUFFIXES)}
    if model_class is None:
        model_class = _class_of(hf_config, config_file, state)
    if model_class not in ARCHITECTURES.values():
        raise TypeError(f"model_class must be one of {', '.join(ARCHITECTURES)}, got {model_class!r}")

    if model_class is LongformerForQuestionAnswering and "num_labels" not in config_overrides:
        config = config.replace(num_labels=2)  # start and end, whatever labels another task's checkpoint had
    model = model_class(config)
    state, dropped_head = _encoder_keys_for(model_class, state)
    expected = model.state_dict()
    for alias, source in _TIED:  # safetensors stores one name per shared tensor
        if alias in expected and alias not in state and source in state:
            state[alias] = state[source]
    is_encoder = (lambda k: True) if model_class is LongformerModel else (lambda k: k.startswith(_ENCODER))
    # Another task's head of the same name but another shape (labels) starts fresh too.
    resized_head = {
        k: (tuple(v.shape), tuple(expected[k].shape))
        for k, v in state.items()
        if k in expected and not is_encoder(k) and v.shape != expected[k].shape
    }
    state = {k: v for k, v in state.items() if k not in resized_head}

    missing, unexpected = model.load_state_dict(state, strict=False)
    fresh_pooler = [k for k in missing if k.removeprefix(_ENCODER).startswith("pooler.")]
    # Poolingformer layers on a Longformer checkpoint: level 2 starts fresh, as in the paper.
    fresh_level2 = [k for k in missing if ".attention.self." in k and k.split(".")[-2] in _LEVEL2_PARAMETERS]
    fresh_head = [k for k in missing if not is_encoder(k) and k not in resized_head]
    unused_head = dropped_head + [
        k for k in unexpected if not is_encoder(k) or k.removeprefix(_ENCODER).startswith("pooler.")
    ]
    missing = [k for k in missing if k not in [*fresh_pooler, *fresh_level2, *fresh_head, *resized_head]]
    unexpected = [k for k in unexpected if k not in unused_head]
    if missing or unexpected:
        raise RuntimeError(
            f"checkpoint {directory} does not match {model_class.__name__}'s encoder: "
            f"missing {missing}, unexpected {unexpected}"
        )
    if fresh_pooler:
        warnings.warn(
            f"{directory} has no pooler weights (transformers' masked LM, token classifier and QA have "
            f"none): pooler left at its initialisation",
            stacklevel=2,
        )
    if resized_head:
        warnings.warn(
            f"Some weights of {model_class.__name__} have another shape in the checkpoint {directory} "
            f"(checkpoint -> model) and are newly initialized: {resized_head}",
            stacklevel=2,
        )
    for fresh, what in ((fresh_head, "the task head"), (fresh_level2, "Poolingformer's level 2")):
        if fresh:
            warnings.warn(
                f"Some weights of {model_class.__name__} were not in the checkpoint {directory} and are "
                f"newly initialized ({what}; train them before use): {fresh}",
                stacklevel=2,
            )
    if unused_head:
        warnings.warn(
            f"Some weights of the checkpoint {directory} were not used by {model_class.__name__} "
            f"(another task's head or pooler): {unused_head}",
            stacklevel=2,
        )
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


__all__ = ["ARCHITECTURES", "from_hf_pretrained"]
