"""longformer_ops.hf: transformers' own Longformer models (and LED's encoder) patched to run their
self-attention on our kernels give the unpatched model's outputs and gradients; unpatch restores them."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from hf_helpers import PAD, assert_close, hf_config, random_batch, random_hf_windows, randomize_, single_thread

transformers = pytest.importorskip("transformers")
import longformer_ops  # noqa: E402
import longformer_ops.hf as hf  # noqa: E402
from longformer_ops.nn import dense  # noqa: E402
from longformer_ops.runtime import kernels  # noqa: E402

_ = single_thread  # autouse fixture
ATOL = 1e-4  # float32, as the model tests against transformers
GRADIENT_RTOL = 1e-6  # of a gradient's largest element: ~16 float32 units of roundoff

TASK_MODELS = [
    "LongformerModel",
    "LongformerForMaskedLM",
    "LongformerForSequenceClassification",
    "LongformerForTokenClassification",
    "LongformerForQuestionAnswering",
    "LongformerForMultipleChoice",
]


@pytest.fixture(autouse=True)
def no_class_patch_left():
    yield
    hf.unpatch()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Which of our kernels ran: "attention" (the fused local attention) or a band product's name."""
    calls = []
    fused, band = kernels._attention_kernel, kernels._band_kernel
    monkeypatch.setattr(kernels, "_attention_kernel", lambda *args: calls.append("attention") or fused(*args))
    monkeypatch.setattr(kernels, "_band_kernel", lambda op, *args: calls.append(op) or band(op, *args))
    return calls


def _model(name, seed=0, layers=3):
    """A tiny transformers ``name`` with per-layer windows and weights far from the init, in eval mode."""
    torch.manual_seed(seed)
    config = hf_config(random_hf_windows(seed, layers), num_labels=2 if name.endswith("QuestionAnswering") else 3)
    return randomize_(getattr(transformers, name)(config), seed).eval()


def _inputs(name, seed=1):
    ids, attention_mask, global_mask = random_batch(seed, [19, 11, 16], 97, [2, 1, 0])
    inputs = dict(input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask)
    if name == "LongformerForMultipleChoice":  # [batch, choices, n]
        inputs = {key: value[None].expand(2, -1, -1).contiguous() for key, value in inputs.items()}
    return inputs


def _outputs(model, inputs, training=False):
    model.train(training)
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on padding to the window
        out = model(**inputs)
    first = out[0]
    if not training:
        return [first.detach()]
    (first * torch.linspace(-1, 1, first.shape[-1])).sum().backward()
    return [first.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _assert_patch_keeps_outputs(model, inputs, training, kernel_calls, what, atol=ATOL):
    """Patch ``model`` in place and check that it ran our fused kernels and kept its state-dict keys,
    its outputs (per-token outputs: at real tokens) and, in training, every parameter's gradient."""
    expected = _outputs(model, inputs, training)
    keys = list(model.state_dict())
    assert not kernel_calls
    assert hf.patch(model) is model
    got = _outputs(model, inputs, training)
    assert "attention" in kernel_calls, f"{what}: the patched model did not run our fused kernels"
    assert list(model.state_dict()) == keys
    real = inputs["attention_mask"].bool()
    if got[0].shape[: real.dim()] == real.shape:
        got[0], expected[0] = got[0][real], expected[0][real]
    assert len(got) == len(expected) > training
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        # Gradients (i > 0) are sums over rows in an order of our kernels' (layer norms', biases'),
        # of magnitudes up to hundreds here: float32 rounding relative to their size.
        bound = atol + (GRADIENT_RTOL * e.abs().max().item() if i and e.numel() else 0.0)
        assert_close(a, e, bound, f"{what}: output/gradient {i}")


def test_import_does_not_import_transformers():
    code = "import sys, longformer_ops; assert 'transformers' not in sys.modules, 'transformers was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_hf_is_reachable_from_a_plain_import():
    """The README's two lines after ``import longformer_ops`` alone: ``longformer_ops.hf`` is imported on
    first access (not with the package), as are ``longformer_ops.info`` and ``longformer_ops.distributed``;
    other names still fail."""
    code = (
        "import sys, longformer_ops\n"
        "assert 'longformer_ops.hf' not in sys.modules, 'hf was imported with the package'\n"
        "assert 'longformer_ops.distributed' not in sys.modules, 'distributed was imported with the package'\n"
        "assert callable(longformer_ops.hf.patch) and callable(longformer_ops.hf.unpatch)\n"
        "assert longformer_ops.info.__name__ == 'longformer_ops.info'\n"
        "assert callable(longformer_ops.distributed.sliding_window_attention)\n"
        "try:\n    longformer_ops.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e), e\n"
        "else:\n    raise AssertionError('no AttributeError')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", TASK_MODELS)
def test_patched_model_matches_transformers(name, training, kernel_calls):
    """Padding, global tokens (and an example without any), per-layer windows: the outputs (and in
    training every parameter's gradient) of the patched model are the unpatched model's."""
    model, inputs = _model(name), _inputs(name)
    _assert_patch_keeps_outputs(model, inputs, training, kernel_calls, name)
    hf.unpatch(model)
    kernel_calls.clear()
    _outputs(model, inputs, training)
    assert not kernel_calls, "unpatch left our kernels in place"


@pytest.mark.parametrize("how", ["model", "classes"])
def test_patched_models_run_unpadded(how, kernel_calls):
    """transformers pads a sequence to a multiple of the attention window for its own attention; a
    patched model's layers run at the input's length (ours takes any), unpatched ones as before."""
    seen = []

    def record(module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).shape[1])

    for name in ("LongformerForSequenceClassification", "LED"):
        if how == "classes":
            hf.patch()
        try:
            model = _led() if name == "LED" else _model(name)
            inputs = _led_inputs() if name == "LED" else _inputs(name)
            attention = next(m for m in model.modules() if hasattr(m, "one_sided_attn_window_size"))
            attention.register_forward_pre_hook(record, with_kwargs=True)
            if how == "model":
                _outputs(model, inputs)
                assert seen.pop() == 24, name  # (19 tokens padded to a multiple of the window, 6 or 8)
                hf.patch(model)
            _outputs(model, inputs)
            assert seen.pop() == 19, f"{name}: the patched model's layers ran a padded sequence"
        finally:
            hf.unpatch(model)
            hf.unpatch()
        _outputs(model, inputs)
        assert seen.pop() == 24, f"{name}: unpatched, transformers pads again"


