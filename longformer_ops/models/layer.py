"""``LongformerSelfAttention``: sliding-window attention with global tokens, on the banded kernels;
``PoolingformerSelfAttention`` (at the end): the same plus Poolingformer's pooling attention.

What it computes (the original authors' and Hugging Face's definition):

- every ordinary token attends, through the ``query``/``key``/``value`` projections, to
  the keys of its band (``i + d[h] * (j - w)``, per-head dilation ``d``; only keys at or
  before ``i`` when autoregressive) and to every global token; padding keys and global
  keys are removed from the band (a global token is reached through the global columns
  only), keys outside the sequence are ``-inf``;
- every global token attends to all (non-padding) tokens through the separate
  ``query_global``/``key_global``/``value_global`` projections, and its output row
  replaces the local one.

Layout inside: ``[batch, seq, heads, head_dim]``; band tensors ``[batch, seq, heads, c]``
with ``c = 2w + 1`` (``w + 1`` autoregressive). Scores are masked with the dtype's most
negative finite value (as Hugging Face does, so that no row is all ``-inf``), softmax runs
in the input dtype (torch's softmax accumulates half types in float32 and rounds once, so
there is no float32 copy of the band), rows of padding queries are zeroed. When no attentions
are asked for, local attention (attention dropout included) is one call of
:func:`longformer_ops.sliding_window_attention` (the fused kernels on CPU: no score band), and
the global keys' columns are merged in through the rows' log-sum-exp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from longformer_ops.models.config import AttentionMode, LongformerConfig
from longformer_ops.models.pooling import pool_centres, pool_sequence, pool_then_project, pooling_attention
from longformer_ops.nn import dense
from longformer_ops.ops.attention import sliding_window_attention
from longformer_ops.ops.diagonaled import diagonaled_mm, fill_band_at_keys_
from longformer_ops.ops.reference import pooling_attention_reference, sliding_chunks_pv, sliding_chunks_qk
from longformer_ops.runtime import checks, kernels
from longformer_ops.runtime.band import key_positions


@dataclass
class GlobalTokens:
    """Where the global tokens are: ``positions [b, g]`` (ascending; slots past an example's
    own count point at non-global tokens) and ``valid [b, g]`` (False for those slots)."""

    positions: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def from_mask(is_global: torch.Tensor) -> GlobalTokens | None:
        """``is_global [b, n]`` bool -> the global slots, or None when the batch has no global token."""
        counts = is_global.sum(dim=1)  # [b]
        g = int(counts.max()) if is_global.numel() else 0
        if g == 0:
            return None
        # A stable sort of "not global" puts the global positions first, in order.
        order = torch.sort((~is_global).to(torch.uint8), dim=1, stable=True).indices
        positions = order[:, :g]  # [b, g]
        valid = torch.arange(g, device=is_global.device) < counts[:, None]
        return GlobalTokens(positions, valid)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [b, n, ...]`` -> the rows of the global slots ``[b, g, ...]``. (By indexing: its
        gradient is one zeroed ``x``-sized tensor with the g rows added in, where torch.gather's
        backward also copied that tensor whole.)"""
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        return x[rows, self.positions]


def band_key_mask(
    seq_len: int, w: int, dilation: tuple[int, ...], autoregressive: bool, device: torch.device
) -> torch.Tensor:
    """Bool ``[heads, n, n]``: True where key k is in query i's band (the explicit form of the band).

    ``[1, n, n]`` when every head has the same dilation (it broadcasts over heads, at 1/heads the memory).
    """
    d = torch.tensor(dilation if len(set(dilation)) > 1 else dilation[:1], device=device).view(-1, 1, 1)
    i = torch.arange(seq_len, device=device).view(1, -1, 1)
    k = torch.arange(seq_len, device=device).view(1, 1, -1)
    offset = k - i
    allowed = (offset % d == 0) & (offset.abs() <= w * d)
    return allowed & (offset <= 0) if autoregressive else allowed


