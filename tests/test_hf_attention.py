"""transformers' sliding-window models through ``attn_implementation="longformer_ops"``
(:mod:`longformer_ops.hf.attention`), against transformers' own ``eager`` attention: tiny random
configs, float64, padding on either side, every parameter's gradient, greedy generation."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import stable_seed
from hf_helpers import single_thread  # noqa: F401  (one intra-op thread for these tiny models)

transformers = pytest.importorskip("transformers")

from longformer_ops import hf  # noqa: E402
from longformer_ops.hf import attention as hf_attention  # noqa: E402


@pytest.fixture
def kernel_calls(monkeypatch):
    """The windows the fused kernels ran with (one entry per sliding layer call)."""
    calls = []
    original = hf_attention.sliding_window_attention

    def spy(q, k, v, w, *args, **kwargs):
        calls.append(w)
        return original(q, k, v, w, *args, **kwargs)

    monkeypatch.setattr(hf_attention, "sliding_window_attention", spy)
    return calls


def _randomize(model, seed, std=0.2):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * std)
    return model


def _batch(seed, lengths, vocab, left_padding=False):
    generator = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), n), generator=generator)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for row, length in enumerate(lengths):
        if left_padding:
            mask[row, n - length :] = 1
        else:
            mask[row, :length] = 1
    return ids, mask


def _modernbert(name, local_attention=8, **kwargs):
    config = transformers.ModernBertConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        global_attn_every_n_layers=3,
        local_attention=local_attention,
        max_position_embeddings=128,
        pad_token_id=0,
        attention_dropout=0.0,
        embedding_dropout=0.0,
        mlp_dropout=0.0,
        num_labels=3,
        **kwargs,
    )
    return getattr(transformers, name)(config)


def _mistral(sliding_window=5):
    config = transformers.MistralConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=sliding_window,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.MistralForCausalLM(config)


def _outputs_and_grads(model, implementation, ids, mask, **inputs):
    model.set_attn_implementation(implementation)
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, **inputs)
    logits = out.logits
    real = mask.bool()[..., None] if logits.dim() == 3 else torch.ones_like(logits, dtype=torch.bool)
    weights = torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)
    (logits * weights).masked_fill(~real, 0).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.masked_fill(~real, 0).detach(), grads


def _unpadded_eager_outputs_and_grads(model, ids, mask):
    """What :func:`_outputs_and_grads` gives for a right-padded batch, from the model's ``eager`` run on
    each sequence alone, unpadded (its gradients summed over them): float64's reference where sdpa
    lacks the model's features (soft-capping, sinks) and eager gives NaN in float64 with padding."""
    model.set_attn_implementation("eager")
    model.zero_grad()
    lengths = mask.sum(1).tolist()
    assert all(bool(mask[row, :length].all()) for row, length in enumerate(lengths)), "right padding only"
    logits = None
    for row, length in enumerate(lengths):
        out = model(input_ids=ids[row : row + 1, :length]).logits[0]
        if logits is None:
            logits = out.new_zeros(*ids.shape, out.shape[-1])
        logits[row, :length] = out.detach()
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    return logits, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_matches_eager(model, ids, mask, calls, exact_run=None, **inputs):
    """Ours in float32 errs against transformers' float64 (``sdpa``: its ``eager`` computes the softmax
    in float32 whatever the dtype, and gives NaN in float64 where a mask is added; ``exact_run``, e.g.
    :func:`_unpadded_eager_outputs_and_grads`, instead) at most twice as much as transformers' ``eager``
    in float32, plus a few units roundoff: outputs and every gradient."""
    hf.register()
    model = _randomize(model.double(), stable_seed(type(model).__name__)).train(False)
    if exact_run is None:
        exact, exact_grads = _outputs_and_grads(model, "sdpa", ids, mask, **inputs)
    else:
        exact, exact_grads = exact_run(model, ids, mask)
    model = model.float()
    theirs, their_grads = _outputs_and_grads(model, "eager", ids, mask, **inputs)
    assert not calls
    ours, our_grads = _outputs_and_grads(model, hf_attention.NAME, ids, mask, **inputs)
    assert calls, "the kernels did not run"
    assert our_grads.keys() == their_grads.keys() == exact_grads.keys()
    unit = torch.finfo(torch.float32).eps / 2
    # The roundoff term's scale: a gradient's own size says nothing of its terms' where they cancel
    # (a key bias's gradient is 0 exactly: softmax ignores a constant per row), so all gradients' largest.
    gradient_scale = max(grad.abs().max().item() for grad in exact_grads.values())
    for name, got, bar, reference in [("output", ours, theirs, exact)] + [
        (key, our_grads[key], their_grads[key], exact_grads[key]) for key in exact_grads
    ]:
        error, their_error = ((x.double() - reference).abs().max().item() for x in (got, bar))
        bound = 2 * their_error + 8 * unit * (reference.abs().max().item() if name == "output" else gradient_scale)
        assert error <= bound, f"{name}: error {error:.3e} > {bound:.3e} (eager's {their_error:.3e})"