def test_subclass_of_a_patched_model_runs_unpadded(kernel_calls):
    """A user's subclass of transformers' LongformerModel gets the unpadded sequence too."""

    class MyModel(transformers.LongformerModel):
        pass

    torch.manual_seed(0)
    model = randomize_(MyModel(hf_config(random_hf_windows(0, 2))), 0).eval()
    inputs = _inputs("LongformerModel")
    expected = _outputs(model, inputs)[0]
    try:
        got = _outputs(hf.patch(model), inputs)[0]
    finally:
        hf.unpatch()
    real = inputs["attention_mask"].bool()
    assert "attention" in kernel_calls
    assert_close(got[real], expected[real], ATOL, "subclass")


def test_patched_model_compiles(kernel_calls):
    """torch.compile of a patched model (unpadded sequence, global tokens, padding): transformers'
    outputs at the real tokens."""
    model = _model("LongformerModel", layers=2)
    inputs = _inputs("LongformerModel")
    expected = _outputs(model, inputs)[0]
    hf.patch(model)
    hf._warned.clear()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(model)(**inputs)[0]
    fallbacks = [str(w.message) for w in caught if "longformer_ops.hf" in str(w.message)]
    assert not fallbacks, fallbacks  # (transformers' own attention would match too)
    real = inputs["attention_mask"].bool()
    assert got.shape == expected.shape
    assert_close(got[real], expected[real], ATOL, "compiled patched model")


def _dropout_types(model) -> list[type]:
    return [type(m) for m in model.modules() if isinstance(m, torch.nn.Dropout)]


@pytest.mark.parametrize("name", ["LongformerForSequenceClassification", "LongformerForMaskedLM"])
def test_patched_models_drop_hidden_states_on_our_kernel(name, monkeypatch):
    """patch(model) puts the model's hidden-state nn.Dropout modules on our dropout (same p, no
    state: the state dict is unchanged); in training the patched model then draws its hidden-state
    masks with our kernel, reproducibly from torch's seed; unpatch(model) gives torch's back."""
    model, inputs = _model(name), _inputs(name)
    before = _dropout_types(model)
    assert before and set(before) == {torch.nn.Dropout}
    keys = list(model.state_dict())
    hf.patch(model)
    assert _dropout_types(model) == [hf._PatchedDropout] * len(before)
    assert list(model.state_dict()) == keys

    calls = []
    monkeypatch.setattr(
        torch.ops.longformer_ops,
        "dropout",
        lambda *args, op=torch.ops.longformer_ops.dropout: calls.append(args[2]) or op(*args),
    )
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.25
    model.train()
    with torch.no_grad():
        torch.manual_seed(5)
        first = model(**inputs)[0]
        torch.manual_seed(5)
        again = model(**inputs)[0]
        other = model(**inputs)[0]
    assert calls and set(calls) == {0.25}, calls
    assert torch.equal(first, again) and not torch.equal(first, other)
    hf.unpatch(model)
    assert _dropout_types(model) == before