class LongformerSelfAttention(nn.Module):
    """Local + global self-attention of one layer (the ``attention.self`` module of Hugging Face).

    ``forward(hidden_states [b, n, hidden], attention_mask [b, n] or None, output_attentions)``
    with the mask convention: negative = padding, 0 = local, positive = global. Returns
    ``(output [b, n, hidden], attentions, global_attentions)``; when ``output_attentions``,
    ``attentions`` is ``[b, heads, n, g + c]`` (post-softmax; first ``g`` columns: the
    global tokens in position order, then the band; rows of global tokens zeroed) and
    ``global_attentions`` is ``[b, heads, n, g]`` (the global token in column ``s`` attends to
    key ``k`` with weight ``[.., k, s]``; None when the batch has no global token).
    Any sequence length; no padding is needed by any mode.
    """

    def __init__(self, config: LongformerConfig, layer_id: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.query_global = nn.Linear(hidden, hidden)
        self.key_global = nn.Linear(hidden, hidden)
        self.value_global = nn.Linear(hidden, hidden)
        self.dropout = config.attention_probs_dropout_prob
        self.layer_id = layer_id
        self.window = config.attention_window[layer_id]
        self.dilation = config.layer_dilation(layer_id)
        self.autoregressive = config.autoregressive
        self.attention_mode = config.attention_mode

    def extra_repr(self) -> str:
        return (
            f"window={self.window}, dilation={self.dilation}, autoregressive={self.autoregressive}, "
            f"mode={self.attention_mode.value}"
        )

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_heads, self.head_dim)  # [b, n, hidden] -> [b, n, h, d]

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, output_attentions: bool = False
    ):
        checks.check_hidden_states(hidden_states, self.query.in_features, self.query.weight)
        b, n, hidden = hidden_states.shape
        no_mask = attention_mask is None
        if no_mask:
            attention_mask = torch.zeros(b, n, device=hidden_states.device)
        elif attention_mask.shape != (b, n):
            raise ValueError(
                f"attention_mask must be [batch, seq_len] = {(b, n)} (negative = padding, 0 = local, "
                f"positive = global), got shape {tuple(attention_mask.shape)}"
            )
        is_padding = attention_mask < 0  # [b, n]
        is_global = (attention_mask > 0) & ~is_padding  # [b, n]
        if no_mask:
            # No padding, no global token, and no host sync: nothing data-dependent, so
            # torch.compile and torch.export see the whole layer as one graph.
            globals_, any_padding = None, False
        else:
            globals_ = GlobalTokens.from_mask(is_global)  # one host sync (the number of global slots)
            # Right after that sync (nothing queued yet on a GPU): lets the banded path skip two full
            # passes over the band when nothing is padding.
            any_padding = bool(is_padding.any())

        # Without autograd, hidden-size temporaries are written in place (at 2^20 tokens each is 3 GiB).
        in_place = not torch.is_grad_enabled()
        q = self._heads(self._scaled_query(hidden_states, in_place))  # [b, n, h, d]
        k = self._heads(dense.apply_linear(self.key, hidden_states))  # [b, n, h, d]
        v = self._heads(dense.apply_linear(self.value, hidden_states))  # [b, n, h, d]

        if self.attention_mode is AttentionMode.FULL:
            context, probs = self._local_full(q, k, v, is_padding, is_global, globals_)
        else:
            context, probs = self._local_banded(
                q, k, v, is_padding if any_padding else None, is_global, globals_, output_attentions
            )
        del q, k, v  # (autograd keeps what its backward needs) before the global rows' projections

        global_probs = None
        if globals_ is not None:
            global_context, global_probs = self._global_rows(hidden_states, is_padding, globals_)  # [b, g, h, d]
            # The g rows go back to their positions and replace the local rows there, in place: ``context``
            # is a fresh tensor that no backward saved, so autograd's one pass over it is zeroing those
            # rows of the gradient (a where over a scattered copy took five). Empty slots point at
            # distinct non-global rows, which get their own values back (boolean indexing instead
            # would have a data-dependent shape: a torch.compile graph break).
            rows = torch.arange(b, device=context.device)[:, None].expand_as(globals_.positions)
            index = (rows, globals_.positions)
            context.index_put_(index, torch.where(globals_.valid[..., None, None], global_context, context[index]))
        output = context.reshape(b, n, hidden)  # [b, n, h*d]

        if not output_attentions:
            return output, None, None
        # Rows of global tokens are fillers (their output came from the global rows).
        attentions = probs.masked_fill(is_global[:, :, None, None], 0).transpose(1, 2)  # [b, h, n, g + c]
        if global_probs is not None:
            global_probs = global_probs.masked_fill(~globals_.valid[:, None, :, None], 0)
            global_probs = global_probs.transpose(2, 3)  # [b, h, n, g]
        return output, attentions, global_probs

    # -------------------------------------------------------------- local rows
    def _softmax(self, scores: torch.Tensor, is_padding: torch.Tensor | None, in_place: bool = False) -> torch.Tensor:
        """Softmax over the last dim, rows of padding queries (``is_padding``, or None: none) zeroed.
        ``in_place`` (inference, on a tensor of our own) writes over ``scores``: no second band in memory."""
        if in_place:
            probs = torch.softmax(scores, dim=-1, out=scores)
            if is_padding is not None:
                probs.masked_fill_(is_padding[:, :, None, None], 0)
        else:
            probs = torch.softmax(scores, dim=-1)
            if is_padding is not None:
                probs = probs.masked_fill(is_padding[:, :, None, None], 0)
        return nn.functional.dropout(probs, p=self.dropout, training=self.training)

    def _global_key_scores(
        self, q, key_slots, globals_: GlobalTokens, hidden_score: float | None = None, first_row: int = 0
    ):
        """Scores of every query against the global tokens' (local) keys ``key_slots [b, g, h, d]``:
        ``[b, n, h, g]``; keys a query does not see (empty slots, later tokens when autoregressive) get
        ``hidden_score`` (default: the dtype's lowest finite value). The queries are the sequence's
        rows ``first_row ...`` (``globals_.positions`` count from its first)."""
        n = q.shape[1]
        scores = _against_slots(q, key_slots)  # [b, n, h, g]
        hidden = ~globals_.valid[:, None, None, :]  # empty slots
        if self.autoregressive:  # no query sees a global token to its right
            rows = torch.arange(first_row, first_row + n, device=q.device)
            later = globals_.positions[:, None, :] > rows[None, :, None]
            hidden = hidden | later[:, :, None, :]
        return scores.masked_fill(hidden, torch.finfo(q.dtype).min if hidden_score is None else hidden_score)

    def _merge_global_keys(
        self, context, lse, q, key_slots, value_slots, globals_: GlobalTokens, dropout_p: float, first_row: int = 0
    ):
        """One softmax over [band keys | global keys] from the band part's normalised ``context`` and its
        rows' log-sum-exp ``lse``: the band part weighs exp(lse - m), each global key exp(score - m),
        over their sum (m any finite shift: the row's largest term). Differentiable, and no NaN for a
        row that sees no global key (or no key at all: its weights stay 0). ``context`` had its
        dropout in the kernel; the global columns get theirs here (the sum is of undropped terms)."""
        scores = self._global_key_scores(q, key_slots, globals_, float("-inf"), first_row).to(lse.dtype)  # [b, n, h, g]
        if torch.is_grad_enabled():
            keep = nn.functional.dropout(torch.ones_like(scores), dropout_p) if dropout_p > 0 else None
            return _GlobalKeyMerge.apply(context, lse, scores, value_slots, keep)
        band_weight, global_weights, total = _merge_weights(lse, scores)
        dropped = nn.functional.dropout(global_weights, dropout_p, training=dropout_p > 0)
        if context.is_contiguous() and _merge_kernel_serves(context, lse):  # in place in the context: no temporary
            torch.ops.longformer_ops.global_merge_(
                context, band_weight / total, dropped / total[..., None], value_slots
            )
            return context
        # Inference: the same operations in place, in the input dtype: one temporary.
        merged = _weighted_slots(dropped.to(value_slots.dtype), value_slots)
        merged.add_(context.mul_(band_weight.to(context.dtype)[..., None]))
        return merged.div_(total.to(merged.dtype)[..., None])

    def _local_banded(self, q, k, v, is_padding, is_global, globals_, need_probs: bool):
        """TVM kernels or sliding chunks: band scores ``[b, n, h, c]``, never an n x n matrix.
        ``is_padding`` is None when nothing is padding."""
        w, dil, ar = self.window, self.dilation, self.autoregressive
        if self.attention_mode is AttentionMode.TVM and not need_probs:
            # Local attention in one call, which runs the fused kernels on CPU (no score band),
            # padding keys masked, attention dropout inside. q is already scaled. Global tokens:
            # removed from the band as keys, their columns merged in by the rows' log-sum-exp.
            dropout_p = self.dropout if self.training else 0.0
            if globals_ is None:
                context = sliding_window_attention(
                    q, k, v, w, dil, ar, scale=1.0, key_padding_mask=is_padding, dropout_p=dropout_p
                )
            else:
                band_keys_hidden = is_global if is_padding is None else is_padding | is_global
                context, lse = sliding_window_attention(
                    q,
                    k,
                    v,
                    w,
                    dil,
                    ar,
                    scale=1.0,
                    key_padding_mask=band_keys_hidden,
                    dropout_p=dropout_p,
                    return_lse=True,
                )
                context = self._merge_global_keys(
                    context, lse, q, globals_.gather(k), globals_.gather(v), globals_, dropout_p
                )
            return (context if is_padding is None else context.masked_fill(is_padding[:, :, None, None], 0)), None
        # Keys outside the sequence get -inf from the band product itself.
        if self.attention_mode is AttentionMode.TVM:
            band = diagonaled_mm(q, k, w, dil, is_t1_diagonaled=False, padding=float("-inf"), autoregressive=ar)
        else:
            band = sliding_chunks_qk(q, k, w, padding=float("-inf"))  # [b, n, h, 2w+1]
        # Padding and global tokens are removed from the band as keys (in place: the band is a fresh
        # output that no backward needs).
        if is_padding is not None or globals_ is not None:
            flagged = is_global if is_padding is None else is_padding | is_global
            fill_band_at_keys_(band, flagged, w, dil, ar, torch.finfo(q.dtype).min)

        g = 0 if globals_ is None else globals_.positions.shape[1]
        scores = band
        if g:  # the global keys' scores go first
            scores = torch.cat(
                [self._global_key_scores(q, globals_.gather(k), globals_), band], dim=-1
            )  # [b, n, h, g + c]
        # scores is this call's own tensor; without autograd the softmax can overwrite it.
        probs = self._softmax(scores, is_padding, in_place=not (torch.is_grad_enabled() and scores.requires_grad))

        # One split, not two slices: in backward each slice would allocate a zeroed gradient of
        # the whole [b, n, h, g + c] and add them; a split's gradient is one concatenation.
        global_probs, band_probs = probs.split([g, probs.shape[-1] - g], dim=-1)
        band_probs = band_probs.contiguous()  # [b, n, h, c]
        if self.attention_mode is AttentionMode.TVM:
            context = diagonaled_mm(band_probs, v, w, dil, is_t1_diagonaled=True, autoregressive=ar)
        else:
            context = sliding_chunks_pv(band_probs, v, w)  # [b, n, h, d]
        if globals_ is not None:
            context = context + _weighted_slots(global_probs, globals_.gather(v))
        return context, probs

    def _local_full(self, q, k, v, is_padding, is_global, globals_):
        """Reference: dense ``n x n`` scores, an explicit mask of allowed (query, key) pairs,
        one softmax per row; the band layout is only gathered for the returned probabilities."""
        b, n, h, _ = q.shape
        w, dil, ar = self.window, self.dilation, self.autoregressive
        in_band = band_key_mask(n, w, dil, ar, q.device)  # [h or 1, n, n]
        allowed = in_band[None] & ~(is_padding | is_global)[:, None, None, :]  # [b, h, n, n]
        reach_global = is_global[:, None, None, :].expand(b, h, n, n)
        if ar:
            reach_global = reach_global & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        allowed = allowed | reach_global
        scores = torch.einsum("bihd,bkhd->bhik", q, k)  # [b, h, n, n]
        scores = scores.masked_fill(~allowed, torch.finfo(q.dtype).min)
        probs = self._softmax(scores.transpose(1, 2), is_padding).transpose(1, 2)  # [b, h, n, n]
        context = torch.einsum("bhik,bkhd->bihd", probs, v)  # [b, n, h, d]

        # The same probabilities in the layout of the other modes: [global columns | band].
        full_probs = probs.transpose(1, 2)  # [b, n, h, n]
        keys = key_positions(n, w, torch.tensor(dil, device=q.device), ar)  # [n, h, c]
        outside = (keys < 0) | (keys >= n)
        band = torch.gather(full_probs, 3, keys.clamp(0, max(n - 1, 0)).expand(b, n, h, -1))
        band = band.masked_fill(outside | is_global[:, keys.clamp(0, max(n - 1, 0))], 0)
        if globals_ is None:
            return context, band
        index = globals_.positions[:, None, None, :].expand(b, n, h, -1)
        global_cols = torch.gather(full_probs, 3, index).masked_fill(~globals_.valid[:, None, None, :], 0)
        return context, torch.cat([global_cols, band], dim=-1)  # [b, n, h, g + c]

    def _scaled_query(self, hidden_states, in_place: bool):
        """``query(hidden_states) / sqrt(head_dim)``. A plain ``nn.Linear`` (``dense.plain_linear``) takes the
        scale in its weight and bias, a hidden x hidden product instead of a pass over the queries
        each way (for head_dim 64 the same numbers: 1/8 is exact); another module is divided after."""
        if dense.plain_linear(self.query):
            scale = 1 / math.sqrt(self.head_dim)
            return dense.linear(hidden_states, self.query.weight * scale, self.query.bias * scale)
        q = self.query(hidden_states)
        return q.div_(math.sqrt(self.head_dim)) if in_place else q / math.sqrt(self.head_dim)

    # -------------------------------------------------------------- global rows
    def _global_rows(self, hidden_states, is_padding, globals_: GlobalTokens):
        """Each global token attends to every non-padding token with the *_global projections.

        Returns ``(context [b, g, h, d], probs [b, h, g, n])``. Scores and probabilities are laid out
        ``[b, n, h, g]``, the projections' own order (see :func:`_against_slots`).
        """
        queries = self._global_queries(globals_.gather(hidden_states))
        scores, through_weights = self._global_row_scores(hidden_states, queries, is_padding, globals_)
        probs = self._global_row_dropout(torch.softmax(scores, dim=1))
        return self._global_row_context(probs, hidden_states, through_weights), probs.permute(0, 2, 3, 1)

    def _global_queries(self, slot_states: torch.Tensor) -> torch.Tensor:
        """The global tokens' inputs ``[b, g, hidden]`` -> their scaled queries ``[b, g, h, d]``."""
        return self._heads(dense.apply_linear(self.query_global, slot_states)) / math.sqrt(self.head_dim)

    def _global_row_scores(self, hidden_states, queries, is_padding, globals_: GlobalTokens, first_row: int = 0):
        """The global queries ``[b, g, h, d]`` against the key_global projections of ``hidden_states``
        (the sequence's rows ``first_row ...``): ``([b, n, h, g] scores, keys hidden at the dtype's lowest
        finite value; whether through the weights)``."""
        n, hidden = hidden_states.shape[1:]
        # Few slots: the slots' queries go through the key weights and the probabilities meet the
        # rows before the value weights (see _keys_through_weights): no keys or values of all rows.
        through_weights = (
            _global_rows_through_weights(self.num_heads, queries.shape[1], hidden)
            and dense.plain_linear(self.key_global)
            and dense.plain_linear(self.value_global)
        )
        if through_weights:
            scores = _keys_through_weights(hidden_states, queries, self.key_global)  # [b, n, h, g]
        else:
            scores = _against_slots(self._heads(dense.apply_linear(self.key_global, hidden_states)), queries)
        hidden_keys = is_padding[:, :, None, None]
        if self.autoregressive:
            rows = torch.arange(first_row, first_row + n, device=queries.device)
            later = rows[None, :, None] > globals_.positions[:, None, :]  # [b, n, g]
            hidden_keys = hidden_keys | later[:, :, None, :]
        return scores.masked_fill(hidden_keys, torch.finfo(queries.dtype).min), through_weights

    def _global_row_dropout(self, probs: torch.Tensor) -> torch.Tensor:
        """Attention dropout on the global rows' ``probs [b, n, h, g]`` (in training)."""
        if not (self.training and self.dropout > 0):
            return probs
        # The mask drawn in [b, h, g, n] order, as it always was.
        keep = nn.functional.dropout(
            torch.ones_like(probs.permute(0, 2, 3, 1), memory_format=torch.contiguous_format), self.dropout
        )
        return probs * keep.permute(0, 3, 1, 2)

    def _global_row_context(self, probs, hidden_states, through_weights: bool) -> torch.Tensor:
        """``probs [b, n, h, g]`` -> the rows' value_global projections weighted and summed: ``[b, g, h, d]``."""
        if through_weights:
            return _values_through_weights(probs, hidden_states, self.value_global)
        return _slots_weighted(probs, self._heads(dense.apply_linear(self.value_global, hidden_states)))