@pytest.mark.parametrize("left_padding", [False, True], ids=["right_padded", "left_padded"])
@pytest.mark.parametrize("name", ["ModernBertModel", "ModernBertForMaskedLM", "ModernBertForSequenceClassification"])
def test_modernbert_matches_eager(name, left_padding, kernel_calls):
    """ModernBERT (bidirectional window 2 x 4 + 1, one full layer in three): outputs and every
    parameter's gradient equal eager's, with the sliding layers on the kernels (w = 4)."""
    model = _modernbert(name)
    ids, mask = _batch(stable_seed(name, left_padding), [23, 15], 61, left_padding)
    _assert_matches_eager(model if name != "ModernBertModel" else _LastHidden(model), ids, mask, kernel_calls)
    assert set(kernel_calls) == {4}


class _LastHidden(torch.nn.Module):
    """A base model's last hidden state as ``.logits`` (for the comparisons above)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def set_attn_implementation(self, name):
        self.model.set_attn_implementation(name)

    def forward(self, **inputs):
        return type("Out", (), {"logits": self.model(**inputs).last_hidden_state})()


@pytest.mark.parametrize("left_padding", [False, True], ids=["right_padded", "left_padded"])
def test_mistral_matches_eager_with_grouped_heads(left_padding, kernel_calls):
    """Mistral (causal window 5, 4 query heads on 2 key/value heads): outputs and gradients equal eager's."""
    ids, mask = _batch(stable_seed("mistral", left_padding), [21, 12], 61, left_padding)
    _assert_matches_eager(_mistral(), ids, mask, kernel_calls)
    assert set(kernel_calls) == {4}


_CAUSAL_FAMILIES = {  # (config class, model class, options): each with sliding layers, most beside full ones
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, max_window_layers=1)),
    "Gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(head_dim=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    ),
    "Cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    ),
    "Starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "Olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {}),
}


def _causal_lm(family, sliding_window=5):
    config_class, model_class, options = _CAUSAL_FAMILIES[family]
    config = getattr(transformers, config_class)(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=sliding_window,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **options,
    )
    return getattr(transformers, model_class)(config)


@pytest.mark.parametrize("family", list(_CAUSAL_FAMILIES))
def test_causal_families_match_eager(family, kernel_calls):
    """Other families with causal sliding layers (grouped heads, left padding): outputs and every
    gradient as eager's, their sliding layers on the kernels."""
    ids, mask = _batch(stable_seed(family), [19, 11], 61, left_padding=True)
    _assert_matches_eager(_causal_lm(family), ids, mask, kernel_calls)
    assert set(kernel_calls) == {4}


@pytest.mark.parametrize("left_padding", [False, True], ids=["right_padded", "left_padded"])
def test_embeddinggemma_matches_eager(left_padding, kernel_calls):
    """EmbeddingGemma's encoder: Gemma 3 with ``use_bidirectional_attention`` (its sliding layers see
    ``|q - kv| < W``; the model ORs that into the causal window's mask, and its config halves the
    window given, 5 -> 5 // 2 + 1): outputs and every gradient as eager's, the sliding layers on the
    kernels (w = W - 1 = 2)."""
    config = transformers.Gemma3TextConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        max_position_embeddings=128,
        pad_token_id=0,
        use_bidirectional_attention=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    ids, mask = _batch(stable_seed("embeddinggemma", left_padding), [23, 15], 61, left_padding)
    _assert_matches_eager(_LastHidden(transformers.Gemma3TextModel(config)), ids, mask, kernel_calls)
    assert config.sliding_window == 3 and set(kernel_calls) == {2}