def test_models_built_while_classes_are_patched_drop_on_our_kernel():
    """patch() makes every Longformer model built afterwards use our dropout; unpatch() restores
    transformers' post_init, and models built then have torch's."""
    assert "post_init" not in transformers.LongformerPreTrainedModel.__dict__
    config = hf_config(random_hf_windows(0, 2))
    hf.patch()
    for name in ("LongformerForMaskedLM", "LongformerForMultipleChoice"):
        assert set(_dropout_types(getattr(transformers, name)(config))) == {hf._PatchedDropout}, name
    hf.unpatch()
    assert "post_init" not in transformers.LongformerPreTrainedModel.__dict__
    for name in ("LongformerForMaskedLM", "LongformerForMultipleChoice"):
        assert set(_dropout_types(getattr(transformers, name)(config))) == {torch.nn.Dropout}, name


def _module_types(model, name: str) -> set[str]:
    return {type(m).__module__ + "." + type(m).__name__ for m in model.modules() if type(m).__name__ == name}


def _intermediate_types(model) -> set[str]:
    return _module_types(model, "LongformerIntermediate")


@pytest.mark.parametrize("hidden_act", ["gelu", "relu"])
def test_patched_intermediate_takes_bias_and_gelu_in_our_kernel(hidden_act, monkeypatch, kernel_calls):
    """patch(model) switches each LongformerIntermediate (state dict unchanged): with transformers'
    exact gelu it calls our bias-GELU kernel, forward and backward, with the outputs and gradients
    of the unpatched model; with another activation it runs transformers' forward. unpatch(model)
    switches back; the class-wide patch does the same for models built while it holds."""
    torch.manual_seed(0)
    config = hf_config(random_hf_windows(0, 2), hidden_act=hidden_act)
    model = randomize_(transformers.LongformerModel(config), 0).eval()
    inputs = _inputs("LongformerModel")
    ours = "longformer_ops.hf.LongformerIntermediate"
    theirs = "transformers.models.longformer.modeling_longformer.LongformerIntermediate"
    assert _intermediate_types(model) == {theirs}
    calls = []
    forward, backward = torch.ops.longformer_ops.bias_gelu, kernels.bias_gelu_backward
    monkeypatch.setattr(
        torch.ops.longformer_ops, "bias_gelu", lambda *args: calls.append("bias_gelu") or forward(*args)
    )
    monkeypatch.setattr(
        kernels, "bias_gelu_backward", lambda *args: calls.append("bias_gelu_backward") or backward(*args)
    )
    _assert_patch_keeps_outputs(model, inputs, True, kernel_calls, f"patched model with {hidden_act}")
    assert _intermediate_types(model) == {ours}
    assert sorted(set(calls)) == (["bias_gelu", "bias_gelu_backward"] if hidden_act == "gelu" else []), calls
    hf.unpatch(model)
    assert _intermediate_types(model) == {theirs}
    hf.patch()
    assert _intermediate_types(transformers.LongformerModel(config)) == {ours}
    hf.unpatch()
    assert _intermediate_types(transformers.LongformerModel(config)) == {theirs}


