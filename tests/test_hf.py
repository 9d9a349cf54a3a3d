"""longformer_ops.hf: transformers' own Longformer models (and LED's encoder) patched to run their
self-attention on our kernels give the unpatched model's outputs and gradients; unpatch restores them."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from hf_helpers import PAD, assert_close, hf_config, random_batch, random_hf_windows, randomize_, single_thread

transformers = pytest.importorskip("transformers")
import longformer_ops.hf as hf  # noqa: E402
from longformer_ops import kernels  # noqa: E402

_ = single_thread  # autouse fixture
ATOL = 1e-4  # float32, as the model tests against transformers

TASK_MODELS = ["LongformerModel", "LongformerForMaskedLM", "LongformerForSequenceClassification",
               "LongformerForTokenClassification", "LongformerForQuestionAnswering", "LongformerForMultipleChoice"]


@pytest.fixture(autouse=True)
def no_class_patch_left():
    yield
    hf.unpatch()


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times our fused kernels ran."""
    calls = []
    real = kernels._attention_kernel
    monkeypatch.setattr(kernels, "_attention_kernel", lambda *args: calls.append(1) or real(*args))
    return calls


def _model(name, seed=0, layers=3):
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


def test_import_does_not_import_transformers():
    code = "import sys, longformer_ops; assert 'transformers' not in sys.modules, 'transformers was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", TASK_MODELS)
def test_patched_model_matches_transformers(name, training, kernel_calls):
    """Padding, global tokens (and an example without any), per-layer windows: the outputs (and in
    training every parameter's gradient) of the patched model are the unpatched model's."""
    model = _model(name)
    inputs = _inputs(name)
    expected = _outputs(model, inputs, training)
    keys = list(model.state_dict())
    assert hf.patch(model) is model
    assert not kernel_calls
    got = _outputs(model, inputs, training)
    assert kernel_calls, "the patched model did not run our kernels"
    assert list(model.state_dict()) == keys
    real = inputs["attention_mask"].bool()
    if got[0].shape[:real.dim()] == real.shape:
        got[0], expected[0] = got[0][real], expected[0][real]  # per-token outputs: the real tokens only
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        assert_close(a, e, ATOL, f"{name} output/gradient {i}")
    hf.unpatch(model)
    kernel_calls.clear()
    _outputs(model, inputs, training)
    assert not kernel_calls, "unpatch left our kernels in place"


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


def test_output_attentions_falls_back_with_a_warning(kernel_calls):
    model = _model("LongformerModel")
    inputs = _inputs("LongformerModel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model(**inputs, output_attentions=True)
    hf.patch(model)
    hf._warned.clear()
    with pytest.warns(UserWarning, match="output_attentions=True: this call runs transformers' own attention code"):
        got = model(**inputs, output_attentions=True)
    assert not kernel_calls
    for a, e in zip(got.attentions, expected.attentions, strict=True):
        assert torch.equal(a, e)


def _led():
    """A tiny LED (Longformer-Encoder-Decoder) for summarization, random weights far from the init."""
    torch.manual_seed(0)
    config = transformers.LEDConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2,
                                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, attention_window=[8, 4], max_encoder_position_embeddings=64,
                                    max_decoder_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                    pad_token_id=PAD, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return randomize_(transformers.LEDForConditionalGeneration(config), 0).eval()


def test_led_encoder_is_patched(kernel_calls):
    """LED (Longformer-Encoder-Decoder): its encoder's self-attention runs on our kernels, same outputs."""
    model = _led()
    ids, attention_mask, global_mask = random_batch(3, [19, 12], 97, [1, 1])
    decoder_ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(4))
    inputs = dict(input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask,
                  decoder_input_ids=decoder_ids)
    with torch.no_grad():
        expected = model(**inputs).logits
        hf.patch(model)
        got = model(**inputs).logits
    assert kernel_calls
    assert_close(got, expected, ATOL, "LED logits")


def test_gradient_checkpointing(kernel_calls):
    """gradient_checkpointing_enable(): the patched model's gradients are the unpatched model's."""
    model = _model("LongformerForSequenceClassification")
    model.gradient_checkpointing_enable()
    inputs = _inputs("LongformerForSequenceClassification")
    expected = _outputs(model, inputs, training=True)
    hf.patch(model)
    got = _outputs(model, inputs, training=True)
    assert kernel_calls
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        assert_close(a, e, ATOL, f"checkpointed output/gradient {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_model(dtype, kernel_calls):
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
    options = dict(attention_mask=attention_mask, global_attention_mask=global_mask, max_new_tokens=8,
                   do_sample=False, num_beams=1)
    expected = model.generate(ids, **options)
    hf.patch(model)
    got = model.generate(ids, **options)
    assert kernel_calls
    assert torch.equal(got, expected), (got, expected)
