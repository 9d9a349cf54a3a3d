"""The task models of transformers' Longformer on our encoder, one class per task.

    LongformerForMaskedLM                 logits [b, n, vocab]
    LongformerForSequenceClassification   logits [b, num_labels]      (from <s>)
    LongformerForTokenClassification      logits [b, n, num_labels]
    LongformerForQuestionAnswering        start_logits, end_logits [b, n]
    LongformerForMultipleChoice           logits [b, choices]         (inputs [b, choices, n])

Each has exactly the ``state_dict()`` key names of transformers' class of the same name (a
``longformer.`` encoder plus the head), the same ``forward`` arguments in the same order, the same
loss for the same labels, and the same **default global attention** when
``global_attention_mask`` is None (transformers' rules, functions below): ``<s>`` for sequence
classification; every token before the first separator for question answering; every token after
the question's two separators of each choice for multiple choice (the last separator and padding
included: padding never attends either way). Token classification and the masked LM have none.
Per-head dilation, ``autoregressive`` and every attention mode work as in the base model.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from longformer_ops.models.config import LongformerConfig
from longformer_ops.models.model import LongformerModel, _PreTrained
from longformer_ops.nn import dense
from longformer_ops.nn.layer_norm import LayerNorm
from longformer_ops.ops.dropout import Dropout

_IGNORE_INDEX = -100  # labels that do not count (torch's cross_entropy default, as in transformers)


@dataclass
class TaskOutput:
    """``logits`` (shape per task, see the module docstring); ``loss`` when labels are given; the
    encoder's ``hidden_states``, ``attentions`` and ``global_attentions`` when asked for (as in
    :class:`longformer_ops.models.model.LongformerModelOutput`; multiple choice: per choice, ``[b * choices, ...]``)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    global_attentions: tuple[torch.Tensor, ...] | None = None


MaskedLMOutput = TaskOutput  # the name this output had before the other task heads came


@dataclass
class QuestionAnsweringOutput:
    """``start_logits``, ``end_logits`` ``[b, n]``; ``loss`` (mean of the start and end cross-entropies)
    when ``start_positions`` and ``end_positions`` are given; the rest as in :class:`TaskOutput`."""

    loss: torch.Tensor | None = None
    start_logits: torch.Tensor | None = None
    end_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    global_attentions: tuple[torch.Tensor, ...] | None = None


# --------------------------------------------------------------------------- default global attention
def first_token_global_mask(shape, device=None) -> torch.Tensor:
    """``[b, n]`` with 1 at the first token (``<s>``) of each sequence: sequence classification's default."""
    mask = torch.zeros(shape, dtype=torch.long, device=device)
    mask[:, 0] = 1
    return mask


def _first_separator(input_ids: torch.Tensor, sep_token_id: int) -> torch.Tensor:
    """Index of the first ``sep_token_id`` in each row of ``input_ids [rows, n]``. Every row must hold
    exactly three (``<s> question </s></s> context </s>``), as transformers requires; transformers
    only checks the total over the batch and then misreads uneven rows, we name the row."""
    is_separator = input_ids == sep_token_id
    counts = is_separator.sum(-1)
    wrong = (counts != 3).nonzero()
    if len(wrong):
        row = int(wrong[0, 0])
        raise ValueError(
            f"input_ids: the default global attention needs exactly 3 separator tokens (sep_token_id="
            f"{sep_token_id}) in every sequence (<s> question </s></s> text </s>), sequence {row} has "
            f"{int(counts[row])}; pass global_attention_mask to choose the global tokens yourself"
        )
    return is_separator.int().argmax(-1)  # argmax returns the first of equal maxima


def question_global_mask(input_ids: torch.Tensor, sep_token_id: int) -> torch.Tensor:
    """``[b, n]``: 1 on every token before the first separator (``<s>`` and the question), question
    answering's default."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions < _first_separator(input_ids, sep_token_id)[:, None]).long()


def choice_global_mask(input_ids: torch.Tensor, sep_token_id: int) -> torch.Tensor:
    """``[b, choices, n]``: 1 on every token from the second after the first separator of each
    choice (with the question closed by two separators, ``</s></s>``: the choice's text, its closing
    separator and any padding after it), multiple choice's default, transformers' rule."""
    rows = input_ids.reshape(-1, input_ids.shape[-1])
    positions = torch.arange(rows.shape[-1], device=rows.device)
    return (positions > _first_separator(rows, sep_token_id)[:, None] + 1).long().reshape(input_ids.shape)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """The task models' cross-entropy: ``torch.nn.functional.cross_entropy(logits, labels, **kwargs)``
    with half types in float32 (a softmax over the classes); float32 and float64 as they are."""
    scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return nn.functional.cross_entropy(scores, labels, **kwargs)


# --------------------------------------------------------------------------- masked LM
class LongformerLMHead(nn.Module):
    """dense -> gelu -> LayerNorm -> decoder (tied to the word embeddings) + bias."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.decoder.bias = self.bias  # one tensor under two names, as in Hugging Face

    def forward(self, x):
        x = self.layer_norm(nn.functional.gelu(dense.apply_linear(self.dense, x)))
        return dense.apply_linear(self.decoder, x)  # [b, n, vocab]