def test_patched_output_layers_take_bias_dropout_residual_and_norm_in_our_kernels(monkeypatch, kernel_calls):
    """patch(model) switches each LongformerSelfOutput and LongformerOutput and each nn.LayerNorm
    (state dict unchanged): they call our bias-dropout-residual and layer-norm kernels, forward and
    backward, with the outputs and gradients of the unpatched model. unpatch(model) switches back;
    the class-wide patch does the same for models built while it holds."""
    torch.manual_seed(0)
    config = hf_config(random_hf_windows(0, 2))
    model = randomize_(transformers.LongformerModel(config), 0).eval()
    names = ("LongformerSelfOutput", "LongformerOutput")
    theirs = [{f"transformers.models.longformer.modeling_longformer.{name}"} for name in names]
    ours = [{f"longformer_ops.hf.{name}"} for name in names]
    assert [_module_types(model, name) for name in names] == theirs
    calls = []
    forward, backward = torch.ops.longformer_ops.bias_dropout_add, kernels.dropout_column_sums
    monkeypatch.setattr(
        torch.ops.longformer_ops, "bias_dropout_add", lambda *args: calls.append("forward") or forward(*args)
    )
    monkeypatch.setattr(kernels, "dropout_column_sums", lambda *args: calls.append("backward") or backward(*args))
    norm, norm_backward = torch.ops.longformer_ops.layer_norm, kernels.layer_norm_backward
    monkeypatch.setattr(torch.ops.longformer_ops, "layer_norm", lambda *args: calls.append("norm") or norm(*args))
    monkeypatch.setattr(
        kernels, "layer_norm_backward", lambda *args: calls.append("norm backward") or norm_backward(*args)
    )
    norm_types = lambda: {type(m) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}  # noqa: E731
    assert norm_types() == {torch.nn.LayerNorm}
    _assert_patch_keeps_outputs(model, _inputs("LongformerModel"), True, kernel_calls, "patched output layers")
    assert [_module_types(model, name) for name in names] == ours
    assert norm_types() == {hf._PatchedLayerNorm}
    layers = config.num_hidden_layers
    assert calls.count("forward") == calls.count("backward") == 2 * layers, calls
    assert calls.count("norm") == calls.count("norm backward") == 2 * layers + 1, calls  # and the embeddings'
    hf.unpatch(model)
    assert [_module_types(model, name) for name in names] == theirs
    assert norm_types() == {torch.nn.LayerNorm}
    hf.patch()
    assert [_module_types(transformers.LongformerModel(config), name) for name in names] == ours
    hf.unpatch()
    assert [_module_types(transformers.LongformerModel(config), name) for name in names] == theirs


@pytest.mark.parametrize("name", TASK_MODELS)
def test_patched_linear_layers_run_through_dense(name):
    """patch(model) switches every plain nn.Linear (projections, heads, pooler) to dense.Linear's
    patched subclass, state dict unchanged, weights still tied where they were (the masked LM's
    decoder); unpatch(model) switches them back; the class-wide patch does the same for models built
    while it holds (their outputs are the unpatched ones: test_patched_model_matches_transformers)."""
    model = _model(name)
    linear_types = lambda m: [type(x) for x in m.modules() if isinstance(x, torch.nn.Linear)]  # noqa: E731
    before = linear_types(model)
    assert before and set(before) == {torch.nn.Linear}
    keys = list(model.state_dict())
    hf.patch(model)
    assert linear_types(model) == [hf._PatchedLinear] * len(before)
    assert all(dense.plain_linear(m) for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)
    assert list(model.state_dict()) == keys
    if name == "LongformerForMaskedLM":
        assert model.lm_head.decoder.weight is model.longformer.embeddings.word_embeddings.weight
    hf.unpatch(model)
    assert linear_types(model) == before
    config = model.config
    hf.patch()
    assert set(linear_types(getattr(transformers, name)(config))) == {hf._PatchedLinear}
    hf.unpatch()
    assert set(linear_types(getattr(transformers, name)(config))) == {torch.nn.Linear}


def test_patched_led_switches_its_decoder_attention_and_linear_layers():
    """patch(model) switches LED's decoder attention modules to their patched subclass (transformers'
    forward, products through dense.float32_products) and its linear layers to dense.Linear's, state
    dict unchanged; unpatch(model) switches them back; the class-wide patch does the same for LED
    models built while it holds."""
    model = _led()
    decoder_attention = transformers.models.led.modeling_led.LEDDecoderAttention

    def types(m):
        return (
            {type(x) for x in m.modules() if isinstance(x, decoder_attention)},
            {type(x) for x in m.modules() if isinstance(x, torch.nn.Linear)},
        )

    keys = list(model.state_dict())
    assert types(model) == ({decoder_attention}, {torch.nn.Linear})
    hf.patch(model)
    assert types(model) == ({hf._patched_by_name.LEDDecoderAttention}, {hf._PatchedLinear})
    assert hf._patched_by_name.LEDDecoderAttention._original_class is decoder_attention
    assert list(model.state_dict()) == keys
    hf.unpatch(model)
    assert types(model) == ({decoder_attention}, {torch.nn.Linear})
    hf.patch()
    try:
        assert types(transformers.LEDForConditionalGeneration(model.config)) == (
            {hf._patched_by_name.LEDDecoderAttention},
            {hf._PatchedLinear},
        )
    finally:
        hf.unpatch()
    assert types(transformers.LEDForConditionalGeneration(model.config)) == ({decoder_attention}, {torch.nn.Linear})