class PoolingformerSelfAttention(LongformerSelfAttention):
    """Poolingformer's two-level attention (Zhang et al., 2021): this layer's Longformer attention
    (level 1, everything of :class:`LongformerSelfAttention`: global tokens, dilation, causal),
    then pooling attention over a wider window on level 1's output (level 2); returns their sum.

    Level 2 (``config.pooling``, a :class:`longformer_ops.models.config.PoolingConfig`): from level 1's
    output ``y``, queries ``query2(y)``, and keys and values ``key2(y)``, ``value2(y)`` pooled along
    the sequence (:func:`longformer_ops.models.pooling.pool_sequence`: kernel ``kernel_size``, stride
    ``stride``, padding left out of every pool; mean and LDConv pools are computed as projections
    of the pooled ``y``, :func:`longformer_ops.models.pooling.pool_then_project`, the same numbers at
    ``1 / stride`` of the work); each query attends to the pools whose centres lie
    within ``window`` tokens of it (:func:`longformer_ops.models.pooling.pooling_attention`, on the
    local-attention kernels). Choices where the paper leaves details open:

    - level 2 has no global tokens of its own (global tokens are level 1's) and runs for every
      query, global ones included; rows of padding queries stay 0;
    - causal (``autoregressive``): a query sees only pools that end at or before it;
    - LDConv: one map ``ldconv`` (hidden -> heads x kernel_size) reads the input ``y`` at each
      pool's centre token; a softmax over the pool's positions gives one weight per position and
      head, shared by the head's channels and by the keys' and the values' pools;
    - level 2's attention dropout is the layer's (``attention_probs_dropout_prob``);
    - level 2 runs on the kernels in the ``tvm`` and ``sliding_chunks`` modes; the ``full`` mode
      (the reference) computes it densely (:func:`longformer_ops.ops.reference.pooling_attention_reference`);
    - ``output_attentions`` returns level 1's attentions only.

    Parameters beyond :class:`LongformerSelfAttention`'s: ``query2``, ``key2``, ``value2`` (and
    ``ldconv`` for that kind), named so that a Longformer checkpoint loads into the rest.
    """

    def __init__(self, config: LongformerConfig, layer_id: int):
        super().__init__(config, layer_id)
        if config.pooling is None:
            raise ValueError("PoolingformerSelfAttention needs config.pooling (a PoolingConfig), got None")
        pooling = config.pooling
        self.pooling_window, self.pooling_kind = pooling.window, pooling.kind
        self.pooling_kernel_size, self.pooling_stride = pooling.kernel_size, pooling.stride
        hidden = config.hidden_size
        self.query2 = nn.Linear(hidden, hidden)
        self.key2 = nn.Linear(hidden, hidden)
        self.value2 = nn.Linear(hidden, hidden)
        self.ldconv = nn.Linear(hidden, self.num_heads * pooling.kernel_size) if pooling.kind == "ldconv" else None

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, pooling={self.pooling_kind}(kernel_size={self.pooling_kernel_size}, "
            f"stride={self.pooling_stride}), pooling_window={self.pooling_window}"
        )

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, output_attentions: bool = False
    ):
        y, attentions, global_attentions = super().forward(hidden_states, attention_mask, output_attentions)
        return (
            y + self.pooling_level(y, None if attention_mask is None else attention_mask < 0),
            attentions,
            global_attentions,
        )

    def pooling_level(self, y: torch.Tensor, is_padding: torch.Tensor | None) -> torch.Tensor:
        """Level 2 on ``y [b, n, hidden]`` (``is_padding [b, n]`` bool or None): ``[b, n, hidden]``."""
        b, n, hidden = y.shape
        k, s = self.pooling_kernel_size, self.pooling_stride
        logits = None
        if self.ldconv is not None:
            centres = pool_centres(n, k, s).to(y.device)
            logits = dense.apply_linear(self.ldconv, y[:, centres]).view(b, -1, self.num_heads, k)  # [b, m, h, k]
        q = self._heads(dense.apply_linear(self.query2, y))
        dropout_p = self.dropout if self.training else 0.0
        if self.attention_mode is AttentionMode.FULL or self.pooling_kind == "max":
            # The definition: pool the projections (the reference mode; and max, which is not linear).
            keys, values = (self._heads(dense.apply_linear(p, y)) for p in (self.key2, self.value2))
            pooled_k, valid = pool_sequence(keys, k, s, self.pooling_kind, is_padding, logits)
            pooled_v, _ = pool_sequence(values, k, s, self.pooling_kind, is_padding, logits)
        else:  # the same, a quarter of the work at stride 4: project the pools
            (pooled_k, pooled_v), valid = pool_then_project(
                y, (self.key2, self.value2), self.num_heads, k, s, self.pooling_kind, is_padding, logits
            )
        if self.attention_mode is AttentionMode.FULL:  # the dense reference, as level 1 in this mode
            z = pooling_attention_reference(
                q, pooled_k, pooled_v, self.pooling_window, k, s, valid, self.autoregressive, dropout_p=dropout_p
            )
        else:
            z = pooling_attention(
                q,
                pooled_k,
                pooled_v,
                self.pooling_window,
                k,
                s,
                pool_valid=valid,
                autoregressive=self.autoregressive,
                dropout_p=dropout_p,
            )
        z = z.reshape(b, n, hidden)
        return z if is_padding is None else z.masked_fill(is_padding[..., None], 0)


