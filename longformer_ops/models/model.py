"""A thin Longformer encoder on the banded kernels, weight-compatible with Hugging Face.

``LongformerModel`` (embeddings -> encoder -> pooler) has exactly the ``state_dict()`` key names
of ``transformers``' class of the same name, so

    model = LongformerModel(LongformerConfig.from_hf(hf_model.config))
    model.load_state_dict(hf_model.state_dict(), strict=True)

works. The task models on top of it are in :mod:`longformer_ops.models.tasks`, checkpoint loading in
:mod:`longformer_ops.models.checkpoint`. Outputs follow Hugging Face's shapes and meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from longformer_ops.models.config import LongformerConfig
from longformer_ops.models.layer import LongformerSelfAttention, PoolingformerSelfAttention
from longformer_ops.nn import dense
from longformer_ops.nn.gelu import linear_gelu
from longformer_ops.nn.layer_norm import LayerNorm
from longformer_ops.nn.residual import linear_dropout_add
from longformer_ops.ops.dropout import Dropout
from longformer_ops.runtime.output_cache import new_output

_ACTIVATIONS = {  # Hugging Face's names (ACT2FN) -> a fresh module
    "gelu": nn.GELU,
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "tanh": nn.Tanh,
}
# The same activations in place (inference only: autograd needs their inputs).
_ACTIVATE_IN_PLACE = {
    nn.GELU: lambda act, h: torch.ops.aten.gelu_(h, approximate=act.approximate),
    nn.ReLU: lambda act, h: h.relu_(),
    nn.SiLU: lambda act, h: nn.functional.silu(h, inplace=True),
    nn.Tanh: lambda act, h: h.tanh_(),
}


@dataclass
class LongformerModelOutput:
    """``last_hidden_state [b, n, hidden]``; ``pooler_output [b, hidden]`` (None without pooler);
    ``hidden_states``: embeddings + one per layer, each ``[b, n, hidden]``; ``attentions``: one per
    layer ``[b, heads, n, g + 2w + 1]``; ``global_attentions``: one per layer ``[b, heads, n, g]``
    (None when no token is global). The last three only when asked for."""

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    global_attentions: tuple[torch.Tensor, ...] | None = None


# --------------------------------------------------------------------------- embeddings
class LongformerEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout (RoBERTa's; hidden-state dropout
    here and in the layers is :class:`longformer_ops.ops.dropout.Dropout`, layer norms
    :class:`longformer_ops.nn.layer_norm.LayerNorm`: the kernels' own)."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.pad_token_id = config.pad_token_id
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings, config.hidden_size, padding_idx=config.pad_token_id
        )

    def position_ids(self, input_ids: torch.Tensor | None, shape: torch.Size, device) -> torch.Tensor:
        """RoBERTa's: real tokens count from pad_token_id + 1, padding tokens get pad_token_id."""
        if input_ids is None:  # no token ids to tell padding from: plain sequential positions
            return torch.arange(shape[1], device=device).expand(shape) + self.pad_token_id + 1
        real = (input_ids != self.pad_token_id).long()
        return torch.cumsum(real, dim=1) * real + self.pad_token_id

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None):
        shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]  # [b, n]
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        if position_ids is None:
            position_ids = self.position_ids(input_ids, shape, device)
        # A host sync: skipped under torch.compile, where it would split the graph (the embedding
        # lookup itself still fails on an out-of-range id there, with torch's message).
        if (
            not torch.compiler.is_compiling()
            and position_ids.numel()
            and int(position_ids.max()) >= self.position_embeddings.num_embeddings
        ):
            raise ValueError(
                f"position id {int(position_ids.max())} is out of range: max_position_embeddings="
                f"{self.position_embeddings.num_embeddings} (with pad_token_id={self.pad_token_id}, at most "
                f"{self.position_embeddings.num_embeddings - self.pad_token_id - 1} tokens); got shape {tuple(shape)}"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros(shape, dtype=torch.long, device=device)
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        x = inputs_embeds + self.position_embeddings(position_ids) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))  # [b, n, hidden]