def test_attention_mask_with_2_for_global(kernel_calls):
    """transformers' older convention: one attention_mask with 0 padding, 1 local, 2 global (no
    global_attention_mask); the patched model reads it as the unpatched one does."""
    model = _model("LongformerForTokenClassification")
    inputs = _inputs("LongformerForTokenClassification")
    merged = inputs["attention_mask"] * (inputs.pop("global_attention_mask") + 1)
    assert (merged == 2).sum() == 3
    inputs["attention_mask"] = merged
    _assert_patch_keeps_outputs(model, inputs, False, kernel_calls, "0/1/2 attention_mask")


def test_patch_the_classes_for_models_built_later(kernel_calls):
    model = _model("LongformerModel")
    inputs = _inputs("LongformerModel")
    expected = _outputs(model, inputs)
    hf.patch()
    patched = transformers.LongformerModel(model.config)
    patched.load_state_dict(model.state_dict())
    got = _outputs(patched.eval(), inputs)
    assert kernel_calls
    real = inputs["attention_mask"].bool()
    assert_close(got[0][real], expected[0][real], ATOL, "class-patched model")
    hf.unpatch()
    kernel_calls.clear()
    _outputs(transformers.LongformerModel(model.config).eval(), inputs)
    assert not kernel_calls


def _attentions(model, inputs):
    """``(last hidden state, local attentions, global attentions)`` of one ``output_attentions`` call."""
    out = model(**inputs, output_attentions=True)
    encoder = "encoder_" if hasattr(out, "encoder_attentions") else ""
    return out[0], getattr(out, f"{encoder}attentions"), getattr(out, f"{encoder}global_attentions")


@pytest.mark.parametrize("globals_per_example", [[2, 1, 0], [0, 0, 0]], ids=["globals", "no-globals"])
def test_output_attentions_are_transformers_own(globals_per_example, kernel_calls):
    """output_attentions=True runs on our band kernels (no fallback, no warning) and returns
    transformers' local and global attention tensors, its filler rows included."""
    model = _model("LongformerModel")
    ids, attention_mask, global_mask = random_batch(1, [19, 11, 16], 97, globals_per_example)
    inputs = dict(input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _attentions(model, inputs)
    hf.patch(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="longformer_ops")
        got = _attentions(model, inputs)
    assert "qk" in kernel_calls and "pv" in kernel_calls, kernel_calls
    real = attention_mask.bool()
    assert_close(got[0][real], expected[0][real], ATOL, "hidden states")
    if not any(globals_per_example):
        assert got[2] is None and expected[2] is None
    for kind, got_layers, expected_layers in (
        ("local", got[1], expected[1]),
        ("global", got[2] or (), expected[2] or ()),
    ):
        assert len(got_layers) == len(expected_layers)
        for layer, (a, e) in enumerate(zip(got_layers, expected_layers, strict=True)):
            assert_close(a, e, 1e-5, f"{kind} attentions of layer {layer}")


def test_led_output_attentions(kernel_calls):
    model = _led()
    ids, attention_mask, global_mask = random_batch(3, [19, 12], 97, [2, 1])
    inputs = dict(
        input_ids=ids,
        attention_mask=attention_mask,
        global_attention_mask=global_mask,
        decoder_input_ids=torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(4)),
    )
    expected = _attentions(model, inputs)
    hf.patch(model)
    got = _attentions(model, inputs)
    assert "qk" in kernel_calls
    assert_close(got[0], expected[0], ATOL, "LED logits")
    for kind in (1, 2):
        for layer, (a, e) in enumerate(zip(got[kind], expected[kind], strict=True)):
            assert_close(a, e, 1e-5, f"LED encoder attentions {kind} of layer {layer}")