class LongformerForMaskedLM(_PreTrained):
    """``longformer`` (a :class:`LongformerModel` without pooler) and ``lm_head``; ``loss``: mean
    cross-entropy over the labels that are not -100. No default global attention."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.config = config
        self.longformer = LongformerModel(config, add_pooling_layer=False)
        self.lm_head = LongformerLMHead(config)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.lm_head.decoder.weight = self.longformer.embeddings.word_embeddings.weight

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        global_attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        output_attentions=False,
        output_hidden_states=False,
    ) -> TaskOutput:
        out = self.longformer(
            input_ids,
            attention_mask,
            global_attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
        )
        logits = self.lm_head(out.last_hidden_state)  # [b, n, vocab]
        loss = None if labels is None else cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return TaskOutput(loss, logits, out.hidden_states, out.attentions, out.global_attentions)


# --------------------------------------------------------------------------- sequence classification
class LongformerClassificationHead(nn.Module):
    """On ``<s>``: dropout -> dense -> tanh -> dropout -> out_proj (RoBERTa's head)."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, x):
        x = torch.tanh(dense.apply_linear(self.dense, self.dropout(x[:, 0])))
        return dense.apply_linear(self.out_proj, self.dropout(x))  # [b, num_labels]


class LongformerForSequenceClassification(_PreTrained):
    """A label (or ``num_labels`` scores) per sequence from its ``<s>`` token, global by default.

    ``loss`` by ``config.problem_type``, chosen on the first call with labels when None (and kept
    in the config, as transformers does): one label -> ``"regression"`` (MSE); integer labels ->
    ``"single_label_classification"`` (cross-entropy); else ``"multi_label_classification"``
    (binary cross-entropy on float labels ``[b, num_labels]``).
    """

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.longformer = LongformerModel(config, add_pooling_layer=False)
        self.classifier = LongformerClassificationHead(config)
        self.apply(self._init_weights)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        global_attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        output_attentions=False,
        output_hidden_states=False,
    ) -> TaskOutput:
        if global_attention_mask is None:
            source = input_ids if input_ids is not None else inputs_embeds
            if source is not None:  # (else the encoder names the missing input)
                global_attention_mask = first_token_global_mask(source.shape[:2], source.device)
        out = self.longformer(
            input_ids,
            attention_mask,
            global_attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
        )
        logits = self.classifier(out.last_hidden_state)  # [b, num_labels]
        loss = None if labels is None else self._loss(logits, labels.to(logits.device))
        return TaskOutput(loss, logits, out.hidden_states, out.attentions, out.global_attentions)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            if self.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        if self.config.problem_type == "regression":
            if self.num_labels == 1:
                return nn.functional.mse_loss(logits.squeeze(), labels.squeeze())
            return nn.functional.mse_loss(logits, labels)
        if self.config.problem_type == "single_label_classification":
            return cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