# --------------------------------------------------------------------------- encoder
class _DenseResidualNorm(nn.Module):
    """``LayerNorm(x + dropout(dense(h)))``: Hugging Face's SelfOutput and Output blocks."""

    def __init__(self, config: LongformerConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # The bias, the dropout and the residual in one kernel pass after the GEMM (without autograd
        # in place in the GEMM's output: one hidden-size temporary fewer per block).
        return self.LayerNorm(linear_dropout_add(h, self.dense, self.dropout, x))


class LongformerAttention(nn.Module):
    def __init__(self, config: LongformerConfig, layer_id: int):
        super().__init__()
        attention = PoolingformerSelfAttention if config.is_pooling_layer(layer_id) else LongformerSelfAttention
        self.self = attention(config, layer_id)
        self.output = _DenseResidualNorm(config, config.hidden_size)

    def forward(self, x, attention_mask, output_attentions=False):
        h, attentions, global_attentions = self.self(x, attention_mask, output_attentions)
        return self.output(h, x), attentions, global_attentions


class LongformerIntermediate(nn.Module):
    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]()

    def forward(self, x):
        if type(self.act) is nn.GELU and self.act.approximate == "none":
            return linear_gelu(x, self.dense)  # [b, n, intermediate]; the bias inside the GELU's pass
        if torch.is_grad_enabled() or type(self.act) not in _ACTIVATE_IN_PLACE or self.dense.bias is None:
            return self.act(dense.apply_linear(self.dense, x))
        # Inference: the activation (4 x hidden per row: past malloc's mmap threshold at long
        # lengths, so fresh pages on every call) goes into recycled memory and the activation
        # runs in place there.
        h = new_output(x, (*x.shape[:-1], self.dense.out_features))
        dense.mm_into(x.reshape(-1, x.shape[-1]), self.dense.weight.t(), h.view(-1, h.shape[-1]), self.dense.bias)
        return _ACTIVATE_IN_PLACE[type(self.act)](self.act, h)


class LongformerLayer(nn.Module):
    def __init__(self, config: LongformerConfig, layer_id: int):
        super().__init__()
        self.attention = LongformerAttention(config, layer_id)
        self.intermediate = LongformerIntermediate(config)
        self.output = _DenseResidualNorm(config, config.intermediate_size)

    def forward(self, x, attention_mask, output_attentions=False):
        x, attentions, global_attentions = self.attention(x, attention_mask, output_attentions)
        return self.output(self.intermediate(x), x), attentions, global_attentions


class LongformerEncoder(nn.Module):
    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.layer = nn.ModuleList(LongformerLayer(config, i) for i in range(config.num_hidden_layers))
        self.gradient_checkpointing = False  # see _PreTrained.gradient_checkpointing_enable
        self.checkpoint_kwargs: dict = {}

    def forward(self, x, attention_mask, output_attentions=False, output_hidden_states=False):
        hidden_states, attentions, global_attentions = [x], [], []
        # As transformers: only in training with autograd on (eval and no_grad keep nothing to recompute).
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layer:
            if checkpointing:  # the layer's activations are recomputed in the backward, dropout masks included
                x, a, ga = torch.utils.checkpoint.checkpoint(
                    layer, x, attention_mask, output_attentions, **self.checkpoint_kwargs
                )
            else:
                x, a, ga = layer(x, attention_mask, output_attentions)
            hidden_states.append(x)
            attentions.append(a)
            global_attentions.append(ga)
        return LongformerModelOutput(
            last_hidden_state=x,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
            # (a host sync, so only when asked for)
            global_attentions=tuple(global_attentions)
            if output_attentions and bool((attention_mask > 0).any())
            else None,
        )


class LongformerPooler(nn.Module):
    """tanh(dense(first token))."""

    def __init__(self, config: LongformerConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, x):
        return self.activation(dense.apply_linear(self.dense, x[:, 0]))  # [b, hidden]


