"""The methods compared, at two levels, all computing the same thing.

Levels (``op``):
- ``qk_band``: band scores ``[b, n, h, 2w+1]`` from Q and K;
- ``pv_band``: context ``[b, n, h, f]`` from band probabilities and V;
- ``transposed_band``: the backward's product, ``[b, n, h, f]`` from a band and rows
  (``dV = P^T dO``: each key row gathers the band entries that point at it);
- ``local_attention``: scores, edge mask, softmax, context (no global tokens);
- ``layer``: one :class:`longformer_ops.LongformerSelfAttention` (hidden = heads x head_dim) with one
  global token (position 0, as a classifier's ``<s>``): its projections, local and global
  attention; forward in eval mode under ``torch.no_grad()``, forward+backward in training mode with Hugging Face's default
  attention dropout 0.1. Not in the default ``--ops`` (``--ops layer``).
- ``poolingformer``: one :class:`longformer_ops.PoolingformerSelfAttention` set up as the layer, plus
  its level 2 (LDConv pooling, kernel = stride = 4, one-sided window ``POOLING_WINDOW_FACTOR x w``),
  against the Longformer layer at its level-1 window (``longformer_w1``: the cost it adds to) and at
  its level-2 window (``longformer_w2``: the same receptive field), and against its dense reference
  (``full``: both levels dense). Not in the default ``--ops``.
- ``model``: the whole encoder, :class:`longformer_ops.LongformerModel` at base size (12 layers, hidden
  = heads x head_dim, FFN 4 x hidden), from random input embeddings ``[b, n, hidden]`` (the
  embedding lookup is negligible), token 0 global; ``layer``'s modes, forward in eval mode,
  forward+backward in training mode. Not in the default ``--ops``.
- ``model_checkpointed``: ``model`` with gradient checkpointing (``gradient_checkpointing_enable``):
  its training step keeps one layer's activations instead of all twelve. Not in the default ``--ops``.

Methods: ``tvm`` (ours; local attention is :func:`longformer_ops.sliding_window_attention`: the
fused kernels on CPU, for inference and for training; the layer in its ``tvm`` mode), ``tvm_out`` (ours, forward only,
writing into the outputs of its first call, ``out=``, as an inference loop that reuses its
buffers does: no fresh memory per call), ``tvm_steps`` (local attention as the original API's
three calls: ``diagonaled_mm``, :func:`longformer_ops.band_softmax_`, ``diagonaled_mm``) and
``tvm_steps_torch_softmax`` (the same with ``mask_invalid_locations`` and ``torch.softmax``),
``full`` (n x n scores), ``sdpa`` (PyTorch SDPA with a boolean band mask), ``sliding_chunks``
(Hugging Face's algorithm), ``flex`` (compiled FlexAttention with a sliding-window block mask);
for the layer, ``full`` and ``sliding_chunks`` are its modes of those names.
A method that cannot run a case says why in :func:`unsupported_reason`; the bench records that
reason instead of dropping the row.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

from longformer_ops import (
    AttentionMode,
    LongformerConfig,
    LongformerModel,
    LongformerSelfAttention,
    PoolingConfig,
    PoolingformerSelfAttention,
    band_softmax_,
    diagonaled_mm,
    mask_invalid_locations,
    sliding_window_attention,
)
from longformer_ops.models.layer import band_key_mask
from longformer_ops.ops.diagonaled import transposed_product
from longformer_ops.ops.reference import sliding_chunks_pv, sliding_chunks_qk
from longformer_ops.runtime.band import key_positions

METHODS = ("tvm", "tvm_out", "full", "sdpa", "sliding_chunks", "flex")
OURS = ("tvm", "tvm_out")
COMPILES_PER_SHAPE = {"flex"}  # its first call at a new length compiles
OPS = ("qk_band", "pv_band", "transposed_band", "local_attention")  # the default --ops
MODEL_OPS = ("model", "model_checkpointed")
ALL_OPS = OPS + ("layer", "poolingformer") + MODEL_OPS
MODEL_LAYERS = 12
# The original API's three calls (band, softmax, band): with our band softmax, and with
# mask_invalid_locations and torch.softmax. Not in the default --methods.
STEPS_METHODS = ("tvm_steps", "tvm_steps_torch_softmax")
ALL_METHODS = METHODS + ("longformer_w1", "longformer_w2") + STEPS_METHODS
LAYER_METHODS = {"tvm": AttentionMode.TVM, "sliding_chunks": AttentionMode.SLIDING_CHUNKS, "full": AttentionMode.FULL}
POOLINGFORMER_METHODS = ("tvm", "full", "longformer_w1", "longformer_w2")
POOLING_WINDOW_FACTOR, POOLING_STRIDE = 4, 4  # level 2's window (x the layer's w), its pooling kernel and stride


def default_methods(ops) -> list[str]:
    """The methods ``--ops`` compare when ``--methods`` is not given."""
    chosen = [m for op in ops for m in (POOLINGFORMER_METHODS if op == "poolingformer" else METHODS)]
    return list(dict.fromkeys(chosen))


def unsupported_reason(method: str, op: str, backward: bool, dilation: tuple[int, ...], device: str) -> str | None:
    if op in ("layer", *MODEL_OPS) and method not in LAYER_METHODS:
        return f"the {op}'s attention modes are {', '.join(LAYER_METHODS)}"
    if op == "poolingformer" and method not in POOLINGFORMER_METHODS:
        return f"the Poolingformer layer is compared as {', '.join(POOLINGFORMER_METHODS)}"
    if method in STEPS_METHODS and op != "local_attention":
        return "the original API's path is local attention"
    if method.startswith("longformer_w") and op != "poolingformer":
        return "the Longformer layers at the two windows are the Poolingformer's yardsticks only"
    if method == "tvm_out" and backward:
        return "out= is forward only (not differentiable)"
    if method in ("sdpa", "flex") and op != "local_attention":
        return "fused attention: no separate band product"
    if method == "sliding_chunks" and op == "transposed_band":
        return "no separate transposed product (autograd through its probs.V)"
    if method == "sliding_chunks" and any(d != 1 for d in dilation):
        return "sliding chunks has no dilation"
    if method == "flex":
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            return f"torch {torch.__version__} has no FlexAttention"
        if backward and device == "cpu":
            return "FlexAttention has no backward on CPU"
    return None


def band_flops(batch: int, seq_len: int, heads: int, head_dim: int, w: int) -> float:
    """Useful FLOPs of one band product: 2 * b * h * n * (2w+1) * head_dim."""
    return 2.0 * batch * heads * seq_len * (2 * w + 1) * head_dim


def useful_flops(op: str, backward: bool, batch, seq_len, heads, head_dim, w) -> float:
    """Band products the op needs (2 for attention; the layer adds its three n x hidden x hidden
    projections and its global token's scores and context, each 2 n hidden heads through the global
    key and value weights; the model has 12 layers, each with those, the output dense and its FFN),
    x3 with backward (each product has two adjoints)."""
    products = 2 if op in ("local_attention", "layer", "poolingformer") else 1  # (model: per layer, below)
    hidden = heads * head_dim
    flops = band_flops(batch, seq_len, heads, head_dim, w) * products
    if op in ("layer", "poolingformer"):
        flops += 3 * 2.0 * batch * seq_len * hidden**2 + 2 * 2.0 * batch * seq_len * hidden * heads
    if op in MODEL_OPS:  # per layer: the layer's work, the output dense and the 4x FFN
        # (checkpointed: the same useful work; its recomputation is overhead)
        flops = MODEL_LAYERS * (
            2 * flops
            + 3 * 2.0 * batch * seq_len * hidden**2
            + 2 * 2.0 * batch * seq_len * hidden * heads
            + (1 + 8) * 2.0 * batch * seq_len * hidden**2
        )
    if op == "poolingformer":  # level 2: three more projections and two products over its band of pools
        flops += 3 * 2.0 * batch * seq_len * (heads * head_dim) ** 2
        flops += 2 * band_flops(batch, seq_len, heads, head_dim, POOLING_WINDOW_FACTOR * w // POOLING_STRIDE)
    return flops * (3 if backward else 1)


# ---------------------------------------------------------------------------
# Implementations. Inputs: q, k, v [b, n, h, f]; probs [b, n, h, 2w+1].
# ---------------------------------------------------------------------------


def _keys(seq_len: int, w: int, dilation, device) -> torch.Tensor:
    """Key of every band position, ``[h, n, 2w+1]`` (int64; outside [0, n) where invalid)."""
    return key_positions(seq_len, w, torch.tensor(dilation, device=device), False).permute(1, 0, 2)


def _band_from_dense(dense: torch.Tensor, w: int, dilation, fill: float) -> torch.Tensor:
    """[b, h, n, n] -> band [b, n, h, 2w+1] by gathering key i + d*(j-w)."""
    b, h, n, _ = dense.shape
    keys = _keys(n, w, dilation, dense.device)
    invalid = (keys < 0) | (keys >= n)
    band = torch.gather(dense, 3, keys.clamp(0, n - 1).expand(b, h, n, 2 * w + 1))
    return band.masked_fill(invalid, fill).permute(0, 2, 1, 3)


def _reusing(buffers: dict | None, name: str, call):
    """``call(out)`` with ``out=None`` (tvm), or (tvm_out) with the output of this runner's first
    call, which allocated it as tvm does (so it has the same huge-page advice)."""
    if buffers is None:
        return call(None)
    buffers[name] = call(buffers.get(name))
    return buffers[name]


def qk_band(method: str, q, k, w: int, dilation, buffers=None):
    if method in OURS:
        return _reusing(buffers, "scores", lambda out: diagonaled_mm(q, k, w, torch.tensor(dilation), out=out))
    if method == "sliding_chunks":
        return sliding_chunks_qk(q, k, w)
    if method == "full":
        dense = torch.einsum("bihf,bjhf->bhij", q, k)  # [b, h, n, n]
        return _band_from_dense(dense, w, dilation, 0.0)
    raise ValueError(method)


def _dense_from_band(probs: torch.Tensor, w: int, dilation) -> torch.Tensor:
    """band [b, n, h, 2w+1] -> [b, h, n, n], zero off the band and at invalid positions."""
    b, n, h, c = probs.shape
    keys = _keys(n, w, dilation, probs.device)
    valid = (keys >= 0) & (keys < n)
    dense = probs.new_zeros(b, h, n, n + 1)  # column n collects invalid positions, then dropped
    dense.scatter_(3, torch.where(valid, keys, n).expand(b, h, n, c), probs.permute(0, 2, 1, 3))
    return dense[..., :n]


def pv_band(method: str, probs, v, w: int, dilation, buffers=None):
    if method in OURS:
        return _reusing(
            buffers, "context", lambda out: diagonaled_mm(probs, v, w, torch.tensor(dilation), True, out=out)
        )
    if method == "sliding_chunks":
        return sliding_chunks_pv(probs, v, w)
    if method == "full":
        return torch.einsum("bhij,bjhf->bihf", _dense_from_band(probs, w, dilation), v)
    raise ValueError(method)


def transposed_band(method: str, probs, rows, w: int, dilation, buffers=None):
    if method in OURS:  # the kernel alone, as the backward of probs.V runs it for dV
        return _reusing(
            buffers, "rows", lambda out: transposed_product(probs, rows, w, torch.tensor(dilation), out=out)
        )
    if method == "full":
        return torch.einsum("bhij,bihf->bjhf", _dense_from_band(probs, w, dilation), rows)
    raise ValueError(method)


@functools.lru_cache(maxsize=8)
def _flex_block_mask(seq_len: int, w: int, dilation: tuple[int, ...], device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    # FlexAttention's best configuration we found on this CPU (n = 4096, same process): with one
    # dilation, a mask without the per-head lookup (77 vs 88 ms), and 64-token blocks rather
    # than the default 128 (72 vs 76 ms; equal with per-head dilations). On CUDA its default 128:
    # its GPU kernels' tiles must divide the mask's blocks, and 64 failed to lower on an H100.
    if len(set(dilation)) == 1:
        d = dilation[0]

        def sliding_window(b, h, q_idx, kv_idx):
            offset = kv_idx - q_idx
            return (offset.abs() <= w) if d == 1 else (offset.abs() <= d * w) & (offset % d == 0)

        heads = None
    else:
        per_head = torch.tensor(dilation, device=device)

        def sliding_window(b, h, q_idx, kv_idx):
            offset = kv_idx - q_idx
            return (offset.abs() <= per_head[h] * w) & (offset % per_head[h] == 0)

        heads = len(dilation)
    return create_block_mask(
        sliding_window,
        B=None,
        H=heads,
        Q_LEN=seq_len,
        KV_LEN=seq_len,
        device=device,
        BLOCK_SIZE=64 if device == "cpu" else 128,
        _compile=True,
    )


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # One compilation per (length, mask) in a sweep: more than Dynamo's default limit of 8,
    # past which it silently runs FlexAttention eagerly (seconds per call). Raise the limit,
    # and fail loudly rather than ever timing the eager fallback.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


def local_attention(method: str, q, k, v, w: int, dilation, buffers=None):
    """softmax(q k^T / sqrt(f) restricted to the band) v, for q, k, v [b, n, h, f] -> [b, n, h, f]."""
    b, n, h, f = q.shape
    scale = 1.0 / math.sqrt(f)
    if method in OURS:  # on CPU the fused kernels, with and without autograd
        return _reusing(
            buffers, "context", lambda out: sliding_window_attention(q, k, v, w, list(dilation), scale=scale, out=out)
        )
    if method in ("tvm_steps", "tvm_steps_torch_softmax"):  # the original API's path, on one band
        scores = diagonaled_mm(q * scale, k, w, list(dilation))
        if method == "tvm_steps":
            probs = band_softmax_(scores, w, list(dilation))
        else:
            probs = torch.softmax(mask_invalid_locations(scores, w, list(dilation), False), dim=-1)
        return diagonaled_mm(probs, v, w, list(dilation), is_t1_diagonaled=True)
    if method == "sliding_chunks":
        scores = sliding_chunks_qk(q * scale, k, w, padding=float("-inf"))
        # In the input dtype, as the layer does: torch's softmax accumulates half types in float32
        # and rounds once. Inference: in place, no second band in memory.
        if not (torch.is_grad_enabled() and scores.requires_grad):
            probs = torch.softmax(scores, dim=-1, out=scores)
        else:
            probs = torch.softmax(scores, dim=-1)
        return sliding_chunks_pv(probs, v, w)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, n, f]
    if method == "full":
        scores = torch.matmul(qh * scale, kh.transpose(-1, -2))  # [b, h, n, n]
        scores = scores.masked_fill(~band_key_mask(n, w, tuple(dilation), False, q.device), float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(1, 2)
    if method == "sdpa":
        mask = band_key_mask(n, w, tuple(dilation), False, q.device)  # [h or 1, n, n]
        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(1, 2)
    if method == "flex":
        block_mask = _flex_block_mask(n, w, tuple(dilation), q.device.type)
        # Contiguous [b, h, n, f] copies, copying included, are faster for it than strided views
        # (n = 4096: 75 vs 86 ms).
        qh, kh, vh = (x.contiguous() for x in (qh, kh, vh))
        return _compiled_flex()(qh, kh, vh, block_mask=block_mask).transpose(1, 2)
    raise ValueError(method)


@functools.lru_cache(maxsize=4)
def _layer_module(
    method: str, heads: int, head_dim: int, w: int, dilation: tuple[int, ...], dtype, device: str, training: bool
) -> LongformerSelfAttention:
    torch.manual_seed(0)  # the same weights for every method
    config = LongformerConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_hidden_layers=1,
        attention_window=w,
        attention_dilation=[list(dilation)],
        attention_mode=LAYER_METHODS[method],
        attention_probs_dropout_prob=0.1,
    )
    return LongformerSelfAttention(config, 0).to(dtype=dtype, device=device).train(training)


def layer(method: str, x, w: int, dilation, buffers=None):
    """One attention layer on hidden states ``[b, n, hidden]``, token 0 global; training mode (with
    attention dropout) when ``x`` requires grad."""
    heads = len(dilation)
    module = _layer_module(
        method, heads, x.shape[-1] // heads, w, tuple(dilation), x.dtype, x.device.type, x.requires_grad
    )
    return _with_token_0_global(module, x)


def _with_token_0_global(module, x):
    """``module``'s output on hidden states ``x [b, n, hidden]``, with token 0 global (a classifier's ``<s>``)."""
    mask = torch.zeros(x.shape[:2], device=x.device)
    mask[:, 0] = 1
    return module(x, mask)[0]


@functools.lru_cache(maxsize=4)
def _poolingformer_module(
    method: str, heads: int, head_dim: int, w: int, dilation: tuple[int, ...], dtype, device: str, training: bool
) -> LongformerSelfAttention:
    torch.manual_seed(0)
    plain = method.startswith("longformer_w")
    config = LongformerConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_hidden_layers=1,
        attention_window=POOLING_WINDOW_FACTOR * w if method == "longformer_w2" else w,
        attention_dilation=[list(dilation)],
        attention_probs_dropout_prob=0.1,
        attention_mode=AttentionMode.FULL if method == "full" else AttentionMode.TVM,
        pooling=None
        if plain
        else PoolingConfig(
            window=POOLING_WINDOW_FACTOR * w, kernel_size=POOLING_STRIDE, stride=POOLING_STRIDE, kind="ldconv"
        ),
    )
    module = LongformerSelfAttention(config, 0) if plain else PoolingformerSelfAttention(config, 0)
    return module.to(dtype=dtype, device=device).train(training)


def poolingformer(method: str, x, w: int, dilation, buffers=None):
    """One Poolingformer layer (or the Longformer layer at its level-1 or level-2 window) on hidden
    states ``[b, n, hidden]``, token 0 global, as :func:`layer`."""
    heads = len(dilation)
    module = _poolingformer_module(
        method, heads, x.shape[-1] // heads, w, tuple(dilation), x.dtype, x.device.type, x.requires_grad
    )
    return _with_token_0_global(module, x)


@functools.lru_cache(maxsize=2)
def _model(
    method: str,
    heads: int,
    head_dim: int,
    w: int,
    dilation: tuple[int, ...],
    seq_len: int,
    dtype,
    device: str,
    training: bool,
    checkpointed: bool,
) -> LongformerModel:
    torch.manual_seed(0)
    hidden = heads * head_dim
    config = LongformerConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_hidden_layers=MODEL_LAYERS,
        intermediate_size=4 * hidden,
        max_position_embeddings=seq_len + 2,
        attention_window=w,
        attention_dilation=[list(dilation)] * MODEL_LAYERS,
        attention_mode=LAYER_METHODS[method],
    )
    encoder = LongformerModel(config).to(dtype=dtype, device=device).train(training)
    if checkpointed:
        encoder.gradient_checkpointing_enable()
    return encoder


def model(method: str, x, w: int, dilation, buffers=None, checkpointed: bool = False):
    """The encoder's last hidden states ``[b, n, hidden]`` from input embeddings ``x``, token 0 global;
    training mode when ``x`` requires grad."""
    heads = len(dilation)
    module = _model(
        method,
        heads,
        x.shape[-1] // heads,
        w,
        tuple(dilation),
        x.shape[1],
        x.dtype,
        x.device.type,
        x.requires_grad,
        checkpointed,
    )
    is_global = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
    is_global[:, 0] = 1
    return module(inputs_embeds=x, global_attention_mask=is_global).last_hidden_state


def make_inputs(op: str, batch, seq_len, heads, head_dim, w, dtype, device, requires_grad: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape):
        x = torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)
        return x.requires_grad_(requires_grad)

    if op == "qk_band":
        return tensor(batch, seq_len, heads, head_dim), tensor(batch, seq_len, heads, head_dim)
    if op in ("layer", "poolingformer", *MODEL_OPS):
        return (tensor(batch, seq_len, heads * head_dim),)
    if op in ("pv_band", "transposed_band"):
        probs = torch.softmax(torch.randn(batch, seq_len, heads, 2 * w + 1, generator=generator), -1)
        return probs.to(dtype=dtype, device=device).requires_grad_(requires_grad), tensor(
            batch, seq_len, heads, head_dim
        )
    return tuple(tensor(batch, seq_len, heads, head_dim) for _ in range(3))


def runner(op: str, method: str, inputs, w: int, dilation, backward: bool):
    """A no-argument callable doing one forward (and backward) of ``op`` with ``method``; a forward
    alone runs under ``torch.no_grad()``, as inference does."""
    function = {
        "qk_band": qk_band,
        "pv_band": pv_band,
        "transposed_band": transposed_band,
        "local_attention": local_attention,
        "layer": layer,
        "poolingformer": poolingformer,
        "model": model,
        "model_checkpointed": functools.partial(model, checkpointed=True),
    }[op]

    buffers = {} if method == "tvm_out" else None

    def run():
        if not backward:  # inference: no autograd graph for the modules' parameters
            with torch.no_grad():
                return function(method, *inputs, w, dilation, buffers)
        out = function(method, *inputs, w, dilation, buffers)
        out.backward(torch.ones_like(out))
        return out

    return run
