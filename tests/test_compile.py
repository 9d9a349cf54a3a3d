"""The ops under torch.compile, torch.library.opcheck and torch.export.

Every kernel entry is a custom op (``torch.ops.longformer_ops.*``) with a fake implementation and
its autograd registered on the op, so the compiler traces through the public functions as one
graph. Compiled results are compared with eager ones on the same inputs (float64 where the
comparison must be tight: compilation reorders the torch ops around our kernels).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from conftest import without_kernels
from torch._inductor import config as inductor_config

from longformer_ops import (
    LongformerConfig,
    LongformerForMaskedLM,
    LongformerModel,
    LongformerSelfAttention,
    band_softmax_,
    diagonaled_mm,
    mask_invalid_locations,
    sliding_window_attention,
)
from longformer_ops.runtime import kernels
from longformer_ops.runtime.kernels import accumulation_dtype

ops = torch.ops.longformer_ops
W, DILATION = 4, [1, 2, 3, 1]  # per-head dilations, one-sided window 4: reach 12 rows


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(seed, n, b=2, h=4, f=40, dtype=torch.float64, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, f, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


def two_step(q, k, v, autoregressive=False, d=DILATION):
    """The original API's attention: Q.K^T band, mask, softmax, probs.V."""
    scores = diagonaled_mm(q, k, W, d, False, 0.0, autoregressive)
    mask_invalid_locations(scores, W, d, autoregressive)
    return diagonaled_mm(scores.softmax(-1), v, W, d, True, 0.0, autoregressive)


def local_attention(q, k, v, key_padding_mask, dropout_p=0.0, autoregressive=False):
    out, lse = sliding_window_attention(
        q, k, v, W, DILATION, autoregressive, key_padding_mask=key_padding_mask, dropout_p=dropout_p, return_lse=True
    )
    return out * torch.sigmoid(lse)[..., None]  # lse's gradient flows too


def _values_and_grads(fn, inputs, *args, seed=0):
    torch.manual_seed(seed)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves, *args)
    out.backward(torch.ones_like(out) + torch.arange(out.shape[1], dtype=out.dtype)[None, :, None, None] / 7)
    return [out.detach()] + [x.grad for x in leaves]


