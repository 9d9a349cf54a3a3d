"""LongformerModel / LongformerForMaskedLM against transformers (strict state-dict transfer, every
attention mode), checkpoint loading, batch consistency, a tiny MLM training run, gradients."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest
import torch
from hf_helpers import PAD, assert_close, hf_config, random_batch, random_hf_windows, randomize_, single_thread

from longformer_ops import AttentionMode, LongformerConfig, LongformerForMaskedLM, LongformerModel, from_hf_pretrained

transformers = pytest.importorskip("transformers")

_ = single_thread  # autouse fixture: these tiny ops only lose from intra-op threads on a loaded machine
MODES = list(AttentionMode)
ATOL = 1e-4  # float32, the bar

# (seed, sequence lengths in the batch (padding = shorter ones), global tokens per example, hidden, heads)
CASES = [
    (0, [13, 9, 11], [3, 1, 0], 32, 4),
    (1, [21, 21, 16], [2, 4, 1], 24, 4),  # head_dim 6
]


def hf_pair(seed, hidden, heads, layers=3, masked_lm=False):
    """A randomly initialised transformers model (eval) and its converted config."""
    torch.manual_seed(seed)
    hf_cfg = hf_config(random_hf_windows(seed, layers), hidden=hidden, heads=heads)
    hf_cls = transformers.LongformerForMaskedLM if masked_lm else transformers.LongformerModel
    hf = randomize_(hf_cls(hf_cfg), seed).eval()
    return hf, hf_cfg


def ours_from(hf, hf_cfg, mode, cls=LongformerModel):
    model = cls(LongformerConfig.from_hf(hf_cfg, attention_mode=mode)).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


def hf_run(hf, **inputs):
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return hf(**inputs, output_attentions=True, output_hidden_states=True)


def compare_outputs(out, ref, attention_mask, global_mask, what):
    real = attention_mask.bool()  # [b, n]
    assert_close(out.last_hidden_state[real], ref.last_hidden_state[real], ATOL, f"{what} last_hidden_state")
    assert len(out.hidden_states) == len(ref.hidden_states)
    for i, (a, r) in enumerate(zip(out.hidden_states, ref.hidden_states, strict=True)):
        assert_close(a[real], r[real], ATOL, f"{what} hidden_states[{i}]")
    for i, (a, r) in enumerate(zip(out.attentions, ref.attentions, strict=True)):  # [b, h, n, g + 2w + 1]
        assert a.shape == r.shape, (a.shape, r.shape)
        assert_close(a.transpose(1, 2)[real], r.transpose(1, 2)[real], ATOL, f"{what} attentions[{i}]")
    # global_attentions [b, h, n, g]: transformers leaves them at its internally padded length and fills
    # the empty global slots of an example with 1/n; compare the real keys of the real slots.
    counts = (global_mask.bool() & real).sum(1)
    for i, (a, r) in enumerate(zip(out.global_attentions, ref.global_attentions, strict=True)):
        assert a.shape[:2] == r.shape[:2] and a.shape[2] == real.shape[1] and a.shape[3] == r.shape[3]
        r = r[:, :, : real.shape[1]]
        for b, c in enumerate(counts.tolist()):
            assert_close(a[b, :, real[b], :c], r[b, :, real[b], :c], ATOL, f"{what} global_attentions[{i}]")
            assert (a[b, :, :, c:] == 0).all()


@pytest.mark.parametrize("seed, lengths, globals_, hidden, heads", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_model_matches_transformers(mode, seed, lengths, globals_, hidden, heads):
    hf, hf_cfg = hf_pair(seed, hidden, heads)
    model = ours_from(hf, hf_cfg, mode)
    ids, attention_mask, global_mask = random_batch(seed, lengths, hf_cfg.vocab_size, globals_)
    inputs = dict(input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask)
    ref = hf_run(hf, **inputs)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    compare_outputs(out, ref, attention_mask, global_mask, mode.value)
    assert_close(out.pooler_output, ref.pooler_output, ATOL, "pooler_output")


def test_model_matches_transformers_inputs_embeds_and_token_types():
    hf, hf_cfg = hf_pair(2, 32, 4, layers=2)
    model = ours_from(hf, hf_cfg, AttentionMode.TVM)
    ids, attention_mask, global_mask = random_batch(2, [10, 7], hf_cfg.vocab_size, [1, 2])
    token_types = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(0))
    embeds = hf.embeddings.word_embeddings(ids).detach()
    inputs = dict(
        inputs_embeds=embeds,
        attention_mask=attention_mask,
        global_attention_mask=global_mask,
        token_type_ids=token_types,
    )
    ref = hf_run(hf, **inputs)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    compare_outputs(out, ref, attention_mask, global_mask, "inputs_embeds")


@pytest.mark.parametrize("mode", MODES)
def test_masked_lm_matches_transformers(mode):
    hf, hf_cfg = hf_pair(3, 32, 4, masked_lm=True)
    model = ours_from(hf, hf_cfg, mode, LongformerForMaskedLM)
    ids, attention_mask, global_mask = random_batch(3, [17, 12], hf_cfg.vocab_size, [2, 1])
    gen = torch.Generator().manual_seed(3)
    labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.3, ids, -100).masked_fill(attention_mask == 0, -100)
    inputs = dict(input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask, labels=labels)
    ref = hf_run(hf, **inputs)
    with torch.no_grad():
        out = model(**inputs)
    real = attention_mask.bool()
    assert_close(out.logits[real], ref.logits[real], ATOL, "logits")
    assert_close(out.loss, ref.loss, ATOL, "loss")
    assert out.hidden_states is None and out.attentions is None


@pytest.mark.parametrize(
    "hf_name, cls", [("LongformerModel", LongformerModel), ("LongformerForMaskedLM", LongformerForMaskedLM)]
)
def test_state_dict_keys_and_reverse_transfer(hf_name, cls):
    """Same key names; transformers loads our weights (config via to_hf) strictly and agrees."""
    cfg = LongformerConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=40,
        attention_window=[2, 4],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    ours = randomize_(cls(cfg), 4).eval()
    hf = getattr(transformers, hf_name)(cfg.to_hf()).eval()
    assert set(ours.state_dict()) == set(hf.state_dict())
    hf.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(3, 60, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), hf(ids)
    key = "logits" if cls is LongformerForMaskedLM else "last_hidden_state"
    assert_close(getattr(a, key), getattr(b, key), ATOL, f"{cls.__name__} reverse")
    if cls is LongformerForMaskedLM:  # tied as in transformers: one tensor, two names
        assert ours.lm_head.decoder.weight is ours.longformer.embeddings.word_embeddings.weight
        assert ours.lm_head.decoder.bias is ours.lm_head.bias


def test_from_hf_pretrained(tmp_path):
    hf, hf_cfg = hf_pair(5, 32, 4, layers=2, masked_lm=True)
    ids, attention_mask, global_mask = random_batch(5, [14, 10], hf_cfg.vocab_size, [1, 2])
    inputs = dict(input_ids=ids, attention_mask=attention_mask, global_attention_mask=global_mask)
    ref = hf_run(hf, **inputs)
    real = attention_mask.bool()

    # 1. save_pretrained (safetensors; transformers stores tied tensors once) -> MaskedLM, TVM mode.
    hf.save_pretrained(tmp_path / "mlm")
    mlm = from_hf_pretrained(tmp_path / "mlm")
    assert isinstance(mlm, LongformerForMaskedLM) and not mlm.training
    assert mlm.config.attention_mode is AttentionMode.TVM
    with torch.no_grad():
        assert_close(mlm(**inputs).logits[real], ref.logits[real], ATOL, "safetensors MaskedLM")

    # 2. The base model out of the MaskedLM checkpoint (no pooler there, the LM head dropped: both
    # warned), another mode.
    with pytest.warns(UserWarning) as caught:
        base = from_hf_pretrained(tmp_path / "mlm", LongformerModel, attention_mode="sliding_chunks")
    messages = [str(w.message) for w in caught]
    assert any("no pooler weights" in m for m in messages), messages
    assert any("not used by LongformerModel" in m and "'lm_head.dense.weight'" in m for m in messages), messages
    with torch.no_grad():
        out = base(**inputs, output_hidden_states=True)
    assert_close(out.last_hidden_state[real], ref.hidden_states[-1][real], ATOL, "base from MaskedLM checkpoint")

    # 3. A pytorch_model.bin checkpoint of a base model (older transformers' format).
    hf_base, _ = hf_pair(6, 32, 4, layers=2)
    hf_base.config.save_pretrained(tmp_path / "bin")
    torch.save(hf_base.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    base = from_hf_pretrained(tmp_path / "bin")
    assert isinstance(base, LongformerModel)
    base_ref = hf_run(hf_base, **inputs)
    with torch.no_grad():
        out = base(**inputs)
    assert_close(out.last_hidden_state[real], base_ref.last_hidden_state[real], ATOL, "bin")
    assert_close(out.pooler_output, base_ref.pooler_output, ATOL, "bin pooler")

    # 4. Sharded safetensors (an index file and several shards).
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        logits = from_hf_pretrained(tmp_path / "sharded")(**inputs).logits
    assert_close(logits[real], ref.logits[real], ATOL, "sharded")

    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_hf_pretrained(tmp_path / "missing")
    with pytest.raises(TypeError, match="model_class must be one of LongformerModel, LongformerForMaskedLM"):
        from_hf_pretrained(tmp_path / "mlm", torch.nn.Linear)


def test_batch_consistency_padded_batch_equals_one_by_one():
    """With per-head dilation and autoregressive attention too (what transformers does not have)."""
    for extra in ({}, dict(attention_dilation=[[1, 2, 1, 3], 1], autoregressive=True)):
        cfg = LongformerConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=40,
            attention_window=[2, 3],
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **extra,
        )
        torch.manual_seed(6)
        model = randomize_(LongformerModel(cfg), 6).eval()
        ids, attention_mask, global_mask = random_batch(6, [15, 8, 11], 50, [2, 0, 3])
        with torch.no_grad():
            batch = model(ids, attention_mask, global_mask, output_attentions=True)
            for b, length in enumerate([15, 8, 11]):
                one = model(ids[b : b + 1, :length], None, global_mask[b : b + 1, :length], output_attentions=True)
                assert_close(batch.last_hidden_state[b, :length], one.last_hidden_state[0], ATOL, f"example {b}")
                g = int(global_mask[b].sum())
                for a_batch, a_one in zip(batch.attentions, one.attentions, strict=True):  # [1, h, n, g_one + c]
                    assert_close(a_batch[b, :, :length, :g], a_one[0, :, :, :g], ATOL, "global columns")
                    assert_close(a_batch[b, :, :length, 3:], a_one[0, :, :, g:], ATOL, "band columns")


def test_autoregressive_model_is_causal():
    cfg = LongformerConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        attention_window=3,
        attention_dilation=[[1, 1, 2, 2], [1, 2, 3, 4]],
        autoregressive=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = randomize_(LongformerModel(cfg), 7).eval()
    ids, _, global_mask = random_batch(7, [20], 50, [3])
    changed = ids.clone()
    changed[0, 12:] = 3 + (ids[0, 12:] - 3 + torch.randint(1, 47, (8,))) % 47  # another token at each position
    with torch.no_grad():
        a, b = model(ids, global_attention_mask=global_mask), model(changed, global_attention_mask=global_mask)
    assert_close(a.last_hidden_state[:, :12], b.last_hidden_state[:, :12], 1e-6, "causal prefix")
    # ... and the model does read the suffix: every changed position's output changed.
    moved = (a.last_hidden_state[0, 12:] - b.last_hidden_state[0, 12:]).abs().amax(-1)
    assert (moved > 1e-3).all(), moved


def tiny_mlm_config(mode) -> LongformerConfig:
    return LongformerConfig(
        vocab_size=24,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        attention_window=[2, 3],
        attention_dilation=[1, [1, 2, 1, 2]],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attention_mode=mode,
    )


def synthetic_mlm_batch(seed, batch=8, n=18, vocab=24, mask_id=3):
    """Arithmetic sequences mod (vocab - 4) over ids 4..: a masked token is predictable from its neighbours."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab - 4, (batch, 1), generator=gen)
    step = torch.randint(1, 3, (batch, 1), generator=gen)
    ids = (start + step * torch.arange(n)) % (vocab - 4) + 4
    masked = torch.rand(batch, n, generator=gen) < 0.2
    labels = torch.where(masked, ids, -100)
    attention_mask = torch.ones(batch, n, dtype=torch.long)
    attention_mask[: batch // 2, n - 5 :] = 0  # half the batch padded
    inputs = ids.masked_fill(masked, mask_id).masked_fill(attention_mask == 0, PAD)
    labels = labels.masked_fill(attention_mask == 0, -100)
    global_mask = torch.zeros(batch, n, dtype=torch.long)
    global_mask[:, 0] = 1
    return dict(input_ids=inputs, attention_mask=attention_mask, global_attention_mask=global_mask, labels=labels)


def test_tiny_mlm_trains_with_tvm_and_gradients_match_full():
    torch.manual_seed(8)
    model = LongformerForMaskedLM(tiny_mlm_config(AttentionMode.TVM))
    full = LongformerForMaskedLM(tiny_mlm_config(AttentionMode.FULL))
    full.load_state_dict(model.state_dict(), strict=True)

    # Gradients on the same weights and batch: the kernels' backward against dense autograd.
    batch = synthetic_mlm_batch(0)
    model(**batch).loss.backward()
    full(**batch).loss.backward()
    full_grads = dict(full.named_parameters())
    for name, p in model.named_parameters():
        expected = full_grads[name].grad
        scale = expected.abs().max().item()
        assert_close(p.grad, expected, 1e-4 * scale + 1e-7, f"grad {name}")
    model.zero_grad()

    # A few Adam steps on one synthetic batch: the loss must fall well below its start.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 3))
    assert losses[-1] < 0.6 * losses[0] and losses == sorted(losses, reverse=True), losses


def test_model_input_errors():
    cfg = LongformerConfig(
        vocab_size=20,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=12,
        attention_window=2,
    )
    model = LongformerModel(cfg)
    ids = torch.randint(3, 20, (1, 5))
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        model()
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        model(ids, inputs_embeds=torch.zeros(1, 5, 8))
    with pytest.raises(ValueError, match=r"position id 12 is out of range: max_position_embeddings=12"):
        model(torch.randint(3, 20, (1, 11)))
    for name in ("attention_mask", "global_attention_mask"):  # torch would broadcast these silently
        for shape in ((5,), (1, 1), (2, 5), (1, 6)):
            with pytest.raises(
                ValueError,
                match=rf"{name} must be \[batch, seq_len\] = \(1, 5\), like the input, "
                rf"got shape {re.escape(str(shape))}",
            ):
                model(ids, **{name: torch.ones(shape, dtype=torch.long)})
    empty = torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"the input has no token \(shape \(2, 0\)\) and the pooler reads the first"):
        model(empty)
    assert LongformerModel(cfg, add_pooling_layer=False)(empty).last_hidden_state.shape == (2, 0, 8)