# --------------------------------------------------------------------------- token classification
class LongformerForTokenClassification(_PreTrained):
    """A label per token (tagging); ``loss``: mean cross-entropy over labels that are not -100.
    No default global attention."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.config = config
        self.num_labels = config.num_labels
        self.longformer = LongformerModel(config, add_pooling_layer=False)
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.apply(self._init_weights)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        global_attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        output_attentions=False,
        output_hidden_states=False,
    ) -> TaskOutput:
        out = self.longformer(
            input_ids,
            attention_mask,
            global_attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
        )
        logits = dense.apply_linear(self.classifier, self.dropout(out.last_hidden_state))  # [b, n, num_labels]
        loss = (
            None
            if labels is None
            else cross_entropy(logits.view(-1, self.num_labels), labels.to(logits.device).view(-1))
        )
        return TaskOutput(loss, logits, out.hidden_states, out.attentions, out.global_attentions)


# --------------------------------------------------------------------------- question answering
class LongformerForQuestionAnswering(_PreTrained):
    """Extractive QA: a start and an end score per token. Input ``<s> question </s></s> text </s>``;
    by default the question (every token before the first separator) is global, and an input
    without exactly three separators is refused (pass ``global_attention_mask``). ``loss``: the
    mean of the start and end cross-entropies; positions outside the sequence are clamped to its
    length and ignored, as in transformers."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        if config.num_labels != 2:
            raise ValueError(
                f"LongformerForQuestionAnswering needs num_labels=2 (start and end scores), "
                f"got num_labels={config.num_labels}"
            )
        self.config = config
        self.num_labels = config.num_labels
        self.longformer = LongformerModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.apply(self._init_weights)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        global_attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        start_positions=None,
        end_positions=None,
        output_attentions=False,
        output_hidden_states=False,
    ) -> QuestionAnsweringOutput:
        if global_attention_mask is None:
            if input_ids is None:
                warnings.warn(
                    "LongformerForQuestionAnswering: no input_ids to find the question in, so no "
                    "global attention; pass global_attention_mask",
                    stacklevel=2,
                )
            else:
                global_attention_mask = question_global_mask(input_ids, self.config.sep_token_id)
        out = self.longformer(
            input_ids,
            attention_mask,
            global_attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_attentions,
            output_hidden_states,
        )
        logits = dense.apply_linear(self.qa_outputs, out.last_hidden_state)  # [b, n, 2]
        start_logits, end_logits = (part.squeeze(-1).contiguous() for part in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = span_loss(start_logits, end_logits, start_positions, end_positions)
        return QuestionAnsweringOutput(
            loss, start_logits, end_logits, out.hidden_states, out.attentions, out.global_attentions
        )


def span_loss(
    start_logits: torch.Tensor, end_logits: torch.Tensor, start_positions: torch.Tensor, end_positions: torch.Tensor
) -> torch.Tensor:
    """Question answering's loss: the mean of the start and end cross-entropies over ``[b, n]`` logits;
    positions past the sequence are clamped to its length and ignored, as in transformers."""
    outside = start_logits.shape[1]
    start = start_positions.reshape(-1).to(start_logits.device).clamp(0, outside)
    end = end_positions.reshape(-1).to(start_logits.device).clamp(0, outside)
    return (
        cross_entropy(start_logits, start, ignore_index=outside) + cross_entropy(end_logits, end, ignore_index=outside)
    ) / 2


# --------------------------------------------------------------------------- multiple choice
class LongformerForMultipleChoice(_PreTrained):
    """One score per choice: inputs ``[b, choices, n]`` (each choice ``<s> question </s></s> choice
    </s>``) run as ``b * choices`` sequences through the encoder and its pooler; by default every
    token after the question's separators is global. ``loss``: cross-entropy over the choices.
    The arguments' order is transformers' for this class (``token_type_ids`` second)."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.config = config
        self.longformer = LongformerModel(config)
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.apply(self._init_weights)

    def forward(
        self,
        input_ids=None,
        token_type_ids=None,
        attention_mask=None,
        global_attention_mask=None,
        labels=None,
        position_ids=None,
        inputs_embeds=None,
        output_attentions=False,
        output_hidden_states=False,
    ) -> TaskOutput:
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None:
            raise ValueError("give input_ids [b, choices, n] or inputs_embeds [b, choices, n, hidden]")
        choices = source.shape[1]
        if global_attention_mask is None and input_ids is not None:
            global_attention_mask = choice_global_mask(input_ids, self.config.sep_token_id)

        def flat(t, trailing=1):  # [b, choices, n, ...] -> [b * choices, n, ...]
            return None if t is None else t.reshape(-1, *t.shape[t.dim() - trailing :])

        out = self.longformer(
            flat(input_ids),
            flat(attention_mask),
            flat(global_attention_mask),
            flat(token_type_ids),
            flat(position_ids),
            flat(inputs_embeds, 2),
            output_attentions,
            output_hidden_states,
        )
        logits = dense.apply_linear(self.classifier, self.dropout(out.pooler_output)).view(-1, choices)  # [b, choices]
        loss = None if labels is None else cross_entropy(logits, labels.to(logits.device))
        return TaskOutput(loss, logits, out.hidden_states, out.attentions, out.global_attentions)


TASK_MODELS = (
    LongformerForMaskedLM,
    LongformerForSequenceClassification,
    LongformerForTokenClassification,
    LongformerForQuestionAnswering,
    LongformerForMultipleChoice,
)

__all__ = [cls.__name__ for cls in TASK_MODELS] + [
    "TaskOutput",
    "MaskedLMOutput",
    "QuestionAnsweringOutput",
    "first_token_global_mask",
    "question_global_mask",
    "choice_global_mask",
]
