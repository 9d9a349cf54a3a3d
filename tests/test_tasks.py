"""The task models against transformers' own: strict weight transfer, logits and losses with given
and default global attention in every attention mode, padded lengths that are not window
multiples; checkpoints through from_hf_pretrained; dilation and autoregressive; the default masks'
edge cases; gradient checkpointing."""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_helpers import PAD, assert_close, hf_config, random_batch, random_hf_windows, randomize_, single_thread

from longformer_ops import (
    AttentionMode,
    LongformerConfig,
    LongformerForMaskedLM,
    LongformerForMultipleChoice,
    LongformerForQuestionAnswering,
    LongformerForSequenceClassification,
    LongformerForTokenClassification,
    LongformerModel,
    from_hf_pretrained,
)
from longformer_ops.models.tasks import choice_global_mask, question_global_mask

transformers = pytest.importorskip("transformers")

_ = single_thread  # autouse fixture: these tiny models only lose from intra-op threads
MODES = list(AttentionMode)
ATOL = 1e-4  # float32, as for the base model
BOS, SEP = 0, 2
TASKS = [
    "LongformerForSequenceClassification",
    "LongformerForTokenClassification",
    "LongformerForQuestionAnswering",
    "LongformerForMultipleChoice",
]
OURS = {
    cls.__name__: cls
    for cls in (
        LongformerForSequenceClassification,
        LongformerForTokenClassification,
        LongformerForQuestionAnswering,
        LongformerForMultipleChoice,
        LongformerForMaskedLM,
        LongformerModel,
    )
}