def test_a_window_one_off_fails_the_comparison(monkeypatch, kernel_calls):
    """The comparisons above see a window one key too wide."""
    monkeypatch.setattr(hf_attention, "one_sided_window", lambda sliding_window: sliding_window)
    ids, mask = _batch(5, [23, 15], 61)
    with pytest.raises(AssertionError, match=r"output: error .* > .* \(eager's"):
        _assert_matches_eager(_modernbert("ModernBertForMaskedLM"), ids, mask, kernel_calls)


@pytest.mark.parametrize("sliding_window", [4, 16], ids=["window4", "window16"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_mistral_generates_eagers_tokens(kernel_calls, cache, sliding_window):
    """Greedy generation with a cache (transformers' dynamic one, which keeps the window's keys, and
    its static one, whose unwritten slots the keys must leave out while the prompt and the tokens
    so far are shorter than the window): the prefill on the kernels, the steps on sdpa over the
    window, no warning, the same tokens as eager."""
    model = _randomize(
        _mistral(sliding_window=sliding_window), 3, std=0.3
    ).eval()  # (float32: eager gives NaN in float64)
    _assert_generates_eagers_tokens(model, 8, 9, kernel_calls, cache_implementation=cache)


def _assert_generates_eagers_tokens(model, seed, tokens, kernel_calls, **options):
    """Greedy ``generate()`` on "longformer_ops" gives eager's tokens for a left-padded batch, with no
    warning, the kernels having run."""
    hf.register()
    ids, mask = _batch(seed, [11, 7], 61, left_padding=True)
    options = dict(
        attention_mask=mask,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=0,
        **options,
    )
    model.set_attn_implementation("eager")
    expected = model.generate(ids, **options)
    model.set_attn_implementation(hf_attention.NAME)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = model.generate(ids, **options)
    assert kernel_calls
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("family", ["Gemma2", "GptOss"])
def test_softcap_and_sink_models_generate_eagers_tokens(kernel_calls, family):
    """Greedy generation of Gemma 2 (soft-cap) and gpt-oss (sinks): the prefill on the kernels, the
    steps on the model's eager over the window's keys, no warning, the same tokens as eager."""
    model = _randomize(_gemma2(4) if family == "Gemma2" else _gpt_oss(4), 7, std=0.3).eval()
    _assert_generates_eagers_tokens(model, 9, 8, kernel_calls)


@pytest.mark.parametrize("chunks", [(10, 9), (10, 2, 7), (6, 6, 7)], ids=str)
def test_chunked_prefill_equals_one_pass(kernel_calls, chunks):
    """A prompt fed in chunks through the cache (chunks of at least the window on the kernels, their
    queries at an offset into the keys; shorter ones on sdpa over the window) gives the one-pass
    logits, left padding included (float64)."""
    hf.register()
    model = _randomize(_mistral(sliding_window=4), 11).double().eval()
    ids, mask = _batch(12, [19, 13], 61, left_padding=True)
    model.set_attn_implementation(hf_attention.NAME)
    real = mask.bool()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        cache, start, parts = transformers.DynamicCache(config=model.config), 0, []
        for size in chunks:
            kernel_calls.clear()
            out = model(
                input_ids=ids[:, start : start + size],
                attention_mask=mask[:, : start + size],
                past_key_values=cache,
                use_cache=True,
            )
            assert bool(kernel_calls) == (size >= 4), (size, kernel_calls)
            parts.append(out.logits)
            start += size
    got = torch.cat(parts, dim=1)
    torch.testing.assert_close(got[real], expected[real], rtol=1e-10, atol=1e-10)


def test_register_is_idempotent():
    hf.register()
    hf.register()
    assert transformers.AttentionInterface._global_mapping[hf_attention.NAME] is hf_attention.attention_forward
    assert transformers.AttentionMaskInterface._global_mapping[hf_attention.NAME] is hf_attention.padding_mask


def test_patch_switches_a_sliding_window_model_and_unpatch_switches_back(kernel_calls):
    """``hf.patch`` on a model with sliding layers selects "longformer_ops" (registering it);
    ``hf.unpatch`` restores the implementation it had."""
    model = _mistral()
    model.set_attn_implementation("sdpa")
    assert hf.patch(model) is model and model.config._attn_implementation == hf_attention.NAME
    ids, mask = _batch(2, [9, 6], 61)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert kernel_calls
    assert hf.unpatch(model) is model and model.config._attn_implementation == "sdpa"


def _assert_falls_back_to_eager(model, feature: str, seed: int, kernel_calls):
    """The model's sliding layers run its own eager attention (one warning naming ``feature``, however
    many calls), with eager's results, and the kernels never."""
    hf.register()
    model = _randomize(model, seed).eval()
    ids, mask = _batch(seed, [13, 9], 61, left_padding=True)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation(hf_attention.NAME)
        hf_attention._warned.clear()
        with pytest.warns(UserWarning, match=feature) as caught:
            got = model(input_ids=ids, attention_mask=mask).logits
            model(input_ids=ids, attention_mask=mask)
    assert sum(feature in str(w.message) for w in caught) == 1
    assert not kernel_calls
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def _gemma2(sliding_window, softcap=0.5):
    """Gemma 2 with a soft-cap near its scores' size (random weights: a few tenths), so that tanh bends them."""
    config = transformers.Gemma2Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=sliding_window,
        max_position_embeddings=64,
        pad_token_id=0,
        attn_logit_softcapping=softcap,
        final_logit_softcapping=None,
        query_pre_attn_scalar=1,
    )
    return transformers.Gemma2ForCausalLM(config)


def _gpt_oss(sliding_window):
    config = transformers.GptOssConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=sliding_window,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
        pad_token_id=0,
        experts_implementation="eager",
    )  # (float64: torch's grouped_mm takes no double)
    return transformers.GptOssForCausalLM(config)


