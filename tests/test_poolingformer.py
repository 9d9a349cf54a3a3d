"""Poolingformer: pooling (mean, max, LDConv) and pooling attention against the plain references
(pools built one by one, dense attention with an explicit mask), their gradients in float64, the
layer against level 1's reference plus level 2's, the config, and a Longformer checkpoint loaded
into a Poolingformer."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import CPU_DTYPES, assert_normwise_close, stable_seed
from hf_helpers import random_batch, single_thread

from longformer_ops import (
    AttentionMode,
    LongformerConfig,
    LongformerModel,
    PoolingConfig,
    PoolingformerSelfAttention,
    from_hf_pretrained,
)
from longformer_ops.models.layer import LongformerSelfAttention
from longformer_ops.models.pooling import num_pools, pool_centres, pool_sequence, pool_then_project, pooling_attention
from longformer_ops.ops.reference import pool_sequence_reference, pooling_attention_reference

_ = single_thread  # autouse fixture
KINDS = ["mean", "max", "ldconv"]
# (n, kernel_size, stride, window): n not a multiple of the stride or of the window, k < s, k = s,
# k > s, a window of 0, windows near and beyond n, stride 1 (every position a pool).
SIZES = [
    (1, 1, 1, 0),
    (13, 3, 2, 4),
    (23, 4, 4, 9),
    (31, 5, 3, 7),
    (40, 2, 3, 0),
    (29, 4, 2, 28),
    (17, 3, 5, 40),
    (50, 1, 1, 3),
]


def _case(n, kernel_size, stride, dtype=torch.float64, padded=True, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(stable_seed(n, kernel_size, stride, seed))
    b, h, d = 2, 3, 8
    m = num_pools(n, stride)
    x, v, q = (
        torch.randn(b, n, h, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
        for _ in range(3)
    )
    logits = (2 * torch.randn(b, m, h, kernel_size, generator=gen, dtype=torch.float64)).requires_grad_(requires_grad)
    is_padding = torch.zeros(b, n, dtype=torch.bool)
    if padded:
        is_padding[1, max(1, n - 6) :] = True  # the second example's tail is padding
    return q, x, v, logits, is_padding


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,kernel_size,stride,window", SIZES)
def test_pool_sequence_matches_the_reference(n, kernel_size, stride, window, kind):
    _, x, _, logits, is_padding = _case(n, kernel_size, stride)
    got, valid = pool_sequence(x, kernel_size, stride, kind, is_padding, logits)
    expected, expected_valid = pool_sequence_reference(x, kernel_size, stride, kind, is_padding, logits)
    assert torch.equal(valid, expected_valid)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["mean", "ldconv"])
@pytest.mark.parametrize("n,kernel_size,stride,window", SIZES)
def test_pooling_the_input_then_projecting_is_projecting_then_pooling(n, kernel_size, stride, window, kind):
    """pool_then_project (the layer's cheap order) against pool_sequence of the projections, padding included."""
    gen = torch.Generator().manual_seed(stable_seed(n, kernel_size, stride, kind))
    _, _, _, logits, is_padding = _case(n, kernel_size, stride)
    y = torch.randn(2, n, 24, generator=gen, dtype=torch.float64)
    projections = [torch.nn.Linear(24, 24).double() for _ in range(2)]
    got, valid = pool_then_project(y, projections, 3, kernel_size, stride, kind, is_padding, logits)
    for projection, pooled in zip(projections, got, strict=True):
        expected, expected_valid = pool_sequence(
            projection(y).view(2, n, 3, 8), kernel_size, stride, kind, is_padding, logits
        )
        assert torch.equal(valid, expected_valid)
        torch.testing.assert_close(pooled, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("autoregressive", [False, True], ids=["two-sided", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("n,kernel_size,stride,window", SIZES)
def test_pooling_attention_matches_the_reference(n, kernel_size, stride, window, dtype, autoregressive):
    """Every dtype on the kernels against the float64 dense reference on the same rounded inputs."""
    q, x, v, logits, is_padding = _case(n, kernel_size, stride, dtype)
    pooled_k, valid = pool_sequence(x, kernel_size, stride, "mean", is_padding)
    pooled_v, _ = pool_sequence(v, kernel_size, stride, "max", is_padding)
    got = pooling_attention(
        q, pooled_k, pooled_v, window, kernel_size, stride, pool_valid=valid, autoregressive=autoregressive
    )
    assert got.dtype == dtype
    expected = pooling_attention_reference(
        q.double(), pooled_k.double(), pooled_v.double(), window, kernel_size, stride, valid, autoregressive
    )
    assert_normwise_close(
        got,
        expected,
        dtype,
        f"pooling attention n={n} k={kernel_size} s={stride} w={window}",
        zero_scale=float(pooled_v.double().norm()),
    )


def test_the_reference_comparison_sees_a_window_off_by_one():
    """The grid above is sensitive: one token more of window, or a causal mask one pool late, differs."""
    q, x, v, _, is_padding = _case(31, 5, 3)
    pooled_k, valid = pool_sequence(x, 5, 3, "mean", is_padding)
    pooled_v, _ = pool_sequence(v, 5, 3, "mean", is_padding)
    for ours, theirs in (((7, False), (8, False)), ((7, True), (7, False))):
        got = pooling_attention(q, pooled_k, pooled_v, ours[0], 5, 3, pool_valid=valid, autoregressive=ours[1])
        other = pooling_attention_reference(q, pooled_k, pooled_v, theirs[0], 5, 3, valid, theirs[1])
        assert (got - other).norm() > 1e-3 * other.norm()


@pytest.mark.parametrize("autoregressive", [False, True], ids=["two-sided", "causal"])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_through_pooling_and_attention(kind, autoregressive):
    """float64 gradcheck of pooling (LDConv's logits included) then pooling attention, with padding."""
    q, x, v, logits, is_padding = _case(11, 3, 2, requires_grad=True)

    def level2(q, x, v, logits):
        pooled_k, valid = pool_sequence(x, 3, 2, kind, is_padding, logits)
        pooled_v, _ = pool_sequence(v, 3, 2, kind, is_padding, logits)
        return pooling_attention(q, pooled_k, pooled_v, 3, 3, 2, pool_valid=valid, autoregressive=autoregressive)

    inputs = (q, x, v, logits) if kind == "ldconv" else (q, x, v)
    assert torch.autograd.gradcheck(lambda *args: level2(*args, *((logits,) if kind != "ldconv" else ())), inputs)


def test_bad_pooling_arguments_are_named():
    q, x, v, logits, _ = _case(13, 3, 2)
    with pytest.raises(ValueError, match="kind .pooling. must be one of"):
        pool_sequence(x, 3, 2, "median")
    with pytest.raises(ValueError, match=r"ldconv_logits must be \[batch, pools, heads, kernel_size\]"):
        pool_sequence(x, 3, 2, "ldconv", None, logits[..., :2])
    with pytest.raises(ValueError, match="pooled_k and pooled_v must be"):
        pooling_attention(q, x, x, 4, 3, 2)
    for field, value, message in (
        ("kind", "median", "pooling kind must be one of"),
        ("stride", 0, "pooling stride must be an int >= 1"),
        ("window", -1, "pooling window must be an int >= 0"),
        ("layers", [5], r"pooling layers must be in \[0, num_hidden_layers=4\)"),
    ):
        with pytest.raises((ValueError, TypeError), match=message):
            LongformerConfig(num_hidden_layers=4, pooling={field: value})


def test_config_defaults_to_the_top_quarter():
    assert LongformerConfig(num_hidden_layers=12, pooling=PoolingConfig()).pooling.layers == [9, 10, 11]
    assert LongformerConfig(num_hidden_layers=2, pooling={}).pooling.layers == [1]
    config = LongformerConfig(num_hidden_layers=3, pooling={"layers": [0, 2]})
    assert [config.is_pooling_layer(i) for i in range(3)] == [True, False, True]
    with pytest.raises(ValueError, match="transformers has no Poolingformer layers"):
        config.to_hf()


def _layer_config(kind, autoregressive=False, dilation=1):
    return LongformerConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=1,
        attention_window=3,
        attention_dilation=dilation,
        autoregressive=autoregressive,
        attention_probs_dropout_prob=0.0,
        pooling=dict(window=9, kernel_size=4, stride=3, kind=kind),
    )


@pytest.mark.parametrize("autoregressive", [False, True], ids=["two-sided", "causal"])
@pytest.mark.parametrize("kind", KINDS)
def test_layer_is_level_one_plus_level_two(kind, autoregressive):
    """The layer against its definition: level 1 by the Longformer layer's dense reference mode
    (global tokens, padding, per-head dilation), level 2 by the references on level 1's output, LDConv's
    logits read at each pool's centre token; forward and every parameter's gradient, float64."""
    config = _layer_config(kind, autoregressive, dilation=[[1, 2, 1, 3]])
    layer = PoolingformerSelfAttention(config, 0).double()
    gen = torch.Generator().manual_seed(stable_seed(kind, autoregressive))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    b, n = 2, 26
    hidden = torch.randn(b, n, 32, generator=gen, dtype=torch.float64)
    mask = torch.zeros(b, n)
    mask[0, 5] = mask[1, 0] = 1  # global tokens
    mask[1, 20:] = -1  # padding

    def reference():
        layer.attention_mode = AttentionMode.FULL  # level 1: the Longformer layer's dense mode, same parameters
        y = LongformerSelfAttention.forward(layer, hidden, mask)[0]
        layer.attention_mode = AttentionMode.TVM
        is_padding = mask < 0
        m = num_pools(n, 3)
        centres = [min(j * 3 + (4 - 1) // 2, n - 1) for j in range(m)]  # each pool's centre token
        logits = layer.ldconv(y[:, centres]).view(b, m, 4, 4) if kind == "ldconv" else None

        def heads(t):
            return t.view(b, -1, 4, 8)

        pooled_k, valid = pool_sequence_reference(heads(layer.key2(y)), 4, 3, kind, is_padding, logits)
        pooled_v, _ = pool_sequence_reference(heads(layer.value2(y)), 4, 3, kind, is_padding, logits)
        z = pooling_attention_reference(heads(layer.query2(y)), pooled_k, pooled_v, 9, 4, 3, valid, autoregressive)
        return y + z.reshape(b, n, 32).masked_fill(is_padding[..., None], 0)

    weights = torch.randn(b, n, 32, generator=gen, dtype=torch.float64)
    results = []
    for compute in (lambda: layer(hidden, mask)[0], reference):
        layer.zero_grad()
        out = compute()
        (out * weights).sum().backward()
        results.append([out.detach()] + [p.grad.clone() for p in layer.parameters()])
    names = ["output"] + [name for name, _ in layer.named_parameters()]
    for name, got, expected in zip(names, *results, strict=True):
        if name in ("key.bias", "key_global.bias", "key2.bias"):
            # Adds q.b to every score of a row: softmax does not change, the gradient is 0 up to roundoff.
            assert got.abs().max() < 1e-10 and expected.abs().max() < 1e-10, name
            continue
        assert_normwise_close(
            got, expected, torch.float64, f"{kind} layer: {name}", zero_scale=1.0, gradients=name != "output"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_layer_in_lower_precision(dtype, half_gemm):
    """In float32 and the half types the layer errs against float64 at most twice as much as the same
    computation through the dense references in that dtype (plus a few units roundoff)."""
    config = _layer_config("ldconv")
    layer = PoolingformerSelfAttention(config, 0).double().eval()
    gen = torch.Generator().manual_seed(stable_seed(str(dtype)))
    hidden = torch.randn(2, 40, 32, generator=gen, dtype=torch.float64)
    mask = torch.zeros(2, 40)
    mask[0, 7] = 1
    mask[1, 33:] = -1
    with torch.no_grad():
        exact = layer(hidden, mask)[0]
        low = layer.to(dtype)
        ours = low(hidden.to(dtype), mask)[0].double()
        low.attention_mode = AttentionMode.FULL
        dense = low(hidden.to(dtype), mask)[0].double()  # both levels by the dense references: the yardstick
    error, their_error = ((x - exact).norm().item() for x in (ours, dense))
    unit = torch.finfo(dtype).eps / 2
    assert error <= 2 * their_error + 4 * unit * exact.norm().item(), (error, their_error)


def test_training_dropout_reaches_level_two():
    """Attention dropout applies to level 2 too: with p = 1 nothing passes at either level."""
    config = _layer_config("mean").replace(attention_probs_dropout_prob=0.999)
    layer = PoolingformerSelfAttention(config, 0).train()
    hidden = torch.randn(1, 30, 32)
    with torch.no_grad():
        layer.dropout = 1.0
        assert torch.equal(layer(hidden)[0], torch.zeros(1, 30, 32))
        layer.dropout = 0.3
        first, second = layer(hidden)[0], layer(hidden)[0]
        layer.eval()
        undropped = layer(hidden)[0]
    assert not torch.equal(first, second) and not torch.equal(first, undropped)


def test_a_longformer_checkpoint_loads_into_a_poolingformer(tmp_path):
    """transformers' Longformer checkpoint into a Poolingformer (top quarter): the Longformer weights load,
    level 2's are new and named in a warning; with value2 zeroed (level 2 adds nothing) the model is
    transformers' Longformer."""
    transformers = pytest.importorskip("transformers")
    from hf_helpers import hf_config, randomize_

    hf_model = randomize_(transformers.LongformerModel(hf_config([8, 8, 8, 8])), 0).eval()
    hf_model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "longformer"
    with pytest.warns(UserWarning, match="newly initialized .Poolingformer's level 2") as caught:
        model = from_hf_pretrained(
            tmp_path, LongformerModel, pooling=dict(window=16, kernel_size=4, stride=4, kind="ldconv")
        )
    message = str(next(w.message for w in caught if "level 2" in str(w.message)))
    assert "encoder.layer.3.attention.self.query2.weight" in message and "layer.2." not in message
    assert isinstance(model.encoder.layer[3].attention.self, PoolingformerSelfAttention)
    assert not isinstance(model.encoder.layer[2].attention.self, PoolingformerSelfAttention)
    ids, attention_mask, global_mask = random_batch(2, [30, 21], 97, [1, 0])
    with torch.no_grad():
        changed = model(ids, attention_mask, global_mask).last_hidden_state
        model.encoder.layer[3].attention.self.value2.weight.zero_()
        model.encoder.layer[3].attention.self.value2.bias.zero_()
        ours = model(ids, attention_mask, global_mask).last_hidden_state
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = hf_model(
                input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask
            ).last_hidden_state
    real = attention_mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-4, atol=1e-4)
    assert (changed[real] - theirs[real]).abs().max() > 1e-2  # level 2 did add something before


@pytest.mark.parametrize("autoregressive", [False, True], ids=["two-sided", "causal"])
def test_poolingformer_model_trains(autoregressive):
    """A whole model with Poolingformer layers: finite gradients for every parameter (level 2's
    included), and a causal model's outputs never read later tokens."""
    config = LongformerConfig(
        vocab_size=97,
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        attention_window=2,
        max_position_embeddings=80,
        autoregressive=autoregressive,
        pooling=dict(window=12, kernel_size=3, stride=2, kind="ldconv"),
    )
    model = LongformerModel(config, add_pooling_layer=False)
    ids = torch.randint(3, 97, (2, 41))
    global_mask = torch.zeros_like(ids)
    global_mask[:, 0] = 1
    out = model(ids, global_attention_mask=global_mask).last_hidden_state
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.encoder.layer[1].attention.self.query2.weight.grad.abs().sum() > 0
    if autoregressive:
        changed = ids.clone()
        changed[:, 30:] = 5
        with torch.no_grad():
            model.eval()
            before, after = (model(x, global_attention_mask=global_mask).last_hidden_state for x in (ids, changed))
        torch.testing.assert_close(after[:, :30], before[:, :30], rtol=1e-5, atol=1e-5)
        assert (after[:, 30:] - before[:, 30:]).abs().max() > 1e-3


def test_pool_centres():
    assert pool_centres(10, 4, 3).tolist() == [1, 4, 7, 9]
    assert pool_centres(1, 1, 1).tolist() == [0]
    assert pool_centres(7, 5, 2).tolist() == [2, 4, 6, 6]


def test_level_two_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) of pooling and pooling attention (the index bookkeeping is
    Python over static sizes): the same result and gradients as eager."""
    q, x, v, logits, is_padding = _case(23, 4, 3, dtype=torch.float32, requires_grad=True)

    def level2(q, x, v, logits):
        pooled_k, valid = pool_sequence(x, 4, 3, "ldconv", is_padding, logits)
        pooled_v, _ = pool_sequence(v, 4, 3, "ldconv", is_padding, logits)
        return pooling_attention(q, pooled_k, pooled_v, 7, 4, 3, pool_valid=valid, autoregressive=True)

    logits = logits.float().detach().requires_grad_()
    results = []
    for function in (level2, torch.compile(level2, fullgraph=True)):
        out = function(q, x, v, logits)
        results.append([out, *torch.autograd.grad(out.square().sum(), (q, x, v, logits))])
    for got, expected in zip(*reversed(results), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