def qa_ids(seed: int, lengths: list[int], question_lengths: list[int], vocab: int):
    """``<s> question </s></s> text </s>`` then padding, per row: ids and attention_mask ``[rows, max(lengths)]``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), PAD)
    for row, (length, q) in enumerate(zip(lengths, question_lengths, strict=True)):
        ids[row, :length] = torch.randint(PAD + 2, vocab, (length,), generator=gen)
        ids[row, 0], ids[row, q], ids[row, q + 1], ids[row, length - 1] = BOS, SEP, SEP, SEP
    return ids, (ids != PAD).long()


def task_batch(task: str, seed: int, vocab: int, num_labels: int):
    """Inputs (with labels) for ``task``: padded rows of lengths that are no window multiple."""
    gen = torch.Generator().manual_seed(seed + 100)
    if task == "LongformerForMultipleChoice":  # 2 questions x 3 choices, [2, 3, 15]
        ids, mask = qa_ids(seed, [15, 12, 14, 9, 15, 11], [3, 3, 3, 4, 4, 4], vocab)
        ids, mask = ids.view(2, 3, -1), mask.view(2, 3, -1)
        return dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([2, 0]))
    ids, mask = qa_ids(seed, [17, 11, 14], [4, 2, 5], vocab)
    inputs = dict(input_ids=ids, attention_mask=mask)
    if task == "LongformerForSequenceClassification":
        inputs["labels"] = torch.randint(0, num_labels, (3,), generator=gen)
    elif task == "LongformerForTokenClassification":
        inputs["labels"] = torch.randint(0, num_labels, ids.shape, generator=gen).masked_fill(mask == 0, -100)
    else:  # question answering: one position past the sequence (ignored by both)
        inputs["start_positions"] = torch.tensor([5, 7, 40])
        inputs["end_positions"] = torch.tensor([9, 8, 40])
    return inputs


def hf_task(task: str, seed: int, layers: int = 2, num_labels: int = 3):
    torch.manual_seed(seed)
    if task == "LongformerForQuestionAnswering":
        num_labels = 2
    cfg = hf_config(random_hf_windows(seed, layers), num_labels=num_labels)
    return randomize_(getattr(transformers, task)(cfg), seed).eval(), cfg


def ours_from(hf, cfg, task: str, mode=AttentionMode.TVM):
    model = OURS[task](LongformerConfig.from_hf(cfg, attention_mode=mode)).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


def hf_run(hf, **inputs):
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return hf(**inputs, output_hidden_states=True)


def real_rows(inputs) -> torch.Tensor:
    return inputs["attention_mask"].reshape(-1, inputs["attention_mask"].shape[-1]).bool()


def compare(task: str, out, ref, inputs, what: str):
    real = real_rows(inputs)
    if task == "LongformerForQuestionAnswering":
        assert_close(out.start_logits[real], ref.start_logits[real], ATOL, f"{what} start_logits")
        assert_close(out.end_logits[real], ref.end_logits[real], ATOL, f"{what} end_logits")
    elif task == "LongformerForTokenClassification":
        assert_close(out.logits[real], ref.logits[real], ATOL, f"{what} logits")
    else:
        assert_close(out.logits, ref.logits, ATOL, f"{what} logits")
    assert_close(out.loss, ref.loss, ATOL, f"{what} loss")
    assert len(out.hidden_states) == len(ref.hidden_states)
    assert_close(out.hidden_states[-1][real], ref.hidden_states[-1][real], ATOL, f"{what} last hidden state")


@pytest.mark.parametrize("global_attention", ["default", "given"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("task", TASKS)
def test_task_model_matches_transformers(task, mode, global_attention):
    seed = 11 + TASKS.index(task)
    hf, cfg = hf_task(task, seed)
    model = ours_from(hf, cfg, task, mode)
    inputs = task_batch(task, seed, cfg.vocab_size, cfg.num_labels)
    if global_attention == "given":  # random global tokens instead of the task's default
        shape = inputs["input_ids"].shape
        _, _, global_mask = random_batch(
            seed,
            [shape[-1]] * (inputs["input_ids"].numel() // shape[-1]),
            cfg.vocab_size,
            [2] * (inputs["input_ids"].numel() // shape[-1]),
        )
        inputs["global_attention_mask"] = global_mask.view(shape)
    ref = hf_run(hf, **inputs)
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    compare(task, out, ref, inputs, f"{task} {mode.value} {global_attention} globals")


@pytest.mark.parametrize("task", TASKS)
def test_state_dict_keys_and_reverse_transfer(task):
    """Same key names; transformers loads our weights (config via to_hf) strictly and agrees."""
    cfg = LongformerConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=40,
        attention_window=[2, 4],
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    ours = randomize_(OURS[task](cfg), 4).eval()
    hf = getattr(transformers, task)(cfg.to_hf()).eval()
    assert set(ours.state_dict()) == set(hf.state_dict())
    hf.load_state_dict(ours.state_dict(), strict=True)
    inputs = task_batch(task, 4, 60, 2)
    ref = hf_run(hf, **inputs)
    with torch.no_grad():
        out = ours(**inputs, output_hidden_states=True)
    compare(task, out, ref, inputs, f"{task} reverse")


def test_sequence_classification_losses_match_transformers():
    """regression (one label), multi-label (float labels) and the problem type kept in the config."""
    task = "LongformerForSequenceClassification"
    for num_labels, labels in (
        (1, torch.tensor([0.5, -1.0, 2.0])),
        (3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])),
    ):
        hf, cfg = hf_task(task, 21, num_labels=num_labels)
        model = ours_from(hf, cfg, task)
        inputs = dict(task_batch(task, 21, cfg.vocab_size, num_labels), labels=labels)
        ref = hf_run(hf, **inputs)
        with torch.no_grad():
            out = model(**inputs)
        assert model.config.problem_type == hf.config.problem_type
        assert_close(out.logits, ref.logits, ATOL, f"{hf.config.problem_type} logits")
        assert_close(out.loss, ref.loss, ATOL, f"{hf.config.problem_type} loss")


def test_default_global_masks_are_transformers():
    """Our default masks against transformers' own function, on rows of different layouts."""
    from transformers.models.longformer.modeling_longformer import _compute_global_attention_mask

    ids, _ = qa_ids(3, [17, 11, 14, 6], [4, 2, 5, 1], 50)
    assert torch.equal(question_global_mask(ids, SEP), _compute_global_attention_mask(ids, SEP).long())
    after = _compute_global_attention_mask(ids, SEP, before_sep_token=False).long()
    assert torch.equal(choice_global_mask(ids.view(2, 2, -1), SEP), after.view(2, 2, -1))
    assert question_global_mask(ids, SEP)[0].tolist()[:6] == [1, 1, 1, 1, 0, 0]  # <s> and the question


@pytest.mark.parametrize("separators", [0, 1, 4])
def test_default_global_attention_needs_three_separators(separators):
    ids = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(separators))
    ids[0, [2, 3, 11]] = SEP  # row 0 is fine; row 1 is not
    ids[1, list(range(1, 1 + separators))] = SEP
    cfg = LongformerConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=40,
        attention_window=2,
    )
    message = rf"exactly 3 separator tokens \(sep_token_id=2\) in every sequence .*sequence 1 has {separators}"
    with pytest.raises(ValueError, match=message):
        LongformerForQuestionAnswering(cfg)(ids)
    with pytest.raises(ValueError, match=message):
        LongformerForMultipleChoice(cfg)(ids[None])
    # ... and with the global tokens given there is no rule to satisfy.
    assert LongformerForQuestionAnswering(cfg)(ids, global_attention_mask=torch.zeros_like(ids)).start_logits.shape == (
        2,
        12,
    )