def test_import_is_cheap():
    """``import longformer_ops`` pulls in neither transformers nor the TVM compiler or its runtime, nor
    torch's compiler (``torch._dynamo``, about 1 s to import); a first kernel call adds the runtime
    (``tvm_ffi``) but still not torch's compiler (torch.library.custom_op's implementations import it
    at their first call: the ops are registered without that wrapper)."""
    code = (
        "import sys, torch, longformer_ops\n"
        "def heavy(): return sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'tvm', 'tvm_ffi', 'safetensors')} | {m for m in ('torch._dynamo',) if m in sys.modules})\n"
        "assert heavy() == [], heavy()\n"
        "x = torch.randn(1, 16, 2, 8)\n"
        "longformer_ops.sliding_window_attention(x, x, x, 2)\n"
        "assert heavy() == ['tvm_ffi'], heavy()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_masked_lm_loss_dtype(dtype):
    """The loss keeps float64 (no float32 round trip); half types are computed in float32."""
    model = LongformerForMaskedLM(tiny_mlm_config("tvm")).to(dtype).eval()
    batch = synthetic_mlm_batch(3)
    with torch.no_grad():
        out = model(**batch)
    scores = out.logits.float() if dtype == torch.bfloat16 else out.logits
    expected = torch.nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), batch["labels"].reshape(-1))
    assert out.loss.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    assert torch.equal(out.loss, expected)


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu", "silu", "tanh"])
def test_inference_path_equals_autograd_path(act):
    """Without autograd the FFN's activation runs in place in recycled memory (an intermediate of
    >= 1 MiB here, so the output cache serves it) and the residuals are added in place: the same
    numbers, bit for bit, as the autograd path, twice in a row (the second call reuses memory)."""
    torch.manual_seed(0)
    config = LongformerConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_hidden_layers=2,
        intermediate_size=256,
        attention_window=16,
        hidden_act=act,
        max_position_embeddings=1100,
    )
    model = LongformerModel(config).eval()
    ids = torch.randint(5, 100, (1, 1024))
    expected = model(input_ids=ids).last_hidden_state
    assert expected.requires_grad  # (the autograd path ran)
    for _ in range(2):
        with torch.no_grad():
            got = model(input_ids=ids).last_hidden_state
        assert torch.equal(got, expected), (got - expected).abs().max()