@pytest.mark.parametrize("sliding_window", [4, 40], ids=["window4", "window40"])
def test_gemma2_softcap_matches_eager(sliding_window, kernel_calls):
    """Gemma 2's logit soft-capping on the kernels (forward and backward), windows shorter and longer
    than the sequences: outputs and every gradient as eager's (float64 reference: eager per sequence)."""
    ids, mask = _batch(stable_seed("gemma2", sliding_window), [19, 11], 61)
    _assert_matches_eager(_gemma2(sliding_window), ids, mask, kernel_calls, _unpadded_eager_outputs_and_grads)
    assert set(kernel_calls) == {sliding_window - 1}


@pytest.mark.parametrize("sliding_window", [4, 40], ids=["window4", "window40"])
def test_gpt_oss_sinks_match_eager(sliding_window, kernel_calls):
    """gpt-oss's attention sinks (``s_aux``, through the kernels' log-sum-exp) with grouped heads:
    outputs and every gradient, the sinks' own included, as eager's."""
    ids, mask = _batch(stable_seed("gpt-oss", sliding_window), [19, 11], 61)
    _assert_matches_eager(_gpt_oss(sliding_window), ids, mask, kernel_calls, _unpadded_eager_outputs_and_grads)
    assert set(kernel_calls) == {sliding_window - 1}


