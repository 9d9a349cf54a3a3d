"""LongformerConfig and LongformerSelfAttention: validation, the three modes against each other,
dilation and autoregressive against an explicit-mask attention written here from the definition,
gradients, half precision, any sequence length."""

from __future__ import annotations

import math

import pytest
import torch
from hf_helpers import assert_close, hf_config, single_thread

from longformer_ops import AttentionMode, LongformerConfig, LongformerSelfAttention
from longformer_ops.runtime import loader as _loader

_ = single_thread  # autouse fixture: these tiny ops only lose from intra-op threads on a loaded machine
MODES = list(AttentionMode)


def tiny_config(**kwargs) -> LongformerConfig:
    base = dict(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return LongformerConfig(**{**base, **kwargs})


def layer_for(config: LongformerConfig, seed=0, dtype=torch.float64) -> LongformerSelfAttention:
    torch.manual_seed(seed)
    layer = LongformerSelfAttention(config, 0).to(dtype).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def layer_inputs(seed, b, n, hidden, dtype=torch.float64, pad_from=None, globals_=()):
    """Hidden states and the layer's mask: -1 padding (from position ``pad_from[b]``), 0 local, 1 global."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, hidden, generator=gen).to(dtype)
    mask = torch.zeros(b, n, dtype=torch.long)
    for bi, start in enumerate(pad_from or []):
        mask[bi, start:] = -1
    for bi, pos in globals_:
        mask[bi, pos] = torch.where(mask[bi, pos] < 0, -1, 1)  # padding wins
    return x, mask


def copy_to(config: LongformerConfig, layer: LongformerSelfAttention) -> LongformerSelfAttention:
    other = LongformerSelfAttention(config, 0).to(next(layer.parameters()).dtype).eval()
    other.load_state_dict(layer.state_dict())
    return other


def explicit_attention(layer: LongformerSelfAttention, x, mask, w, dilation, autoregressive, dropout=None):
    """The definition, one (example, head, query) at a time: the allowed keys as an explicit set.

    ``dropout``: None, or the factors that multiply the probabilities, ``(band [b, n, h, c]`` by
    band column, ``global_keys [b, n, h, g]`` by global slot, ``global_rows [b, h, g, n]`` by key).
    """
    b, n, hidden = x.shape
    h, d = layer.num_heads, layer.head_dim
    split = lambda t: t.view(b, -1, h, d)  # noqa: E731
    q, k, v = split(layer.query(x)) / math.sqrt(d), split(layer.key(x)), split(layer.value(x))
    qg, kg, vg = split(layer.query_global(x)) / math.sqrt(d), split(layer.key_global(x)), split(layer.value_global(x))
    out = torch.zeros(b, n, h, d, dtype=x.dtype)
    for bi in range(b):
        pad, glob = mask[bi] < 0, mask[bi] > 0
        for hi in range(h):
            for i in range(n):
                if pad[i]:
                    continue
                slot = {int(p): s for s, p in enumerate(torch.nonzero(glob).flatten())}  # global position -> slot
                if glob[i]:  # global row: every non-padding key, with the global projections
                    keys = [kk for kk in range(n) if not pad[kk] and (not autoregressive or kk <= i)]
                    qq, kk_, vv = qg[bi, i, hi], kg[bi, keys, hi], vg[bi, keys, hi]
                    factor = lambda kk: dropout[2][bi, hi, slot[i], kk]  # noqa: E731
                else:
                    band = [i + dilation[hi] * (j - w) for j in range(2 * w + 1)]
                    band = [
                        kk
                        for kk in band
                        if 0 <= kk < n and not pad[kk] and not glob[kk] and (not autoregressive or kk <= i)
                    ]
                    glob_keys = [kk for kk in range(n) if glob[kk] and (not autoregressive or kk <= i)]
                    keys = sorted(set(band) | set(glob_keys))
                    qq, kk_, vv = q[bi, i, hi], k[bi, keys, hi], v[bi, keys, hi]

                    def factor(kk):
                        if glob[kk]:
                            return dropout[1][bi, i, hi, slot[kk]]
                        return dropout[0][bi, i, hi, w + (kk - i) // dilation[hi]]

                weights = torch.softmax(kk_ @ qq, 0)
                if dropout is not None:
                    weights = weights * torch.stack([factor(kk) for kk in keys]).to(weights.dtype)
                out[bi, i, hi] = weights @ vv
    return out.reshape(b, n, hidden)


# ----------------------------------------------------------------------------- config
def test_config_normalises_per_layer_fields_and_mode():
    cfg = tiny_config(
        num_hidden_layers=3, attention_window=[1, 2, 3], attention_dilation=[1, [1, 2, 3, 4], 2], attention_mode="full"
    )
    assert cfg.attention_mode is AttentionMode.FULL
    assert cfg.attention_window == [1, 2, 3]
    assert cfg.layer_dilation(0) == (1, 1, 1, 1)
    assert cfg.layer_dilation(1) == (1, 2, 3, 4)
    assert cfg.layer_dilation(2) == (2, 2, 2, 2)
    assert tiny_config(num_hidden_layers=2, attention_window=5).attention_window == [5, 5]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(attention_mode="n2"), ValueError, r"attention_mode must be one of \['tvm', 'sliding_chunks', 'full'\]"),
        (dict(attention_window=-1), ValueError, r"attention_window .* got -1 for layer 0"),
        (
            dict(num_hidden_layers=2, attention_window=[4]),
            ValueError,
            r"attention_window must have one entry per layer",
        ),
        (dict(attention_dilation=0), ValueError, r"attention_dilation for layer 0 must be an int >= 1"),
        (dict(attention_dilation=[[1, 2]]), ValueError, r"attention_dilation for layer 0 .* 4 \(num_attention_heads\)"),
        (dict(num_hidden_layers=2, attention_dilation=[1, 2, 3, 4]), ValueError, r"one entry per layer"),
        (
            dict(attention_mode="sliding_chunks", attention_dilation=2),
            ValueError,
            r"attention_dilation=2 \(layer 0\) is not supported with attention_mode='sliding_chunks'",
        ),
        (
            dict(attention_mode="sliding_chunks", autoregressive=True),
            ValueError,
            r"autoregressive=True is not supported with attention_mode='sliding_chunks'",
        ),
        (dict(attention_mode="sliding_chunks", attention_window=0), ValueError, r"attention_window=0 \(layer 0\)"),
        (dict(autoregressive=1), TypeError, r"autoregressive must be a bool"),
        (dict(hidden_size=30), ValueError, r"hidden_size \(30\) must be a multiple of num_attention_heads \(4\)"),
        (dict(hidden_act="mish"), ValueError, r"hidden_act must be one of"),
        (dict(hidden_dropout_prob=1.5), ValueError, r"hidden_dropout_prob must be a float in \[0, 1\)"),
    ],
)
def test_config_rejects_invalid_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        tiny_config(**kwargs)


def test_config_from_hf_and_back():
    pytest.importorskip("transformers")
    hf = hf_config([4, 8, 12], layer_norm_eps=1e-7)
    cfg = LongformerConfig.from_hf(hf, attention_mode="sliding_chunks")
    assert cfg.attention_window == [2, 4, 6]  # one-sided
    assert cfg.attention_mode is AttentionMode.SLIDING_CHUNKS
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.layer_norm_eps, cfg.pad_token_id) == (32, 4, 1e-7, 1)
    assert LongformerConfig.from_hf(hf.to_dict()) == cfg.replace(attention_mode="tvm")
    back = cfg.to_hf()
    assert back.attention_window == [4, 8, 12]
    for name in ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings", "layer_norm_eps"):
        assert getattr(back, name) == getattr(hf, name)
    with pytest.raises(ValueError, match=r"two-sided\) must be a positive even int, got 5 for layer 1"):
        LongformerConfig.from_hf({**hf.to_dict(), "attention_window": [4, 5, 8]})
    with pytest.raises(ValueError, match=r"to_hf: transformers' Longformer has no dilation"):
        cfg.replace(attention_mode="tvm", attention_dilation=2).to_hf()
    with pytest.raises(ValueError, match=r"no autoregressive attention"):
        cfg.replace(attention_mode="tvm", autoregressive=True).to_hf()


# ----------------------------------------------------------------------------- layer
def test_modes_agree_with_padding_and_globals():
    """Window larger than some rows' reach, length not a multiple of anything, globals and padding."""
    cfg = tiny_config(attention_window=3)
    x, mask = layer_inputs(0, 3, 11, 32, pad_from=[11, 7, 9], globals_=[(0, 0), (0, 5), (0, 9), (1, 2), (2, 10)])
    results = {}
    for mode in MODES:
        layer = copy_to(cfg.replace(attention_mode=mode), layer_for(cfg))
        results[mode] = layer(x, mask, output_attentions=True)
    expected = explicit_attention(layer_for(cfg), x, mask, 3, (1,) * 4, False)
    real = mask >= 0
    for mode, (out, att, gatt) in results.items():
        assert_close(out[real], expected[real], 1e-10, f"{mode} output vs explicit")
        assert att.shape == (3, 4, 11, 3 + 7) and gatt.shape == (3, 4, 11, 3)
        assert_close(att, results[AttentionMode.FULL][1], 1e-12, f"{mode} attentions")
        assert_close(gatt, results[AttentionMode.FULL][2], 1e-12, f"{mode} global attentions")
    out, att, gatt = results[AttentionMode.TVM]
    assert (out[~real] == 0).all()  # padding queries attend to nothing
    assert (att[1, :, 7:] == 0).all()  # ... and have zero rows
    assert (att[0, :, [0, 5, 9]] == 0).all()  # rows of global tokens are zeroed (HF)
    assert (gatt[1, :, :, 1:] == 0).all()  # empty global slots hold 0
    sums = att.sum(-1)[:, :, ~(mask[0] != 0)]  # local rows of example 0 sum to 1
    assert_close(sums[0], torch.ones_like(sums[0]), 1e-12, "row sums")


@pytest.mark.parametrize("autoregressive", [False, True])
def test_dilation_and_autoregressive_match_explicit_mask(autoregressive):
    dilation = [1, 2, 3, 1]
    cfg = tiny_config(attention_window=2, attention_dilation=[dilation], autoregressive=autoregressive)
    x, mask = layer_inputs(1, 2, 13, 32, pad_from=[13, 10], globals_=[(0, 4), (0, 11), (1, 7)])
    expected = explicit_attention(layer_for(cfg), x, mask, 2, dilation, autoregressive)
    real = mask >= 0
    outs = {}
    for mode in (AttentionMode.TVM, AttentionMode.FULL):
        outs[mode] = copy_to(cfg.replace(attention_mode=mode), layer_for(cfg))(x, mask, output_attentions=True)
        assert_close(outs[mode][0][real], expected[real], 1e-10, f"{mode}")
    c = 2 + (0 if autoregressive else 2) + 1
    assert outs[AttentionMode.TVM][1].shape == (2, 4, 13, 2 + c)
    for i in (1, 2):
        assert_close(outs[AttentionMode.TVM][i], outs[AttentionMode.FULL][i], 1e-12, f"attentions output {i}")


def test_autoregressive_is_causal_with_global_tokens():
    cfg = tiny_config(attention_window=3, attention_dilation=[[1, 2, 1, 3]], autoregressive=True)
    layer = layer_for(cfg)
    x, mask = layer_inputs(2, 1, 12, 32, globals_=[(0, 2), (0, 9)])
    changed = x.clone()
    changed[:, 6:] += torch.randn(1, 6, 32, dtype=x.dtype)
    assert_close(layer(changed, mask)[0][:, :6], layer(x, mask)[0][:, :6], 1e-12, "prefix depends on the future")
    assert (layer(changed, mask)[0][:, 6:] - layer(x, mask)[0][:, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("mode", MODES)
def test_any_sequence_length(mode, n):
    """Sequences shorter than the window (sliding chunks pads internally; the kernels need nothing)."""
    cfg = tiny_config(attention_window=4, attention_mode=mode)
    x, mask = layer_inputs(3, 2, n, 32, pad_from=[n, max(n - 1, 1)], globals_=[(0, n - 1)])
    out, att, _ = copy_to(cfg, layer_for(cfg))(x, mask, output_attentions=True)
    expected = explicit_attention(layer_for(cfg), x, mask, 4, (1,) * 4, False)
    real = mask >= 0
    assert_close(out[real], expected[real], 1e-10, f"n={n}")
    assert att.shape == (2, 4, n, 1 + 9)


def test_layer_rejects_a_mask_of_the_wrong_shape():
    layer = layer_for(tiny_config(attention_window=2))
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, seq_len\] = \(2, 9\)"):
        layer(torch.zeros(2, 9, 32, dtype=torch.float64), torch.zeros(2, 1, 1, 9))


@pytest.mark.parametrize(
    "hidden_states, error, match",
    [
        (
            torch.zeros(9, 32, dtype=torch.float64),
            ValueError,
            r"hidden_states must be \[batch, seq_len, hidden_size = 32\], got shape \(9, 32\)",
        ),
        (torch.zeros(2, 9, 31, dtype=torch.float64), ValueError, r"hidden_size = 32\], got shape \(2, 9, 31\)"),
        (
            torch.zeros(2, 9, 32, dtype=torch.long),
            TypeError,
            "hidden_states must be a floating-point torch.Tensor, got torch.int64",
        ),
        ([[0.0] * 32], TypeError, "hidden_states must be a floating-point torch.Tensor, got list"),
        (
            torch.zeros(2, 9, 32, dtype=torch.float64, device="meta"),
            ValueError,
            "hidden_states must be on the layer's device cpu, got meta",
        ),
    ],
    ids=["2-D", "hidden-size", "integer", "list", "device"],
)
def test_layer_rejects_bad_hidden_states(hidden_states, error, match):
    layer = layer_for(tiny_config(attention_window=2))
    with pytest.raises(error, match=match):
        layer(hidden_states)


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_sequence(mode):
    """seq_len 0: an empty output (sliding chunks once failed viewing its chunks)."""
    cfg = tiny_config(attention_window=4, attention_mode=mode)
    out, att, gatt = layer_for(cfg)(torch.zeros(2, 0, 32, dtype=torch.float64), output_attentions=True)
    assert out.shape == (2, 0, 32) and att.shape == (2, 4, 0, 9) and gatt is None


def test_a_dilation_past_the_sequence_is_that_of_the_sequence():
    """A dilation of 2^31 - 1 reaches the same keys as one of n (each row's own only): the same
    outputs and attentions, with padding and a global token (the padded keys' flags were once padded
    by w * d each side: 34 GB here)."""
    x, mask = layer_inputs(5, 2, 20, 32, pad_from=[20, 15], globals_=[(0, 3)])
    results = []
    for dilation in (20, 2**31 - 1):
        cfg = tiny_config(attention_window=4, attention_dilation=dilation)
        results.append(layer_for(cfg)(x, mask, output_attentions=True))
    for got, expected in zip(*results):
        assert torch.equal(got, expected)


def test_no_global_tokens_and_no_mask():
    cfg = tiny_config(attention_window=2)
    x, _ = layer_inputs(4, 2, 9, 32)
    out, att, gatt = layer_for(cfg)(x, None, output_attentions=True)
    assert att.shape == (2, 4, 9, 5) and gatt is None
    expected = explicit_attention(layer_for(cfg), x, torch.zeros(2, 9, dtype=torch.long), 2, (1,) * 4, False)
    assert_close(out, expected, 1e-10, "no mask")


@pytest.mark.parametrize(
    "mode, dilation, autoregressive",
    [
        (AttentionMode.TVM, [1, 2, 1, 3], True),
        (AttentionMode.TVM, [2, 1, 1, 1], False),
        (AttentionMode.SLIDING_CHUNKS, [1, 1, 1, 1], False),
    ],
)
def test_gradients_match_full_mode(mode, dilation, autoregressive):
    cfg = tiny_config(attention_window=2, attention_dilation=[dilation], autoregressive=autoregressive)
    x, mask = layer_inputs(5, 2, 10, 32, pad_from=[10, 8], globals_=[(0, 3), (1, 0), (1, 6)])
    grads = {}
    for m in (mode, AttentionMode.FULL):
        layer = copy_to(cfg.replace(attention_mode=m), layer_for(cfg))
        xi = x.clone().requires_grad_()
        out, att, gatt = layer(xi, mask, output_attentions=True)
        weight = torch.linspace(-1, 1, out.numel(), dtype=x.dtype).view_as(out)
        ((out * weight).sum() + (att**2).sum() + gatt.sum()).backward()
        grads[m] = [xi.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(grads[mode], grads[AttentionMode.FULL], strict=True):
        assert_close(a, b, 1e-10, f"{mode} gradient")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tvm_layer(monkeypatch, dtype, half_gemm):
    """Half inputs (scores and probabilities in half, softmax accumulated in float32 by torch):
    close to the float32 result, no NaN/inf."""
    import longformer_ops.models.layer

    cfg = tiny_config(attention_window=3, attention_dilation=[[1, 2, 1, 1]])
    x, mask = layer_inputs(6, 2, 12, 32, dtype=torch.float32, pad_from=[12, 8], globals_=[(0, 1), (1, 5)])
    reference = layer_for(cfg, dtype=torch.float32)(x, mask, output_attentions=True)
    half = layer_for(cfg, dtype=dtype)(x.to(dtype), mask, output_attentions=True)
    real = mask >= 0
    # The same layer in the dense "full" mode and the same half type: plain torch ops, the bar. Ours
    # may err at most twice as much against float32 (flash-attn's rule), plus a few units roundoff.
    # (The bar's global rows project every row's keys and values, as transformers does; ours take the
    # slots' queries through the weights.)
    with monkeypatch.context() as patch:
        patch.setattr(longformer_ops.models.layer, "_global_rows_through_weights", lambda *_: False)
        dense = layer_for(
            tiny_config(attention_window=3, attention_dilation=[[1, 2, 1, 1]], attention_mode="full"), dtype=dtype
        )(x.to(dtype), mask, output_attentions=True)
    unit = torch.finfo(dtype).eps / 2
    assert half[0].dtype == dtype and half[1].dtype == dtype
    with torch.no_grad():  # no attentions asked for: one call, global keys merged by log-sum-exp
        merged = layer_for(cfg, dtype=dtype)(x.to(dtype), mask)[0]
    assert merged.dtype == dtype
    for what, ours, bar, exact in (
        ("out", half[0][real], dense[0][real], reference[0][real]),
        ("attentions", half[1], dense[1], reference[1]),
        ("merged out", merged[real], dense[0][real], reference[0][real]),
    ):
        error, bar_error = ((x.float() - exact).abs().max().item() for x in (ours, bar))
        assert error <= 2 * bar_error + 4 * unit * exact.abs().max().item(), (dtype, what, error, bar_error)


@pytest.mark.parametrize("mode", [AttentionMode.TVM, AttentionMode.SLIDING_CHUNKS])
@pytest.mark.parametrize(
    "pad_from, globals_",
    [(None, ()), ([9, 6], ()), (None, [(0, 4)]), ([9, 6], [(0, 4), (1, 2)])],
    ids=["plain", "padding", "global", "both"],
)
def test_inference_path_equals_the_autograd_path(mode, pad_from, globals_):
    """Without autograd the layer softmaxes in place and skips the key and padding fills when there
    is nothing to remove; outputs and attentions must not change by a bit."""
    cfg = tiny_config(
        attention_window=2,
        attention_mode=mode,
        attention_dilation=1 if mode is AttentionMode.SLIDING_CHUNKS else [[1, 2, 1, 3]],
    )
    x, mask = layer_inputs(4, 2, 9, 32, dtype=torch.float32, pad_from=pad_from, globals_=globals_)
    layer = layer_for(cfg, dtype=torch.float32)
    with torch.no_grad():
        inference = layer(x, mask, output_attentions=True)
    training = layer(x.clone().requires_grad_(), mask, output_attentions=True)
    for a, b in zip(inference, training, strict=True):
        assert (a is None and b is None) or torch.equal(a, b.detach())


@pytest.mark.parametrize("library", ["fused", "three-steps"])
@pytest.mark.parametrize(
    "pad_from, globals_",
    [
        (None, []),
        ([37, 21], []),
        (None, [(0, 4), (0, 30), (1, 2)]),
        ([37, 21], [(0, 4), (0, 30), (1, 2)]),
        # Example 1's global token (position 20) is padding, so it has none, and its rows from ~15 on
        # see no key at all (no band key, no global key).
        ([37, 5], [(0, 4), (0, 30), (1, 20)]),
    ],
    ids=["plain", "padding", "globals", "globals-padding", "keyless-rows"],
)
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_local_attention_is_one_call(monkeypatch, autoregressive, pad_from, globals_, library):
    """No attentions asked for: the layer runs one sliding_window_attention call (the fused kernels
    on CPU: no band product), padding and global keys masked out of the band, the global keys'
    columns merged in by the rows' log-sum-exp; outputs and gradients those of the band path.
    With globals example 1 has fewer than example 0 (an empty slot), and causal early rows see
    no global key."""
    import longformer_ops.models.layer
    import longformer_ops.runtime.kernels

    if library == "three-steps":  # a library without the fused kernels (the CUDA ones)
        monkeypatch.setattr(_loader.KernelLibrary, "has", lambda self, name: False)
    cfg = tiny_config(attention_window=3, attention_dilation=[[1, 2, 1, 3]], autoregressive=autoregressive)
    x, mask = layer_inputs(8, 2, 37, 32, pad_from=pad_from, globals_=globals_)
    layer = layer_for(cfg)
    xb = x.clone().requires_grad_()
    banded = layer(xb, mask, output_attentions=True)[0]  # the band path (attentions need the band)
    grad = torch.randn_like(banded)
    banded.backward(grad)
    monkeypatch.setattr(longformer_ops.models.layer, "diagonaled_mm", None)  # the layer's own band path would fail
    if library == "fused":
        monkeypatch.setattr(longformer_ops.runtime.kernels, "_band_kernel", None)  # so would any band product
    with torch.no_grad():
        merged = layer(x, mask)[0]
    assert_close(merged, banded.detach(), 1e-12, "one call vs banded")
    xm = x.clone().requires_grad_()
    layer(xm, mask)[0].backward(grad)
    assert_close(xm.grad, xb.grad, 1e-12, "gradient, one call vs banded")


@pytest.mark.parametrize("globals_", [[], [(0, 4), (1, 2)]], ids=["plain", "globals"])
def test_training_with_attention_dropout_is_one_call(monkeypatch, globals_):
    """Training with attention dropout takes the one-call path too (dropout in the fused kernels, the
    global columns' by torch), reproducibly under one torch seed, and dropout changes the result."""
    import longformer_ops.models.layer
    import longformer_ops.runtime.kernels

    cfg = tiny_config(attention_window=3, attention_dilation=[[1, 2, 1, 3]], attention_probs_dropout_prob=0.3)
    x, mask = layer_inputs(9, 2, 37, 32, pad_from=[37, 21], globals_=globals_)
    layer = layer_for(cfg).train()
    monkeypatch.setattr(longformer_ops.models.layer, "diagonaled_mm", None)
    monkeypatch.setattr(longformer_ops.runtime.kernels, "_band_kernel", None)
    runs = []
    for seed in (5, 5):
        torch.manual_seed(seed)
        xi = x.clone().requires_grad_()
        out = layer(xi, mask)[0]
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(xi.grad).all()
        runs.append((out.detach(), xi.grad))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    with torch.no_grad():
        assert not torch.allclose(runs[0][0], layer.eval()(x, mask)[0])


@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_attention_dropout_matches_the_definition(autoregressive):
    """Training-mode dropout, values and gradients, against the definition with the same masks: the
    band's from the fused kernels' generator (its seed the call's first draw from torch's generator),
    then torch's dropout of the global keys' columns [b, n, h, g], then of the global rows [b, h, g, n]."""
    from longformer_ops.ops.reference import dropout_factor_reference

    p, w, dilation = 0.3, 3, (1, 2, 1, 3)
    cfg = tiny_config(
        attention_window=w,
        attention_dilation=[list(dilation)],
        attention_probs_dropout_prob=p,
        autoregressive=autoregressive,
    )
    x, mask = layer_inputs(12, 2, 23, 32, pad_from=[23, 17], globals_=[(0, 4), (0, 9), (1, 2)])
    layer = layer_for(cfg).train()
    b, n, h, g = 2, 23, 4, 2
    torch.manual_seed(31)
    kernel_seed = int(torch.randint(0, 2**31 - 1, ()))
    global_keys = torch.nn.functional.dropout(torch.ones(b, n, h, g, dtype=torch.float64), p)
    global_rows = torch.nn.functional.dropout(torch.ones(b, h, g, n, dtype=torch.float64), p)
    band = dropout_factor_reference(kernel_seed, b, n, h, w + 1 if autoregressive else 2 * w + 1, p)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = explicit_attention(layer, xr, mask, w, dilation, autoregressive, (band, global_keys, global_rows))
    torch.manual_seed(31)
    out = layer(xo, mask)[0]
    assert_close(out, expected, 1e-12, "dropout output")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    out.backward(grad)
    expected.backward(grad)
    assert_close(xo.grad, xr.grad, 1e-12, "dropout input gradient")
    assert not torch.allclose(out, layer.eval()(x, mask)[0])  # the dropout did something


def test_band_gradient_is_not_copied_per_head():
    """Removing flagged keys from the band must be one masked fill, not one in-place fill per head:
    on a band that requires grad each of those makes autograd copy the whole band's gradient
    again (a CopySlices node per head: ~0.7 s of a 2.4 s forward+backward at n = 4096)."""
    cfg = tiny_config(attention_window=2, attention_dilation=[[1, 2, 1, 3]])
    x, mask = layer_inputs(3, 2, 9, 32, dtype=torch.float32, pad_from=[9, 6], globals_=[(0, 4)])
    out = layer_for(cfg, dtype=torch.float32)(x.requires_grad_(), mask)[0]
    seen, stack, names = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    assert "MaskedFillBackward0" in names and "CopySlices" not in names, sorted(set(names))


@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_global_tokens_do_not_copy_hidden_size_tensors(autoregressive):
    """The global tokens' paths (their keys' columns for every row, their own rows against every key)
    are g dot products per row and head: on the projections' own [b, n, h*d] layout, with no
    hidden-size copy, scatter or where in the training step. (Einsums batched over heads copied
    [b, n, h, d] to [b*h, n, d] and back, and a where over a scattered copy put the global rows back:
    ~5% of a bfloat16 layer step at n = 4096.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = tiny_config(
        attention_window=2,
        attention_dilation=[[1, 2, 1, 3]],
        attention_probs_dropout_prob=0.2,
        autoregressive=autoregressive,
    )
    x, mask = layer_inputs(5, 2, 19, 32, dtype=torch.float32, pad_from=[19, 11], globals_=[(0, 4), (0, 9), (1, 2)])
    layer = layer_for(cfg, dtype=torch.float32).train()
    hidden_size = x.numel()

    class BigOps(TorchDispatchMode):
        names: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(
                isinstance(o, torch.Tensor) and o.numel() >= hidden_size
                for o in (out if isinstance(out, (tuple, list)) else [out])
            ):
                self.names.add(func.overloadpacket.__name__)
            return out

    with BigOps() as seen:
        out = layer(x.requires_grad_(), mask)[0]
        out.sum().backward()
    assert "attention_backward" in seen.names  # (the fused path ran and was seen)
    copies = seen.names & {"clone", "copy_", "contiguous", "scatter", "scatter_add", "where", "_to_copy"}
    assert not copies, sorted(seen.names)


@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("output_attentions", [False, True], ids=["merged", "banded"])
def test_many_global_tokens_take_the_einsum(monkeypatch, autoregressive, output_attentions):
    """Past BLOCK_DIAGONAL_SLOTS global slots the products with them are einsums (the block-diagonal
    matmul's h-fold work would cost more than the einsum's copies): the same outputs and gradients."""
    import longformer_ops.models.layer

    cfg = tiny_config(attention_window=2, attention_dilation=[[1, 2, 1, 3]], autoregressive=autoregressive)
    x, mask = layer_inputs(8, 2, 19, 32, pad_from=[19, 11], globals_=[(0, 4), (0, 9), (1, 2)])
    layer = layer_for(cfg)
    results = []
    for slots in (longformer_ops.models.layer.BLOCK_DIAGONAL_SLOTS, 0):
        monkeypatch.setattr(longformer_ops.models.layer, "BLOCK_DIAGONAL_SLOTS", slots)
        xi = x.clone().requires_grad_()
        out = layer(xi, mask, output_attentions=output_attentions)
        out[0].backward(torch.randn(out[0].shape, generator=torch.Generator().manual_seed(3), dtype=out[0].dtype))
        results.append([out[0].detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad()
    for name, a, b in zip(["out", "input gradient"] + [n for n, _ in layer.named_parameters()], *results, strict=True):
        assert_close(a, b, 1e-12, name)


@pytest.mark.parametrize("dropout", [0.0, 0.4], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
def test_global_rows_through_the_weights_or_projected(monkeypatch, autoregressive, dropout):
    """The global rows' two ways (keys and values of every row projected, or the slots' queries through
    the key weights and the probabilities through the value weights): the same outputs, input and
    parameter gradients, each equal to the explicit definition's output."""
    import longformer_ops.models.layer

    cfg = tiny_config(
        attention_window=2,
        attention_dilation=[[1, 2, 1, 3]],
        autoregressive=autoregressive,
        attention_probs_dropout_prob=dropout,
    )
    x, mask = layer_inputs(9, 2, 17, 32, pad_from=[17, 12], globals_=[(0, 3), (0, 10), (1, 5)])
    layer = layer_for(cfg).train(dropout > 0)
    results = []
    for through_weights in (True, False):
        monkeypatch.setattr(longformer_ops.models.layer, "_global_rows_through_weights", lambda *_: through_weights)
        xi = x.clone().requires_grad_()
        torch.manual_seed(11)  # the same dropout masks both ways
        out, _, global_probs = layer(xi, mask, output_attentions=dropout > 0)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype))
        results.append([out.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad()
        if dropout == 0:
            expected = explicit_attention(layer_for(cfg), x, mask, 2, (1, 2, 1, 3), autoregressive)
            real = mask >= 0
            assert_close(out[real], expected[real], 1e-10, f"through_weights={through_weights} vs explicit")
    names = ["out", "input gradient"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, *results, strict=True):
        if name in ("key.bias", "key_global.bias"):  # softmax over the keys ignores them: 0 up to roundoff
            assert a.abs().max() < 1e-12 and b.abs().max() < 1e-12, name
            continue
        assert_close(a, b, 1e-12, name)
        assert b.abs().max() > 1e-3, f"{name}: (almost) zero, the comparison says nothing"


def test_wrapped_projections_are_called():
    """A query or global projection that is not a plain nn.Linear (a LoRA adapter, a quantized layer:
    its output is more than its weight tells) is called, not read through its weight."""

    class Adapted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 0.5 * torch.tanh(x)

    cfg = tiny_config(attention_window=2)
    x, mask = layer_inputs(3, 2, 13, 32, pad_from=[13, 9], globals_=[(0, 4), (1, 2)])
    layer = layer_for(cfg)
    for name in ("query", "key_global", "value_global"):
        adapted = Adapted(32, 32).to(torch.float64)
        adapted.load_state_dict(getattr(layer, name).state_dict())
        setattr(layer, name, adapted)
    expected = explicit_attention(layer, x, mask, 2, (1,) * 4, False)
    real = mask >= 0
    assert_close(layer(x, mask)[0][real], expected[real], 1e-10, "adapted global projections")


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_query_scale_in_the_weights_is_exact_for_head_dim_64(grad_enabled):
    """The query's 1/sqrt(64) = 1/8 folded into a plain nn.Linear's weight and bias gives
    query(x) / 8 bit for bit (a power of two scales every rounding exactly)."""
    torch.manual_seed(4)
    layer = layer_for(tiny_config(attention_window=2, hidden_size=128, num_attention_heads=2), dtype=torch.float32)
    assert layer.head_dim == 64
    x = torch.randn(2, 11, 128)
    with torch.set_grad_enabled(grad_enabled):
        assert torch.equal(layer._scaled_query(x, not grad_enabled), layer.query(x) / 8)


def test_dropout_in_training_mode():
    cfg = tiny_config(attention_window=2, attention_probs_dropout_prob=0.5)
    layer = layer_for(cfg, dtype=torch.float32).train()
    x, mask = layer_inputs(7, 2, 9, 32, dtype=torch.float32, globals_=[(0, 4)])
    torch.manual_seed(0)
    out1 = layer(x, mask)[0]
    out2 = layer(x, mask)[0]
    assert not torch.equal(out1, out2)
    out1.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
    layer.eval()
    assert torch.equal(layer(x, mask)[0], layer(x, mask)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_layer_on_cuda_matches_cpu(mode, dtype):
    cfg = tiny_config(
        attention_window=3,
        attention_mode=mode,
        attention_dilation=1 if mode is AttentionMode.SLIDING_CHUNKS else [[1, 2, 1, 3]],
    )
    x, mask = layer_inputs(8, 2, 14, 32, dtype=torch.float32, pad_from=[14, 9], globals_=[(0, 3), (1, 1), (1, 6)])
    cpu = layer_for(cfg, dtype=torch.float32)
    expected = cpu(x, mask, output_attentions=True)
    cuda = copy_to(cfg, cpu).cuda().to(dtype)
    out = cuda(x.cuda().to(dtype), mask.cuda(), output_attentions=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    real = mask >= 0
    scale = expected[0].abs().max().item()
    assert_close(out[0].float().cpu()[real], expected[0][real], tol * scale, f"{mode} {dtype} output")
    for i in (1, 2):
        assert_close(out[i].float().cpu(), expected[i], tol, f"{mode} {dtype} attentions {i}")


@pytest.mark.parametrize("with_grad", [False, True], ids=["in-blocks", "autograd"])
@pytest.mark.parametrize("autoregressive", [False, True])
@pytest.mark.parametrize(
    "n, w, dilation",
    [
        (1, 0, (1,)),
        (9, 3, (1, 2, 5)),
        (40, 7, (3, 1, 9, 2)),
        (17, 4, (2, 2, 2)),
        (30, 5, (1, 1, 1, 1)),
        (1700, 20, (1, 8, 3)),
        (1300, 9, (2, 2)),
    ],
)
def test_fill_band_at_keys_matches_an_explicit_gather(n, w, dilation, autoregressive, with_grad):
    from longformer_ops.ops.diagonaled import fill_band_at_keys_
    from longformer_ops.runtime.band import key_positions

    flags = torch.rand(2, n, generator=torch.Generator().manual_seed(n)) < 0.3
    if n > 1000:  # sparse, as padding and global tokens are: most row blocks have nothing to fill
        flags = torch.zeros(2, n, dtype=torch.bool)
        flags[0, [0, n // 2]] = True
        flags[1, n - 30 :] = True
    keys = key_positions(n, w, torch.tensor(dilation), autoregressive)  # [n, h, c]
    inside = (keys >= 0) & (keys < n)
    expected = flags[:, keys.clamp(0, n - 1)] & inside
    leaf = torch.zeros(expected.shape, requires_grad=with_grad)
    band = leaf.clone()
    with torch.set_grad_enabled(with_grad):
        assert fill_band_at_keys_(band, flags, w, dilation, autoregressive, 1.0) is band
    assert torch.equal(band.detach().bool(), expected)
    if with_grad:  # gradient 0 exactly at the filled positions, passed through elsewhere
        upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
        (grad,) = torch.autograd.grad(band, leaf, upstream)
        assert torch.equal(grad, upstream.masked_fill(expected, 0))


def test_fill_band_at_keys_compiles():
    """Traced as one graph without autograd (every block filled, no host sync) and with it (the
    custom function), giving eager's result and gradient."""
    from longformer_ops.ops.diagonaled import fill_band_at_keys_

    flags = torch.zeros(2, 1100, dtype=torch.bool)
    flags[0, 3] = flags[1, 1050] = True

    def filled_sum(x):
        return fill_band_at_keys_(x * 2, flags, 5, (1, 3), False, -1.0).square().sum()

    x = torch.randn(2, 1100, 2, 11, requires_grad=True)
    eager = filled_sum(x)
    (eager_grad,) = torch.autograd.grad(eager, x)
    compiled = torch.compile(filled_sum)(x)
    (compiled_grad,) = torch.autograd.grad(compiled, x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_grad, eager_grad)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(filled_sum, fullgraph=True)(x), eager)