# --------------------------------------------------------------------------- models
class _PreTrained(nn.Module):
    """Hugging Face's initialisation (normal(0, initializer_range) weights, zero biases) and its
    gradient checkpointing switches."""

    config: LongformerConfig

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None):
        """Keep only each layer's input in the forward and recompute the layer in the backward:
        the activations of a training step shrink from all layers' to about one layer's, for about
        one more forward of compute (``bench/results/*/*-checkpointing.*``). Same gradients; the
        dropout masks are replayed (torch's RNG state is saved per layer). ``gradient_checkpointing_kwargs``
        go to ``torch.utils.checkpoint.checkpoint`` (default ``use_reentrant=False``)."""
        for module in self.modules():
            if isinstance(module, LongformerEncoder):
                module.gradient_checkpointing = True
                module.checkpoint_kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}

    def gradient_checkpointing_disable(self):
        for module in self.modules():
            if isinstance(module, LongformerEncoder):
                module.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(m.gradient_checkpointing for m in self.modules() if isinstance(m, LongformerEncoder))

    # transformers 5 renames these (the old names are deprecated there); both work here.
    activation_checkpointing_enable = gradient_checkpointing_enable
    activation_checkpointing_disable = gradient_checkpointing_disable
    is_activation_checkpointing = is_gradient_checkpointing

    def _init_weights(self, module: nn.Module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def layer_attention_mask(attention_mask: torch.Tensor, global_attention_mask: torch.Tensor) -> torch.Tensor:
    """HF-style masks (1 keep / 0 pad; 1 global / 0 local) -> the layer's: -1 pad, 0 local, 1 global.

    Padding wins over global.
    """
    is_padding = attention_mask == 0
    is_global = (global_attention_mask != 0) & ~is_padding
    return is_global.long() - is_padding.long()  # [b, n]


class LongformerModel(_PreTrained):
    """Embeddings, ``num_hidden_layers`` Longformer layers, and (optionally) the pooler.

    Inputs as in Hugging Face: ``attention_mask`` 1 = token / 0 = padding,
    ``global_attention_mask`` 1 = global / 0 = local, both ``[b, n]``. Any sequence length
    (up to ``max_position_embeddings - pad_token_id - 1``); nothing is padded to the window.
    """

    def __init__(self, config: LongformerConfig, add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.embeddings = LongformerEmbeddings(config)
        self.encoder = LongformerEncoder(config)
        self.pooler = LongformerPooler(config) if add_pooling_layer else None
        self.apply(self._init_weights)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        global_attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        output_attentions=False,
        output_hidden_states=False,
    ) -> LongformerModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids [b, n] and inputs_embeds [b, n, hidden]")
        shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        # Neither mask: no padding and no global token, which the layers take without looking at a mask
        # (no host sync: under torch.compile the whole model is one graph).
        unmasked = attention_mask is None and global_attention_mask is None
        if attention_mask is None:
            attention_mask = torch.ones(shape, dtype=torch.long, device=device)
        if global_attention_mask is None:
            global_attention_mask = torch.zeros(shape, dtype=torch.long, device=device)
        for name, given in (("attention_mask", attention_mask), ("global_attention_mask", global_attention_mask)):
            if tuple(given.shape) != tuple(shape):  # (torch would broadcast a [n] or [b, 1] mask silently)
                raise ValueError(
                    f"{name} must be [batch, seq_len] = {tuple(shape)}, like the input, got shape {tuple(given.shape)}"
                )
        if self.pooler is not None and len(shape) == 2 and shape[1] == 0:
            raise ValueError(
                f"the input has no token (shape {tuple(shape)}) and the pooler reads the first: give at "
                "least one token, or build the model with add_pooling_layer=False"
            )
        mask = None if unmasked else layer_attention_mask(attention_mask, global_attention_mask)  # [b, n]: -1 / 0 / 1

        x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)  # [b, n, hidden]
        out = self.encoder(x, mask, output_attentions, output_hidden_states)
        if self.pooler is not None:
            out.pooler_output = self.pooler(out.last_hidden_state)
        return out


__all__ = ["LongformerModel", "LongformerModelOutput", "layer_attention_mask"]