def test_no_kernel_for_the_call_falls_back_with_one_warning(kernel_calls, monkeypatch):
    """Without a usable kernel (here: the loader says none is built for this machine) the call runs
    transformers' own code, warns once naming why, and gives its result."""
    model = _model("LongformerForSequenceClassification")
    inputs = _inputs("LongformerForSequenceClassification")
    expected = _outputs(model, inputs)[0]
    hf.patch(model)

    def no_kernel(*args, **kwargs):
        raise longformer_ops.KernelNotAvailableError("no prebuilt kernels for this test")

    monkeypatch.setattr(kernels, "_library", no_kernel)
    monkeypatch.setattr(kernels, "library_for", no_kernel)  # what the ops ask whether a kernel serves
    hf._warned.clear()
    with pytest.warns(
        UserWarning,
        match="no kernel for this call .no prebuilt kernels for this test.: this call "
        "runs transformers' own attention code",
    ) as caught:
        with torch.no_grad():
            got = model(**inputs)[0]
            model(**inputs)
    assert len([w for w in caught if "longformer_ops.hf" in str(w.message)]) == 1, "warned more than once"
    assert torch.equal(got, expected)


def test_unsupported_calls_are_named():
    hidden = torch.zeros(1, 4, 8)
    assert hf._unsupported_reason(hidden, {}) is None
    assert hf._unsupported_reason(hidden, {"head_mask": None}) == "unsupported arguments ['head_mask']"
    assert "hidden_states on meta" in hf._unsupported_reason(hidden.to("meta"), {})
    assert "hidden_states in torch.complex64" in hf._unsupported_reason(hidden.to(torch.complex64), {})


def test_attention_dropout_is_transformers(kernel_calls):
    """In training the patched layers drop attention probabilities as transformers does: with
    p = 1 nothing passes (the same outputs as transformers' own, exactly reachable); with p = 0.3
    the kept ones are scaled by 1 / (1 - p), so the mean over draws is the undropped output."""
    model = _model("LongformerModel", layers=2)
    inputs = _inputs("LongformerModel")
    for module in model.modules():
        if hasattr(module, "one_sided_attn_window_size"):
            module.dropout = 1.0
    _assert_patch_keeps_outputs(model, inputs, True, kernel_calls, "attention dropout p = 1")

    attention = model.encoder.layer[0].attention.self
    hidden = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(3, 16)
    mask[0, 3] = mask[2, 0] = 10000.0  # global tokens
    mask[1, 12:] = -10000.0  # padding
    attention.eval()
    with torch.no_grad():
        undropped = attention(hidden, mask)[0]
        attention.train()
        attention.dropout = 0.3
        draws = torch.stack([attention(hidden, mask)[0] for _ in range(400)])
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], undropped)
    sigma = draws.std(0) / 400**0.5
    assert ((draws.mean(0) - undropped).abs() <= 5 * sigma + 1e-6).float().mean() > 0.999


def test_autocast(kernel_calls):
    """Under torch.autocast(bfloat16) the patched model errs against float32 at most twice as much
    as transformers' own code under the same autocast (plus a few units roundoff)."""
    model = _model("LongformerForSequenceClassification")
    inputs = _inputs("LongformerForSequenceClassification")
    exact = _outputs(model, inputs)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = _outputs(model, inputs)[0].float()
        hf.patch(model)
        ours = _outputs(model, inputs)[0].float()
    assert "attention" in kernel_calls
    error, their_error = ((x - exact).abs().max().item() for x in (ours, theirs))
    unit = torch.finfo(torch.bfloat16).eps / 2
    assert error <= 2 * their_error + 4 * unit * exact.abs().max().item(), (error, their_error)


def _led():
    """A tiny LED (Longformer-Encoder-Decoder) for summarization, random weights far from the init."""
    torch.manual_seed(0)
    config = transformers.LEDConfig(
        vocab_size=97,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        attention_window=[8, 4],
        max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return randomize_(transformers.LEDForConditionalGeneration(config), 0).eval()


def _led_inputs(seed=3):
    ids, attention_mask, global_mask = random_batch(seed, [19, 12], 97, [1, 1])
    decoder_ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(seed + 1))
    return dict(
        input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask, decoder_input_ids=decoder_ids
    )


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_led_encoder_is_patched(training, kernel_calls):
    """LED (Longformer-Encoder-Decoder): its encoder's self-attention runs on our kernels; the same
    logits and, in training, the same gradient of every parameter."""
    _assert_patch_keeps_outputs(_led(), _led_inputs(), training, kernel_calls, "LED")


@pytest.mark.parametrize("name", ["LongformerForSequenceClassification", "LEDForConditionalGeneration"])
def test_gradient_checkpointing(name, kernel_calls):
    """gradient_checkpointing_enable(): the patched model's gradients are the unpatched model's."""
    model, inputs = (_led(), _led_inputs()) if name.startswith("LED") else (_model(name), _inputs(name))
    model.gradient_checkpointing_enable()
    _assert_patch_keeps_outputs(model, inputs, True, kernel_calls, f"{name}, checkpointed")