# ------------------------------------------------------------------ rows against the global slots
# Every row of [b, n, h, d] against each of g global slots, head by head, is g dot products per row
# and head. As an einsum it is a matmul batched over heads, which copies [b, n, h, d] into [b*h, n, d]
# first, transposing (and its gradient back), and so do the gathers and the row scatter. For a few slots it is
# one matmul over the rows' own [b, n, h*d] layout against the slots laid out block-diagonally per
# head ([h*d, h*g]): no copy of a hidden-size tensor, in the gradients either, but h times the
# FLOPs, so past BLOCK_DIAGONAL_SLOTS slots the einsum's copies cost less than the waste.
BLOCK_DIAGONAL_SLOTS = 4


def _slots_by_einsum(slots: int, x: torch.Tensor) -> bool:
    """Whether the rows meet ``slots`` slots by einsum: past BLOCK_DIAGONAL_SLOTS, and wherever
    dense.py widens the products (its einsum has the gradient; the block-diagonal matmuls are for speed)."""
    return slots > BLOCK_DIAGONAL_SLOTS or dense.computes_in_float32(x.dtype, x.device)


def _slots_block_diagonal(slots: torch.Tensor) -> torch.Tensor:
    """``slots [b, g, h, d]`` -> ``[b, h*d, h*g]``: head i's ``[d, g]`` block (the slots' vectors as
    columns) at rows ``i*d ...``, columns ``i*g ...``; zero elsewhere."""
    b, g, h, d = slots.shape
    eye = torch.eye(h, dtype=slots.dtype, device=slots.device)
    return (slots.permute(0, 2, 3, 1)[:, :, :, None, :] * eye[:, None, :, None]).reshape(b, h * d, h * g)