def _assert_same(compiled, eager, atol):
    for name, a, e in zip(["out", "grad q", "grad k", "grad v"], compiled, eager):
        torch.testing.assert_close(a, e, atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


def test_kernel_decisions_carry_torchs_constant_mark():
    """The availability decisions are marked for Dynamo without importing it (kernels.py): the mark
    must be the one ``torch.compiler.assume_constant_result`` sets, or Dynamo would trace the loader."""

    def decision():
        return True

    torch.compiler.assume_constant_result(decision)
    assert vars(decision) == {"_dynamo_marked_constant": True}, vars(decision)
    for marked in (kernels.has_family,):
        assert {key: vars(marked)[key] for key in vars(decision)} == vars(decision)


@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize("fn", ["two_step", "local_attention"])
def test_fullgraph_matches_eager(fn, autoregressive):
    """One graph, no break, for forward and backward; values and gradients those of eager."""
    q, k, v = _inputs(1, 37)
    mask = torch.zeros(2, 37, dtype=torch.bool)
    mask[1, 30:] = True
    args = (autoregressive,) if fn == "two_step" else (mask, 0.0, autoregressive)
    fn = globals()[fn]
    explanation = torch._dynamo.explain(fn)(q, k, v, *args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(fn, fullgraph=True)
    _assert_same(_values_and_grads(compiled, (q, k, v), *args), _values_and_grads(fn, (q, k, v), *args), 1e-12)


def _softmax_steps(q, k, v, d, autoregressive, key_padding_mask):
    """Q.K^T band, the band softmax in place (keys of ``key_padding_mask`` removed), probs.V."""
    scores = diagonaled_mm(q * 0.5, k, W, d, False, 0.0, autoregressive)
    probs = band_softmax_(scores, W, d, autoregressive, key_padding_mask=key_padding_mask)
    return diagonaled_mm(probs, v, W, d, True, 0.0, autoregressive)


def _tensor_dilation_fns():
    return {
        "two_step": lambda q, k, v, d, ar, mask: two_step(q, k, v, ar, d=d),
        "band_softmax_": _softmax_steps,
        "local_attention": lambda q, k, v, d, ar, mask: sliding_window_attention(
            q, k, v, W, d, ar, key_padding_mask=mask
        ),
    }


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("autoregressive", [False, True], ids=["symmetric", "causal"])
@pytest.mark.parametrize(
    "fn, softmax",
    [
        ("two_step", "torch.softmax"),
        ("band_softmax_", "kernel"),
        ("band_softmax_", "torch_ops"),
        ("local_attention", "kernel"),
        ("local_attention", "torch_ops"),
    ],
)
def test_dilations_as_a_tensor_compile_fullgraph(fn, softmax, autoregressive, index_dtype, monkeypatch):
    """The original API's dilations, a tensor of one int per head: one graph, no break, dynamic shapes,
    forward and backward those of eager; the values read where the compiled code runs (another tensor
    needs no recompilation, and gives its own result). ``softmax``: the band softmax kernel, or torch's
    ops where a library has none (as on CUDA)."""
    if softmax == "torch_ops":
        without_kernels(monkeypatch, "band_softmax", "attention")
    q, k, v = _inputs(7, 41)
    mask = torch.zeros(2, 41, dtype=torch.bool)
    mask[1, 33:] = True
    mask[0, 5] = True
    function = _tensor_dilation_fns()[fn]
    d = torch.tensor(DILATION, dtype=index_dtype)
    explanation = torch._dynamo.explain(function)(q, k, v, d, autoregressive, mask)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(function, backend=counter, fullgraph=True, dynamic=True)
    compilations = []
    for dilations in (DILATION, [3, 1, 1, 2]):
        d = torch.tensor(dilations, dtype=index_dtype)
        _assert_same(
            _values_and_grads(compiled, (q, k, v), d, autoregressive, mask),
            _values_and_grads(function, (q, k, v), d, autoregressive, mask),
            1e-12,
        )
        compilations.append(counter.frame_count)
    assert compilations[1] == compilations[0], compilations


@pytest.mark.parametrize("fn", ["two_step", "band_softmax_", "local_attention"])
def test_compiled_tensor_dilations_are_checked_when_run(fn):
    """A dilation tensor's values are data: checked where the compiled code runs, with the message of eager."""
    q, k, v = _inputs(8, 30, requires_grad=False)
    compiled = torch.compile(_tensor_dilation_fns()[fn], fullgraph=True)
    compiled(q, k, v, torch.tensor(DILATION), False, None)
    for bad in ([1, 0, 2, 1], [1, -3, 1, 1]):
        with pytest.raises((ValueError, RuntimeError), match=r"d \(dilation\) values must be in \[1, 2147483647\]"):
            compiled(q, k, v, torch.tensor(bad), False, None)
    # (raised while tracing: under fullgraph Dynamo reports it as an exception of its own, with this message)
    with pytest.raises(
        (ValueError, RuntimeError), match=r"d \(dilation\) must have one value per head: expected length 4, got 3"
    ):
        compiled(q, k, v, torch.tensor([1, 2, 3]), False, None)


def test_dynamic_lengths_compile_once():
    """dynamic=True: several sequence lengths, one compilation (no recompile per length)."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(local_attention, backend=counter, fullgraph=True, dynamic=True)
    compilations = []
    for n in (29, 37, 64, 101):
        q, k, v = _inputs(n, n)
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[0, n - 3 :] = True
        _assert_same(
            _values_and_grads(compiled, (q, k, v), mask), _values_and_grads(local_attention, (q, k, v), mask), 1e-12
        )
        compilations.append(counter.frame_count)
    assert compilations[0] > 0 and len(set(compilations)) == 1, f"compilations after each length: {compilations}"


def test_compiled_dropout_is_eagers_dropout():
    """With torch's RNG kept (inductor's fallback_random), the compiled call draws the same seed as eager,
    so the same mask, in the forward and regenerated in the backward; and the dropout is real."""
    q, k, v = _inputs(2, 45)
    mask = torch.zeros(2, 45, dtype=torch.bool)
    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(local_attention, fullgraph=True)
        got = _values_and_grads(compiled, (q, k, v), mask, 0.3, seed=11)
    _assert_same(got, _values_and_grads(local_attention, (q, k, v), mask, 0.3, seed=11), 1e-12)
    undropped = _values_and_grads(local_attention, (q, k, v), mask, 0.0)
    assert (got[0] - undropped[0]).abs().max() > 0.1


def test_compiled_dropout_without_fallback_random_is_reproducible():
    """Inductor's own RNG: another mask than eager, but one torch.manual_seed reproduces it."""
    q, k, v = _inputs(3, 45)
    mask = torch.zeros(2, 45, dtype=torch.bool)
    compiled = torch.compile(local_attention, fullgraph=True)
    first, second = (_values_and_grads(compiled, (q, k, v), mask, 0.3, seed=5) for _ in range(2))
    _assert_same(first, second, 0)
    assert (first[0] - _values_and_grads(local_attention, (q, k, v), mask, 0.0)[0]).abs().max() > 0.1


# ----------------------------------------------------------------------------- opcheck
def _band(seed, b, n, h, c, dtype):
    return torch.randn(b, n, h, c, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _opcheck_cases(dtype, device="cpu"):
    """(op, args) for every op on awkward sizes: odd length, head_dim 40 (padded to 32's multiple),
    per-head dilation, window beyond the sequence, both modes. On CUDA the band ops only (its
    libraries have no band softmax, dropouts, bias-GELU, global merge or layer norm; its fused
    attention is checked against the reference in test_attention.py)."""
    cases = []
    for n, w, autoregressive in ((37, W, False), (9, 12, True)):
        q, k, v = (x.detach().to(device).requires_grad_() for x in _inputs(n, n, dtype=dtype))
        c = w + 1 if autoregressive else 2 * w + 1
        band = _band(n, 2, n, 4, c, dtype).to(device).requires_grad_()
        mask = torch.zeros(2, n, dtype=torch.bool, device=device)
        mask[1, n // 2 :] = True
        seed = torch.tensor(1234)
        DILATION = torch.tensor(globals()["DILATION"], dtype=torch.int32)  # (the ops take the dilations as a tensor)
        cases += [
            (ops.band_qk, (q, k, w, DILATION, autoregressive, -1.5)),
            (ops.band_pv, (band, v, w, DILATION, autoregressive)),
            (ops.band_transposed, (band.detach(), v.detach(), w, DILATION, autoregressive)),
            (ops.band_qk_out, (q.detach(), k.detach(), w, DILATION, autoregressive, 0.0, torch.empty_like(band))),
            (ops.band_pv_out, (band.detach(), v.detach(), w, DILATION, autoregressive, torch.empty_like(v))),
            (ops.band_transposed_out, (band.detach(), v.detach(), w, DILATION, autoregressive, torch.empty_like(v))),
        ]
        if device != "cpu":
            continue
        cases += [
            (ops.attention, (q, k, v, mask, seed, w, DILATION, autoregressive, 0.125, 0.0)),
            (ops.attention, (q, k, v, None, seed, w, DILATION, autoregressive, 0.125, 0.2)),
            (
                ops.attention_out,
                (
                    q.detach(),
                    k.detach(),
                    v.detach(),
                    mask,
                    seed,
                    w,
                    DILATION,
                    autoregressive,
                    0.125,
                    0.2,
                    torch.empty_like(v),
                ),
            ),
        ]
        out, lse = ops.attention(
            q.detach(), k.detach(), v.detach(), mask, seed, w, DILATION, autoregressive, 0.125, 0.2
        )
        cases.append(
            (
                ops.attention_backward,
                (
                    torch.randn_like(out),
                    torch.randn_like(lse),
                    q.detach(),
                    k.detach(),
                    v.detach(),
                    mask,
                    seed,
                    out,
                    lse,
                    w,
                    DILATION,
                    autoregressive,
                    0.125,
                    0.2,
                ),
            )
        )
        probs = band.detach().clone()
        cases.append((ops.band_softmax_, (probs, mask, w, DILATION, autoregressive)))
        cases.append(
            (
                ops.band_softmax_backward,
                (probs, torch.randn_like(probs), torch.randn_like(lse), w, DILATION, autoregressive),
            )
        )
        cases.append((ops.dropout, (v, seed, 0.3)))
        rows = v.detach().reshape(-1, v.shape[-1])
        shift = torch.randn(v.shape[-1], dtype=dtype, requires_grad=True)
        cases += [
            (
                ops.bias_dropout_add,
                (rows.clone().requires_grad_(True), shift, rows.clone().requires_grad_(True), seed, 0.3),
            ),
            (ops.bias_dropout_add_, (rows.clone(), shift.detach(), rows, seed, 0.3)),
            (ops.dropout_column_sums, (torch.randn_like(rows), seed, 0.3)),
        ]
        h, bias = v.reshape(-1, v.shape[-1]).detach(), torch.randn(v.shape[-1], dtype=dtype, requires_grad=True)
        cases += [
            (ops.bias_gelu, (h.clone().requires_grad_(True), bias)),
            (ops.bias_gelu_backward, (torch.randn_like(h), h, bias.detach())),
            (ops.bias_gelu_, (h.clone(), bias.detach())),
        ]
        acc = accumulation_dtype(dtype)
        a, omega = torch.rand(*v.shape[:3], dtype=acc), torch.rand(*v.shape[:3], 2, dtype=acc)
        slots = v.detach()[:, :2].contiguous()
        cases += [
            (ops.global_merge, (v.detach(), a, omega, slots)),
            (ops.global_merge_, (v.detach().clone(), a, omega, slots)),
            (ops.global_merge_backward, (torch.randn_like(v.detach()), v.detach(), slots, a)),
        ]
        scale, shift = (torch.randn(v.shape[-1], dtype=dtype, requires_grad=True) for _ in range(2))
        out, mean, rstd = ops.layer_norm(rows, scale.detach(), shift.detach(), 1e-5)
        cases += [
            (ops.layer_norm, (rows.clone().requires_grad_(True), scale, shift, 1e-5)),
            (ops.layer_norm_backward, (torch.randn_like(rows), rows, scale.detach(), mean, rstd)),
        ]
        query, keys = torch.randn(6, 1, 24, dtype=dtype), torch.randn(6, 37, 24, dtype=dtype)
        cases += [(ops.few_rows_mm_nt, (query, keys)), (ops.few_rows_mm, (query @ keys.transpose(1, 2), keys))]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_band_ops_cuda(dtype):
    for op, args in _opcheck_cases(dtype, "cuda"):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_opcheck_every_op(dtype):
    """Schema (declared mutations), fake implementation, autograd registration and AOT dispatch
    (with dynamic shapes) of every op, as torch.library.opcheck tests them."""
    names = set()
    for op, args in _opcheck_cases(dtype):
        torch.library.opcheck(op, args)
        names.add(op._qualified_op_name.split("::")[1])
    registered = {name for name in dir(ops) if isinstance(getattr(ops, name), torch._ops.OpOverloadPacket)}
    assert names == registered and len(names) == 25, (names, registered)


# ----------------------------------------------------------------------------- layer and model
def _tiny(**kwargs) -> LongformerConfig:
    base = dict(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=80,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attention_window=[3, 5],
        attention_dilation=[[1, 2, 1, 3], 1],
    )
    return LongformerConfig(**{**base, **kwargs})


def _model_batch(seed, b=2, n=41):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 50, (b, n), generator=g)
    attention_mask = torch.ones(b, n, dtype=torch.long)
    attention_mask[1, 30:] = 0
    global_mask = torch.zeros(b, n, dtype=torch.long)
    global_mask[0, [0, 7]] = 1
    global_mask[1, 0] = 1
    return ids, attention_mask, global_mask


def _model_run(model, ids, attention_mask, global_mask, training):
    model.train(training)
    model.zero_grad()
    out = model(ids, attention_mask=attention_mask, global_attention_mask=global_mask)
    logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
    if not training:
        return [logits.detach()]
    (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
    return [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("cls", [LongformerModel, LongformerForMaskedLM], ids=lambda c: c.__name__)
def test_compiled_model_matches_eager(cls, training):
    """Global tokens and padding, eval and training (gradients of every parameter): eager's results.

    The graph breaks that remain are the two data-dependent host syncs of each layer with a mask: the
    number of global slots (``int(counts.max())``) and whether anything is padding
    (``bool(is_padding.any())``); none in the ops."""
    torch.manual_seed(0)
    model = cls(_tiny()).double()
    batch = _model_batch(4)
    eager = _model_run(model, *batch, training)
    compiled_model = torch.compile(model)
    compiled = _model_run(compiled_model, *batch, training)
    assert len(compiled) == len(eager)
    for i, (a, e) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=0, msg=lambda m: f"output/grad {i}: {m}")
    explanation = torch._dynamo.explain(model)(batch[0], attention_mask=batch[1], global_attention_mask=batch[2])
    where = {
        (frame.filename.rsplit("/", 1)[-1], frame.name, frame.line)
        for reason in explanation.break_reasons
        for frame in reason.user_stack[-1:]
    }
    assert where == {
        ("layer.py", "from_mask", "g = int(counts.max()) if is_global.numel() else 0"),
        ("layer.py", "forward", "any_padding = bool(is_padding.any())"),
    }, where


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_model_without_mask_compiles_fullgraph(training):
    """Per-head dilations in the config (the layers keep them as ints), no mask: one graph, eager's
    results and gradients."""
    torch.manual_seed(0)
    model = LongformerForMaskedLM(_tiny()).double()
    ids = torch.randint(0, 50, (2, 41), generator=torch.Generator().manual_seed(3))

    def run(m):
        m.train(training)
        m.zero_grad()
        logits = m(ids).logits
        if training:
            (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
        return [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager = run(model)
    compiled = run(torch.compile(model, fullgraph=True))
    assert len(compiled) == len(eager) > (10 if training else 0)
    for i, (a, e) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=0, msg=lambda m: f"output/grad {i}: {m}")


def test_export_layer_without_global_tokens():
    """torch.export of one layer (no mask: no padding, no global token) runs and matches eager,
    at the exported length and at another (dynamic sequence length)."""
    torch.manual_seed(0)
    layer = LongformerSelfAttention(_tiny(), 0).double().eval()
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    seq = torch.export.Dim("seq", min=2, max=4096)
    program = torch.export.export(layer, (x,), dynamic_shapes={"hidden_states": {1: seq}})
    assert any("longformer_ops" in str(node.target) for node in program.graph.nodes)
    for n in (37, 50):
        x = torch.randn(2, n, 32, dtype=torch.float64)
        torch.testing.assert_close(program.module()(x)[0], layer(x)[0], atol=1e-12, rtol=0)