def test_checkpointing_replays_the_patched_dropouts():
    """With the hidden-state dropouts on our kernel (p = 0.25) and attention dropout, a patched
    model's gradients under gradient_checkpointing_enable() are those without it, from the same
    seed: the recomputed forward draws the same masks (their seeds come from torch's generator,
    whose state checkpointing replays)."""
    grads = []
    for checkpointed in (False, True):
        model = hf.patch(_model("LongformerForTokenClassification", layers=2))
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.25
            if hasattr(module, "one_sided_attn_window_size"):
                module.dropout = 0.2
        if checkpointed:
            model.gradient_checkpointing_enable()
        torch.manual_seed(11)
        grads.append(_outputs(model, _inputs("LongformerForTokenClassification"), training=True))
    for i, (plain, replayed) in enumerate(zip(*grads)):
        assert_close(replayed, plain, 1e-6, f"checkpointed vs plain, tensor {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_model(dtype, kernel_calls, half_gemm):
    """In a half type the patched model errs against float32 at most twice as much as transformers'
    own code in that type (plus a few units roundoff)."""
    model = _model("LongformerModel")
    inputs = _inputs("LongformerModel")
    exact = _outputs(model, inputs)[0]
    half = model.to(dtype)
    theirs = _outputs(half, inputs)[0].float()
    hf.patch(half)
    ours = _outputs(half, inputs)[0].float()
    assert kernel_calls
    real = inputs["attention_mask"].bool()
    error, their_error = ((x - exact)[real].abs().max().item() for x in (ours, theirs))
    unit = torch.finfo(dtype).eps / 2
    assert error <= 2 * their_error + 4 * unit * exact[real].abs().max().item(), (error, their_error)


def test_led_generate_gives_the_same_tokens(kernel_calls):
    model = _led()
    ids, attention_mask, global_mask = random_batch(5, [23, 14], 97, [1, 1])
    options = dict(
        attention_mask=attention_mask, global_attention_mask=global_mask, max_new_tokens=8, do_sample=False, num_beams=1
    )
    expected = model.generate(ids, **options)
    hf.patch(model)
    got = model.generate(ids, **options)
    assert kernel_calls
    assert torch.equal(got, expected), (got, expected)


def test_save_pretrained_and_from_pretrained_with_the_classes_patched(tmp_path, kernel_calls):
    """A patched model saves the checkpoint transformers saves (same keys and tensors; an unpatched
    model loads it back), and with the classes patched, from_pretrained builds patched models."""
    model = _model("LongformerForTokenClassification")
    inputs = _inputs("LongformerForTokenClassification")
    expected = _outputs(model, inputs)[0]
    hf.patch(model).save_pretrained(tmp_path)
    hf.unpatch(model)
    plain = transformers.LongformerForTokenClassification.from_pretrained(tmp_path).eval()
    assert not kernel_calls
    assert {k: v for k, v in plain.state_dict().items()}.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())
    hf.patch()
    loaded = transformers.LongformerForTokenClassification.from_pretrained(tmp_path).eval()
    got = _outputs(loaded, inputs)[0]
    assert "attention" in kernel_calls
    real = inputs["attention_mask"].bool()
    assert_close(got[real], expected[real], ATOL, "from_pretrained with the classes patched")