def _against_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``x [b, n, h, d]``, ``slots [b, g, h, d]`` -> ``[b, n, h, g]``: each row's dot product with
    each slot, per head."""
    b, n, h, d = x.shape
    if _slots_by_einsum(slots.shape[1], x):
        return dense.einsum("bnhd,bghd->bnhg", x, slots)
    return (x.reshape(b, n, h * d) @ _slots_block_diagonal(slots)).view(b, n, h, -1)


def _weighted_slots(weights: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weights [b, n, h, g]``, ``slots [b, g, h, d]`` -> ``[b, n, h, d]``: per row and head, the
    slots' vectors weighted and summed; into ``out`` if given (outside autograd; unlike the default,
    not a view)."""
    b, n, h, g = weights.shape
    if _slots_by_einsum(g, weights):
        merged = dense.einsum("bnhg,bghd->bnhd", weights, slots)
        return merged if out is None else out.copy_(merged)
    blocks = _slots_block_diagonal(slots).transpose(1, 2)
    if out is not None:
        torch.matmul(weights.reshape(b, n, h * g), blocks, out=out.view(b, n, -1))
        return out
    return (weights.reshape(b, n, h * g) @ blocks).view(b, n, h, -1)


def _slots_weighted(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weights [b, n, h, g]``, ``x [b, n, h, d]`` -> ``[b, g, h, d]``: per slot and head, the rows
    weighted and summed over n (the diagonal blocks of one ``[h*g, h*d]`` product)."""
    b, n, h, g = weights.shape
    if _slots_by_einsum(g, weights):
        return dense.einsum("bnhg,bnhd->bghd", weights, x)
    full = weights.reshape(b, n, h * g).transpose(1, 2) @ x.reshape(b, n, -1)  # [b, h*g, h*d]
    return full.view(b, h, g, h, -1).diagonal(dim1=1, dim2=3).permute(0, 1, 3, 2)


# ------------------------------------------------------------------ global rows through the weights
# A global slot's scores are its query against every row's key_global projection, and its context the
# rows' value_global projections weighted by its probabilities. Projecting every row (two [b, n, hidden]
# GEMMs, their backward and the two tensors kept for it) is the long way round for a few slots: by
# associativity the slot's query can go through the key weights instead (q W_k: [hidden] per slot and
# head) and the probabilities can meet the rows first and the value weights after (P^T x, then W_v).
# That is 2 h g hidden FLOPs per row against 2 hidden^2, so the layer takes it while h g < hidden.
def _global_rows_through_weights(heads: int, slots: int, hidden: int) -> bool:
    return heads * slots < hidden


def _keys_through_weights(x: torch.Tensor, queries: torch.Tensor, key: nn.Linear) -> torch.Tensor:
    """``x [b, n, hidden]``, ``queries [b, g, h, d]`` -> ``[b, n, h, g]``: each row's ``key(x)`` (heads
    of ``d``) against each slot's query, computed as ``x (W_k^T q) + b_k . q``."""
    b, g, h, d = queries.shape
    weight = key.weight.to(queries.dtype).view(h, d, -1)  # [h, d, hidden]
    through = dense.einsum("hdc,bghd->bchg", weight, queries).reshape(b, -1, h * g)  # [b, hidden, h*g]
    # The bias adds one constant per slot and head to all its scores (softmax ignores it), kept so
    # that key.bias stays in the graph (DistributedDataParallel expects a gradient for it).
    offset = dense.einsum("hd,bghd->bhg", key.bias.to(queries.dtype).view(h, d), queries).reshape(b, 1, h * g)
    if dense.computes_in_float32(queries.dtype, queries.device):
        return (dense.bmm(x.to(queries.dtype), through) + offset).view(b, -1, h, g)
    return torch.baddbmm(offset, x.to(queries.dtype), through).view(b, -1, h, g)