def test_question_answering_without_input_ids_warns_and_has_no_globals():
    cfg = LongformerConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=40,
        attention_window=2,
    )
    model = LongformerForQuestionAnswering(cfg).eval()
    embeds = torch.randn(1, 9, 16)
    with pytest.warns(UserWarning, match="no input_ids to find the question in"):
        out = model(inputs_embeds=embeds)
    with torch.no_grad():
        assert torch.equal(
            out.start_logits, model(inputs_embeds=embeds, global_attention_mask=torch.zeros(1, 9)).start_logits
        )
    with pytest.raises(ValueError, match="needs num_labels=2"):
        LongformerForQuestionAnswering(cfg.replace(num_labels=3))


@pytest.mark.parametrize("task", TASKS)
def test_dilated_autoregressive_task_models_equal_the_dense_reference(task):
    """What transformers has not: per-head dilation and causal attention, kernels against FULL mode."""
    cfg = LongformerConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        attention_window=[3, 2],
        attention_dilation=[[1, 2, 1, 3], 2],
        autoregressive=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(5)
    model = randomize_(OURS[task](cfg), 5).eval()
    full = OURS[task](cfg.replace(attention_mode=AttentionMode.FULL)).eval()
    full.load_state_dict(model.state_dict(), strict=True)
    inputs = task_batch(task, 5, 50, 2)
    with torch.no_grad():
        compare(
            task,
            model(**inputs, output_hidden_states=True),
            full(**inputs, output_hidden_states=True),
            inputs,
            f"{task} dilated causal",
        )


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("task", TASKS)
def test_from_hf_pretrained_picks_the_class_from_config(task, tmp_path):
    hf, cfg = hf_task(task, 31)
    hf.save_pretrained(tmp_path)
    model = from_hf_pretrained(tmp_path)
    assert type(model) is OURS[task] and not model.training
    inputs = task_batch(task, 31, cfg.vocab_size, cfg.num_labels)
    ref = hf_run(hf, **inputs)
    with torch.no_grad():
        compare(task, model(**inputs, output_hidden_states=True), ref, inputs, f"{task} from checkpoint")


def test_task_model_from_a_pretrained_encoder_and_from_another_task(tmp_path):
    """Fine-tuning starts: a classifier on a masked LM checkpoint (head fresh, LM head dropped, both
    named), and on a base model's checkpoint (no prefix there); the encoder's numbers carry over."""
    mlm, cfg = hf_task("LongformerForMaskedLM", 41)
    mlm.save_pretrained(tmp_path / "mlm")
    with pytest.warns(UserWarning) as caught:
        model = from_hf_pretrained(tmp_path / "mlm", LongformerForSequenceClassification, num_labels=5)
    messages = [str(w.message) for w in caught]
    assert any("newly initialized (the task head" in m and "classifier.out_proj.weight" in m for m in messages), (
        messages
    )
    assert any(
        "not used by LongformerForSequenceClassification" in m and "lm_head.dense.weight" in m for m in messages
    ), messages
    assert model.classifier.out_proj.out_features == 5
    inputs = task_batch("LongformerForTokenClassification", 41, cfg.vocab_size, 3)
    inputs.pop("labels")
    ref = hf_run(mlm, **inputs)
    with torch.no_grad():
        out = model.longformer(**inputs)
    real = real_rows(inputs)
    assert_close(out.last_hidden_state[real], ref.hidden_states[-1][real], ATOL, "encoder from a masked LM")

    base, _ = hf_task("LongformerModel", 42, num_labels=2)
    base.save_pretrained(tmp_path / "base")
    with pytest.warns(UserWarning) as caught:
        qa = from_hf_pretrained(tmp_path / "base", LongformerForQuestionAnswering)
    messages = [str(w.message) for w in caught]
    assert any("newly initialized (the task head" in m and "qa_outputs.weight" in m for m in messages), messages
    assert any(
        "not used by LongformerForQuestionAnswering" in m and "longformer.pooler.dense.weight" in m for m in messages
    ), messages
    with torch.no_grad():
        assert_close(
            qa.longformer(**inputs).last_hidden_state[real],
            hf_run(base, **inputs).last_hidden_state[real],
            ATOL,
            "encoder from a base model",
        )