def test_pickled_patched_model_is_patched_where_it_is_loaded(tmp_path, kernel_calls):
    """``copy.deepcopy`` and ``torch.save(model)`` (pickle, as multiprocessing uses) of a patched model
    (Longformer, LED; patched in place or built while the classes are patched): the copy runs our
    kernels with the same outputs, also loaded in a fresh process, where the patched classes do not
    exist until the pickle names them."""
    cases = [("LongformerForSequenceClassification", False), ("LED", False), ("LongformerForMaskedLM", True)]
    for i, (name, class_wide) in enumerate(cases):
        if class_wide:
            hf.patch()
        model = _led() if name == "LED" else _model(name)
        inputs = _led_inputs() if name == "LED" else _inputs(name)
        if not class_wide:
            hf.patch(model)
        expected = _outputs(model, inputs)[0]
        kernel_calls.clear()
        assert_close(_outputs(copy.deepcopy(model), inputs)[0], expected, 0.0, f"{name}: deepcopy")
        assert "attention" in kernel_calls, f"{name}: the deep copy did not run our kernels"
        path = tmp_path / f"model{i}.pt"
        torch.save({"model": model, "inputs": inputs, "expected": expected}, path)
        kernel_calls.clear()
        loaded = torch.load(path, weights_only=False)
        assert_close(_outputs(loaded["model"], inputs)[0], expected, 0.0, f"{name}: torch.save and torch.load")
        assert "attention" in kernel_calls, f"{name}: the loaded copy did not run our kernels"
        hf.unpatch()
        code = (
            "import sys, torch, warnings\n"
            "from longformer_ops.runtime import kernels\n"
            "calls = []\n"
            "fused = kernels._attention_kernel\n"
            "kernels._attention_kernel = lambda *args: calls.append(1) or fused(*args)\n"
            f"saved = torch.load({str(path)!r}, weights_only=False)\n"
            "patched = [type(m) for m in saved['model'].modules() if type(m).__module__ == 'longformer_ops.hf']\n"
            "assert any(hasattr(c, '_original_class') for c in patched), 'not patched'\n"
            "with warnings.catch_warnings(), torch.no_grad():\n"
            "    warnings.simplefilter('ignore')\n"
            "    got = saved['model'](**saved['inputs'])[0]\n"
            "assert calls, 'our kernels did not run'\n"
            "error = (got - saved['expected']).abs().max().item()\n"
            f"assert error <= {ATOL}, error\n"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, f"{name}: loaded in a fresh process: {done.stderr[-2000:]}"


def test_peft_lora_model(kernel_calls):
    """A PEFT (LoRA) model on query/value, patched through its wrapper: the same outputs and the same
    gradients of the adapters (the only trainable parameters) as without the patch."""
    import peft  # a test dependency (pyproject.toml)

    model = _model("LongformerForSequenceClassification")
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0, init_lora_weights=False
        ),
    )
    trainable = [name for name, p in lora.named_parameters() if p.requires_grad]
    assert any("self.query.lora_A" in name for name in trainable), trainable
    _assert_patch_keeps_outputs(lora, _inputs("LongformerForSequenceClassification"), True, kernel_calls, "LoRA")


def test_adapters_added_after_patching_join_on_a_second_patch():
    """LoRA added to a patched model brings plain nn.Linear layers; patching again switches them
    (and leaves the rest as it was), with the same outputs as the model without the second patch."""
    import peft

    model = hf.patch(_model("LongformerForSequenceClassification"))
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0, init_lora_weights=False
        ),
    )
    added = [m for name, m in lora.named_modules() if ".lora_" in name and isinstance(m, torch.nn.Linear)]
    assert added and {type(m) for m in added} == {torch.nn.Linear}
    inputs = _inputs("LongformerForSequenceClassification")
    with torch.no_grad():
        before = lora(**inputs).logits
        assert hf.patch(lora) is lora
        after = lora(**inputs).logits
    assert {type(m) for m in added} == {hf._PatchedLinear}
    torch.testing.assert_close(after, before, rtol=0, atol=ATOL)


class _Documents(torch.utils.data.Dataset):
    """A tiny in-memory classification set: padded token ids, attention and global masks, labels."""

    def __init__(self, size=8):
        ids, attention_mask, global_mask = random_batch(7, [19, 11, 16, 19, 8, 13, 19, 17][:size], 97, [1] * size)
        labels = torch.arange(size) % 3
        self.rows = [
            dict(input_ids=i, attention_mask=a, global_attention_mask=g, labels=y)
            for i, a, g, y in zip(ids, attention_mask, global_mask, labels, strict=True)
        ]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def _train_with_trainer(model, output_dir):
    """Six SGD steps of transformers.Trainer (on the CPU, batch 2, shuffled by its seed): the logged losses."""
    arguments = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=6,
        per_device_train_batch_size=2,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=_Documents())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_trains_the_patched_model_as_the_unpatched_one(tmp_path, kernel_calls):
    """transformers.Trainer runs a patched classifier like the unpatched one: the same loss at every
    step and the same weights after six steps (dropout off, the same seed)."""
    model = _model("LongformerForSequenceClassification")
    twin = _model("LongformerForSequenceClassification")
    expected = _train_with_trainer(model, tmp_path / "transformers")
    assert not kernel_calls
    got = _train_with_trainer(hf.patch(twin), tmp_path / "patched")
    assert "attention" in kernel_calls
    assert len(got) == len(expected) == 6 and got[-1] != got[0], (got, expected)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(twin.named_parameters(), model.parameters(), strict=True):
        assert_close(p.detach(), q.detach(), 1e-4, f"after training: {name}")