def _values_through_weights(weights: torch.Tensor, x: torch.Tensor, value: nn.Linear) -> torch.Tensor:
    """``weights [b, n, h, g]``, ``x [b, n, hidden]`` -> ``[b, g, h, d]``: per slot and head the rows'
    ``value(x)`` weighted and summed over n, computed as ``(weights^T x) W_v^T + (sum of weights) b_v``."""
    b, n, h, g = weights.shape
    pooled = dense.bmm(weights.reshape(b, n, h * g).transpose(1, 2), x.to(weights.dtype))  # [b, h*g, hidden]
    weight = value.weight.to(weights.dtype).view(h, -1, pooled.shape[-1])  # [h, d, hidden]
    context = dense.einsum("bhgc,hdc->bghd", pooled.view(b, h, g, -1), weight)
    return context + weights.sum(1).transpose(1, 2)[..., None] * value.bias.to(weights.dtype).view(h, -1)


def _merge_weights(lse: torch.Tensor, scores: torch.Tensor):
    """The global-key merge's weights: the band part's exp(lse - m) ``[b, n, h]``, each global key's
    exp(score - m) ``[b, n, h, g]`` and their sum Z (clamped above 0), m each row's largest term (0
    for a row with no key: no NaN from -inf - -inf)."""
    shift = torch.maximum(lse, scores.amax(-1))
    shift = shift.masked_fill(shift == float("-inf"), 0)
    band_weight = torch.exp(lse - shift)
    global_weights = torch.exp(scores - shift[..., None])
    total = (band_weight + global_weights.sum(-1)).clamp_min(torch.finfo(lse.dtype).tiny)
    return band_weight, global_weights, total