def test_a_head_of_another_shape_starts_fresh_and_a_base_model_names_the_heads_it_drops(tmp_path):
    """A 3-label tagger's checkpoint: multiple choice has a 1-output ``classifier`` of the same name
    (fresh, named with both shapes), QA has two outputs whatever the labels, the base model drops
    the classifier (named); the encoder carries over each time."""
    tagger, cfg = hf_task("LongformerForTokenClassification", 61, num_labels=3)
    tagger.save_pretrained(tmp_path)
    inputs = task_batch("LongformerForTokenClassification", 61, cfg.vocab_size, 3)
    inputs.pop("labels")
    ref, real = hf_run(tagger, **inputs).hidden_states[-1], real_rows(inputs)
    for model_class, message in (
        (LongformerForMultipleChoice, "have another shape in the checkpoint"),
        (LongformerForMultipleChoice, "'classifier.weight': ((3, 32), (1, 32))"),
        (
            LongformerForQuestionAnswering,
            "newly initialized (the task head; train them before use): ['qa_outputs.weight'",
        ),
        (
            LongformerForQuestionAnswering,
            "not used by LongformerForQuestionAnswering (another task's head or "
            "pooler): ['classifier.bias', 'classifier.weight']",
        ),
        (
            LongformerModel,
            "not used by LongformerModel (another task's head or pooler): ['classifier.bias', 'classifier.weight']",
        ),
    ):
        with pytest.warns(UserWarning) as caught:
            model = from_hf_pretrained(tmp_path, model_class)
        messages = [str(w.message) for w in caught]
        assert any(message in m for m in messages), (model_class, messages)
        encoder = model if model_class is LongformerModel else model.longformer
        with torch.no_grad():
            assert_close(encoder(**inputs).last_hidden_state[real], ref[real], ATOL, model_class.__name__)


def test_from_hf_pretrained_refuses_unknown_architectures_and_mismatched_encoders(tmp_path):
    hf, cfg = hf_task("LongformerForTokenClassification", 51)
    hf.save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace("LongformerForTokenClassification", "LongformerForPoetry"))
    with pytest.raises(
        ValueError,
        match=r"architectures=\['LongformerForPoetry'\] names a class longformer_ops "
        r"does not have .*pass model_class=",
    ):
        from_hf_pretrained(tmp_path)
    assert type(from_hf_pretrained(tmp_path, LongformerForTokenClassification)) is LongformerForTokenClassification
    with pytest.raises(TypeError, match="model_class must be one of LongformerModel, LongformerForMaskedLM"):
        from_hf_pretrained(tmp_path, torch.nn.Linear)
    with pytest.raises(
        RuntimeError,
        match=r"does not match LongformerForTokenClassification's encoder: missing "
        r"\['longformer.encoder.layer.2",
    ):
        from_hf_pretrained(tmp_path, LongformerForTokenClassification, num_hidden_layers=3, attention_window=2)


# --------------------------------------------------------------------------- gradient checkpointing
def test_gradient_checkpointing_gives_the_same_gradients():
    """With dropout on (the masks are replayed in the recomputation) and global tokens."""
    cfg = LongformerConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        attention_window=[2, 3, 2],
        attention_dilation=[1, [1, 2, 1, 2], 1],
        hidden_dropout_prob=0.2,
        attention_probs_dropout_prob=0.2,
        num_labels=3,
    )
    torch.manual_seed(7)
    model = LongformerForTokenClassification(cfg).train()
    inputs = task_batch("LongformerForTokenClassification", 7, 50, 3)
    inputs["global_attention_mask"] = (torch.arange(17) % 6 == 0).long().expand(3, -1)

    def gradients():
        model.zero_grad()
        torch.manual_seed(1)
        model(**inputs).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    plain = gradients()
    assert not model.is_gradient_checkpointing
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    checkpointed = gradients()
    for name, grad in plain.items():
        assert_close(checkpointed[name], grad, 1e-6 * (grad.abs().max().item() + 1e-30), f"grad {name}")
    # The recomputation does run: a layer's forward twice per step (counted inside it: the
    # recomputation does not call module hooks).
    calls = []
    block = model.longformer.encoder.layer[1].intermediate
    block.forward = lambda x, forward=block.forward: calls.append(1) or forward(x)
    gradients()
    assert len(calls) == 2
    model.gradient_checkpointing_disable()
    calls.clear()
    gradients()
    assert len(calls) == 1


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_labels", 0, "num_labels must be a positive int, got 0"),
        ("problem_type", "ranking", "problem_type must be one of .*got 'ranking'"),
        ("sep_token_id", 50, r"sep_token_id must be an int in \[0, vocab_size=50\), got 50"),
    ],
)
def test_task_config_fields_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        LongformerConfig(vocab_size=50, **{field: value})
