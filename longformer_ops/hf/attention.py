"""transformers' sliding-window models (ModernBERT, Mistral, Qwen2, Gemma, ...) on our local-attention
kernels, through transformers' own attention interface:

    from longformer_ops import hf
    hf.register()                                    # once: the implementation "longformer_ops"
    model = AutoModel.from_pretrained(path, attn_implementation="longformer_ops")
    model.set_attn_implementation("longformer_ops")  # or switch a model already built

Every layer that passes a ``sliding_window`` to its attention function then runs on
:func:`longformer_ops.sliding_window_attention` (the fused kernels: no band and no ``n x n`` mask
in memory, forward or backward); every other layer runs transformers' ``sdpa``. The mask function
registered with it hands the attention function the 2-D padding mask only (as flash-attention's
does), so no dense mask is built for the sliding layers; the full-attention layers get theirs built
here, as ``sdpa_mask`` would.

Semantics, transformers' own (tested against its ``eager`` attention): a causal layer's window ``W``
means the keys ``q - W < kv <= q``; a bidirectional one (``module.is_causal`` False: ModernBERT,
which passes ``config.sliding_window + 1``) ``|q - kv| < W``. Both are our one-sided ``w = W - 1``
(causal: ``autoregressive=True``). ``scaling`` is the scores' scale, ``dropout`` attention dropout.
Grouped keys and values (``num_key_value_heads < num_heads``) go to the kernels as they are: each
query head reads its group's key/value head (no ``repeat_kv`` copy).

Gemma 2's logit soft-capping (``softcap``) runs in the kernels (:func:`sliding_window_attention`'s
``softcap``); gpt-oss's attention sinks (``s_aux``) join through the rows' log-sum-exp the kernels
return (:func:`with_sinks`).

With a key/value cache a causal sliding layer's queries are the last positions of its keys: only
the last ``q + W - 1`` keys are read. A chunk of at least ``W`` queries (a chunked prefill) runs on
the kernels; fewer (a generation step) on transformers' ``sdpa`` over those keys (the model's
``eager`` where it has a soft-cap or sinks), a mask of ``q x (q + W - 1)``. A static cache's slots
past the tokens seen are left out, as the padding mask's length says (flash-attention's convention).

A call the kernels do not take runs transformers' own code for it, with one warning per reason:
``output_attentions``, a bidirectional layer's query shorter than its keys, a 4-D mask given by
the caller, a device or dtype without kernels. Full-attention layers with a soft-cap or sinks run
the model's ``eager`` (sdpa has neither). transformers is imported only when :func:`register` runs.
"""

from __future__ import annotations

import sys
import warnings

import torch

from longformer_ops.ops.attention import sliding_window_attention
from longformer_ops.runtime.checks import KERNEL_DTYPES
from longformer_ops.runtime.loader import KernelNotAvailableError

NAME = "longformer_ops"
_warned: set[str] = set()


def register() -> None:
    """Register the attention implementation ``"longformer_ops"`` and its mask function with
    transformers (every model then sees it; registering again changes nothing)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' mask function for ``"longformer_ops"``: the 2-D padding mask of the keys, ``[b,
    kv_length]`` bool (True: a token), or None where nothing is padding; the window and causality are
    the attention function's (from its layer), so no ``q x kv`` mask is made for any layer here."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    if torch.compiler.is_compiling():  # (whether all are tokens is data: the graph keeps the mask instead of a break)
        return attention_mask
    return None if attention_mask.shape[1] == kv_length and bool(attention_mask.all()) else attention_mask


def one_sided_window(sliding_window: int) -> int:
    """Our one-sided ``w`` for a layer's ``sliding_window`` ``W``: ``W - 1`` keys on each side (causal: before)."""
    return sliding_window - 1


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"longformer_ops: {reason}; this call runs transformers' own attention", stacklevel=3)


def _unsupported_reason(query, key, attention_mask, causal, kwargs) -> str | None:
    """Why the kernels cannot take this call of a sliding layer (None where they can)."""
    if kwargs.get("output_attentions"):
        return "output_attentions needs the attention weights"
    if query.shape[2] != key.shape[2] and not causal:
        return "a bidirectional layer's query shorter than its keys"
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[1] != key.shape[2]):
        return (
            f"an attention mask of shape {tuple(attention_mask.shape)} (the kernels take a [batch, keys] padding mask)"
        )
    if query.device.type not in ("cpu", "cuda") or query.dtype not in KERNEL_DTYPES or query.dtype != key.dtype:
        return f"{query.dtype} on {query.device.type} has no kernels"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads for {key.shape[1]} key heads"
    return None


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """gpt-oss's attention sinks: one more logit per head, ``sinks [H]``, in each row's softmax
    denominator, with no value. From attention ``out [b, n, H, d]`` over the keys and its rows'
    log-sum-exp ``lse [b, n, H]``: ``out * exp(lse) / (exp(lse) + exp(sink))``, i.e. times
    ``sigmoid(lse - sink)`` (0 for a row with no key); differentiable in all three."""
    weight = torch.sigmoid(lse - sinks.to(lse.dtype))[..., None]
    return out * weight if out.dtype == weight.dtype else (out.to(weight.dtype) * weight).to(out.dtype)


def attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention function ``"longformer_ops"``: ``query [b, H, q, d]``, ``key`` and
    ``value [b, H_kv, kv, d]``, ``attention_mask`` as :func:`padding_mask` gives it; returns
    ``([b, q, H, d], None)``. Sliding layers on the fused kernels, the rest on transformers' code."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] < key.shape[2]:
        # A static cache's slots past the tokens seen (the mask covers those; flash-attention's convention).
        key, value = key[:, :, : attention_mask.shape[1]], value[:, :, : attention_mask.shape[1]]
    if sliding_window is not None:  # (full-attention layers run sdpa, as intended: no warning)
        if causal and query.shape[2] < key.shape[2] and (attention_mask is None or attention_mask.dim() == 2):
            # a generation step, a chunked prefill: the window's keys
            key, value, attention_mask = _window_of_keys(query.shape[2], key, value, attention_mask, sliding_window)
            if query.shape[2] < sliding_window:  # (the kernels would compute more rows for the window than asked)
                return _transformers_attention(
                    module,
                    query,
                    key,
                    value,
                    attention_mask,
                    dropout,
                    scaling,
                    sliding_window,
                    softcap,
                    s_aux,
                    causal,
                    kwargs,
                )
        reason = _unsupported_reason(query, key, attention_mask, causal, kwargs)
        if reason is None:
            try:
                return _kernels_attention(
                    query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, s_aux, causal
                ), None
            except KernelNotAvailableError as error:
                reason = f"no kernels here ({error})"
        _warn_once(reason)
    return _transformers_attention(
        module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, s_aux, causal, kwargs
    )


def _window_of_keys(q_length: int, key, value, attention_mask, sliding_window: int):
    """The keys (and their padding) the last ``q_length`` positions of a causal layer reach: the last
    ``q_length + W - 1``."""
    reach = min(key.shape[2], q_length + sliding_window - 1)
    return key[:, :, -reach:], value[:, :, -reach:], None if attention_mask is None else attention_mask[:, -reach:]


def _kernels_attention(query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, s_aux, causal):
    """The call on :func:`sliding_window_attention`, ``[b, q, H, d]``. Queries fewer than the keys (a
    chunked prefill) are the last positions: zero rows before them give the kernels one length, and
    their results are dropped."""
    q_length, kv_length = query.shape[2], key.shape[2]
    rows = query.transpose(1, 2)
    if q_length < kv_length:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, 0, kv_length - q_length, 0))
    out = sliding_window_attention(
        rows,
        key.transpose(1, 2),
        value.transpose(1, 2),
        one_sided_window(sliding_window),
        1,
        causal,
        scaling,
        key_padding_mask=None if attention_mask is None else ~attention_mask,
        dropout_p=dropout,
        softcap=softcap,
        return_lse=s_aux is not None,
    )
    if s_aux is not None:
        out = with_sinks(*out, s_aux)
    return out[:, kv_length - q_length :]


def dense_mask(
    padding: torch.Tensor | None,
    batch: int,
    q_length: int,
    kv_length: int,
    causal: bool,
    sliding_window: int | None,
    device,
) -> torch.Tensor | None:
    """The bool mask transformers' ``sdpa_mask`` gives (True: attend), ``[batch, 1, q, kv]`` (``[batch,
    1, 1, kv]`` for a bidirectional full layer), the queries being the last ``q_length`` of the
    ``kv_length`` positions; None where it would allow everything."""
    if padding is not None and padding.dim() != 2:
        return padding  # (a mask given as it is, e.g. a user's 4-D one)
    if not causal and sliding_window is None:
        return None if padding is None else padding[:, None, None, :]
    queries = torch.arange(kv_length - q_length, kv_length, device=device)[:, None]
    keys = torch.arange(kv_length, device=device)[None, :]
    allowed = torch.ones(q_length, kv_length, dtype=torch.bool, device=device)
    if causal:
        allowed &= keys <= queries
    if sliding_window is not None:
        allowed &= (queries - keys < sliding_window) if causal else ((queries - keys).abs() < sliding_window)
    allowed = allowed[None, None].expand(batch, 1, q_length, kv_length)
    return allowed if padding is None else allowed & padding[:, None, None, :]


def _transformers_attention(
    module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, s_aux, causal, kwargs
):
    """The call on transformers' own functions: ``sdpa``, or the model's ``eager`` for what sdpa
    does not do (softcap, sinks, attention weights), each with the dense mask it expects."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, q_length, kv_length = query.shape[0], query.shape[2], key.shape[2]
    extra = {name: value_ for name, value_ in (("softcap", softcap), ("s_aux", s_aux)) if value_ is not None}
    if extra or kwargs.get("output_attentions"):
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
        mask = dense_mask(attention_mask, b, q_length, kv_length, causal, sliding_window, query.device)
        if mask is not None and mask.dtype == torch.bool:  # eager adds its mask to the scores
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                ~mask, torch.finfo(query.dtype).min
            )
        return eager(
            module,
            query,
            key,
            value,
            mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **extra,
            **kwargs,
        )
    if attention_mask is None and sliding_window is None and (not causal or q_length == kv_length):
        mask = None  # (sdpa's is_causal: its first query sees its first key, so only where the lengths agree)
    else:
        mask = dense_mask(attention_mask, b, q_length, kv_length, causal, sliding_window, query.device)
    return sdpa_attention_forward(
        module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=causal, **kwargs
    )