def _merge_kernel_serves(context: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether the global-key merge kernels take ``context`` with weights (``a``, ``lse``) in
    ``weights``' dtype: a library for its device and dtype has them, and the weights are in that
    library's accumulation dtype (the fused attention's log-sum-exp is)."""
    return weights.dtype == kernels.accumulation_dtype(context.dtype) and kernels.available(
        "global_merge", context.device, context.dtype
    )


class _GlobalKeyMerge(torch.autograd.Function):
    """The training form of :meth:`LongformerSelfAttention._merge_global_keys`, with a backward of its
    own: ``apply(context [b, n, h, d], lse [b, n, h], scores [b, n, h, g], values [b, g, h, d], keep)``
    -> ``context * a + sum_g omega_g values_g``, ``a = exp(lse - m) / Z`` and ``omega_g = keep_g exp(score_g
    - m) / Z`` (Z the undropped sum, m the row's largest term; ``keep`` the global columns' dropout
    factors ``[b, n, h, g]`` or None), in the accumulation dtype of ``lse``, rounded once to
    ``context``'s. Written out because autograd of the plain expression took about a dozen passes
    over ``[b, n, h, d]`` per layer (dtype conversions, the division by Z and its backward); this
    takes three forward and five backward in torch's ops, one each way where the merge kernels
    serve (the CPU libraries: ``torch.ops.longformer_ops.global_merge``). Backward, with G the output's gradient, u = <G, context>, t_g = <G, values_g> and
    s = u a + sum_g t_g omega_g (= <G, output>): d context = G a, d values_g = sum over rows of
    omega_g G, d lse = (u - s) a, d score_g = (t_g keep_g - s) exp(score_g - m) / Z."""

    @staticmethod
    def forward(ctx, context, lse, scores, values, keep):
        band_weight, global_weights, total = _merge_weights(lse, scores)
        a = band_weight / total
        omega = (global_weights if keep is None else global_weights * keep) / total[..., None]
        ctx.save_for_backward(context, values, a, omega, global_weights / total[..., None], keep)
        # (Not a view: the layer writes the global rows' outputs into the result in place.)
        if _merge_kernel_serves(context, lse):
            return torch.ops.longformer_ops.global_merge(context, a, omega, values)
        out = _weighted_slots(omega, values.to(lse.dtype), out=context.new_empty(context.shape, dtype=lse.dtype))
        out.addcmul_(context, a[..., None])
        return out.to(context.dtype)

    @staticmethod
    @once_differentiable  # (the fused attention under it is differentiable once too)
    def backward(ctx, grad):
        context, values, a, omega, weights, keep = ctx.saved_tensors  # weights: exp(score - m) / Z
        if _merge_kernel_serves(context, a):
            grad_context, u, t = torch.ops.longformer_ops.global_merge_backward(grad, context, values, a)
        else:
            u = (grad * context).sum(-1, dtype=a.dtype)  # [b, n, h]
            t = _against_slots(grad, values).to(a.dtype)  # [b, n, h, g]
            grad_context = (grad * a[..., None]).to(context.dtype) if ctx.needs_input_grad[0] else None
        s = u * a + (t * omega).sum(-1)
        grad_lse = (u - s) * a
        grad_scores = ((t if keep is None else t * keep) - s[..., None]) * weights
        grad_values = _slots_weighted(omega.to(grad.dtype), grad) if ctx.needs_input_grad[3] else None
        return grad_context, grad_lse, grad_scores, grad_values, None