@pytest.mark.parametrize("fault", ["softcap", "sinks"])
def test_a_dropped_softcap_or_sink_fails_the_comparison(monkeypatch, kernel_calls, fault):
    """The comparisons above see the soft-cap or the sinks left out."""
    if fault == "softcap":
        original = hf_attention.sliding_window_attention
        monkeypatch.setattr(
            hf_attention, "sliding_window_attention", lambda *args, softcap=None, **kwargs: original(*args, **kwargs)
        )
        model = _gemma2(4)
    else:
        monkeypatch.setattr(hf_attention, "with_sinks", lambda out, lse, sinks: out + 0 * sinks.sum())
        model = _gpt_oss(4)
    ids, mask = _batch(5, [19, 11], 61)
    with pytest.raises(AssertionError, match=r"output: error .* > .* \(eager's"):
        _assert_matches_eager(model, ids, mask, kernel_calls, _unpadded_eager_outputs_and_grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_modernbert_in_half_types_errs_as_sdpa(dtype, kernel_calls):
    """ModernBERT in a half type on the kernels errs against float64 at most twice as much as
    transformers' sdpa in that type (plus a few units roundoff)."""
    hf.register()
    model = _randomize(_modernbert("ModernBertForMaskedLM").double(), 9).eval()
    ids, mask = _batch(10, [29, 17], 61)
    real = mask.bool()
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        exact = model(input_ids=ids, attention_mask=mask).logits[real]
        half = model.to(dtype)
        theirs = half(input_ids=ids, attention_mask=mask).logits[real].double()
        half.set_attn_implementation(hf_attention.NAME)
        ours = half(input_ids=ids, attention_mask=mask).logits[real].double()
    assert kernel_calls
    error, their_error = ((x - exact).abs().max().item() for x in (ours, theirs))
    assert error <= 2 * their_error + 4 * torch.finfo(dtype).eps / 2 * exact.abs().max().item(), (error, their_error)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("window", [None, 1, 3, 40], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("q_length", [11, 3, 1])
def test_dense_mask_is_transformers_mask(causal, window, q_length):
    """The mask the calls on transformers' own attention get (full layers, generation steps, the
    fallbacks) is ``sdpa_mask``'s for the layer's window as the model passes it (``W`` to the
    attention function; ``W - 1`` for a bidirectional layer's mask, as ModernBERT builds it), with
    the queries the last of the keys and left padding."""
    from transformers import masking_utils as masks

    kv_length, batch = 11, 2
    padding = torch.ones(batch, kv_length, dtype=torch.bool)
    padding[1, :4] = False
    function = masks.causal_mask_function if causal else masks.bidirectional_mask_function
    if window is not None:
        function = (
            masks.sliding_window_causal_mask_function(window)
            if causal
            else masks.sliding_window_bidirectional_mask_function(window - 1)
        )
    expected = masks.sdpa_mask(
        batch,
        q_length,
        kv_length,
        q_offset=kv_length - q_length,
        mask_function=function,
        attention_mask=padding,
        allow_is_causal_skip=False,
    )
    got = hf_attention.dense_mask(padding, batch, q_length, kv_length, causal, window, "cpu")
    assert torch.equal(got.expand(expected.shape), expected)


def test_a_static_caches_unwritten_slots_are_left_out(monkeypatch):
    """A padding mask shorter than the keys (a static cache's slots past the tokens seen): the keys
    are cut to its length, the query is its last position (here with a window of 2: keys 2 and 3)."""
    seen = {}

    def sdpa(module, query, key, value, mask, **kwargs):
        seen.update(keys=key.shape[2], mask=mask)
        return query.transpose(1, 2), None

    monkeypatch.setattr("transformers.integrations.sdpa_attention.sdpa_attention_forward", sdpa)
    query, key = torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 6, 4)
    padding = torch.tensor([[True, True, True, True]])
    module = type("Layer", (), {"is_causal": True})()
    hf_attention.attention_forward(module, query, key, key, padding, sliding_window=2)
    assert seen["keys"] == 2 and seen["mask"].tolist() == [[[[True, True]]]]


@pytest.mark.parametrize("family", ["ModernBERT", "Gemma2"])
def test_models_compile_fullgraph(family, kernel_calls):
    """A model on "longformer_ops" compiles as one graph (no break: the padding mask stays a tensor
    under compilation) and gives eager's outputs and gradients, the soft-cap included (float32, the
    compiled graph's other ops rounded differently)."""
    hf.register()
    model = _modernbert("ModernBertForMaskedLM") if family == "ModernBERT" else _gemma2(4)
    model = _randomize(model, stable_seed("compile", family)).train(False)
    model.set_attn_implementation(hf_attention.NAME)
    ids, mask = _batch(3, [23, 15], 61)
    results = []
    for run in (model, torch.compile(model, fullgraph=True)):
        model.zero_grad()
        logits = run(input_ids=ids, attention_mask=mask).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        results.append([logits.detach()] + [p.grad.clone() for p in model.parameters()])
    assert kernel_calls
    for eager, compiled in zip(*results, strict=True):
        scale = eager.abs().max().item()
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("q_length", [9, 3], ids=["prefill", "with-cache"])
def test_a_callers_4d_mask_runs_sdpa_with_one_warning(q_length, kernel_calls):
    """A 4-D mask given as it is (the caller's own) runs transformers' sdpa with that mask, also with
    a cache (queries fewer than the keys), warning once; the kernels never run."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(4)
    query = torch.randn(2, 4, q_length, 8, generator=g, dtype=torch.float64)
    key, value = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(2, 1, q_length, 9, generator=g) < 0.7
    mask[..., -1] = True  # (no row without a key)
    module = type("Layer", (), {"is_causal": True, "num_key_value_groups": 2, "training": False})()
    hf_attention._warned.clear()
    with pytest.warns(UserWarning, match=r"an attention mask of shape \(2, 1, %d, 9\)" % q_length) as caught:
        got, _ = hf_attention.attention_forward(module, query, key, value, mask, scaling=0.3, sliding_window=3)
        hf_attention.attention_forward(module, query, key, value, mask, scaling=0.3, sliding_window=3)
    assert len(caught) == 1 and not kernel_calls
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3, is_causal=True)
    torch.testing.assert_close(got, expected)
