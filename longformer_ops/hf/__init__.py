"""Run transformers' own Longformer and LED models on our kernels, in place; and, through
transformers' attention interface, the sliding layers of every model that has them (ModernBERT,
Mistral, Gemma, Qwen2, ...: :mod:`longformer_ops.hf.attention`).

    import longformer_ops.hf
    model = LongformerForSequenceClassification.from_pretrained(path)
    longformer_ops.hf.patch(model)      # its self-attention now runs on our kernels
    longformer_ops.hf.patch()           # or: every model built from now on (from_pretrained too)
    longformer_ops.hf.unpatch(model)    # / unpatch(): back to transformers' own code

    longformer_ops.hf.register()        # attn_implementation="longformer_ops" for any model
    model = AutoModelForMaskedLM.from_pretrained(path, attn_implementation="longformer_ops")
    longformer_ops.hf.patch(model)      # (on a model with sliding layers: the same switch)

Contract:

- ``patch(model)`` switches, in place, each ``LongformerSelfAttention`` and LED's
  ``LEDEncoderSelfAttention`` to a subclass that keeps the module's parameters and state-dict names
  and computes with :class:`longformer_ops.LongformerSelfAttention` (transformers' mask convention:
  negative padding, 0 local, positive global; its two-sided window). The model's hidden-state
  dropouts, FFN activations, residual blocks, layer norms and other linear layers go onto the same
  computations on our kernels (``_MODULE_FORWARDS`` and :func:`patch` list them). It returns the model. ``patch()``
  without a model patches the classes, so models built later use the kernels; ``unpatch`` undoes
  either.
- A patched model is not padded to a multiple of the window; the outputs at the real tokens are
  those of transformers' model.
- ``output_attentions=True`` returns transformers' own attention tensors (from the band kernels).
- A call the kernels cannot take (device, dtype, no prebuilt kernel, an unknown argument) runs
  transformers' own forward, with one warning per cause: never a silently different result.
- transformers is imported here only, when called; ``import longformer_ops`` never imports it.

What each swap does and how it is tested: docs/integrations.md.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from longformer_ops.hf import attention as hf_attention
from longformer_ops.hf.attention import register  # (hf.register(): the sliding-window models' attention)
from longformer_ops.models.config import AttentionMode
from longformer_ops.models.layer import LongformerSelfAttention as _OurSelfAttention
from longformer_ops.nn import dense
from longformer_ops.nn.gelu import linear_gelu
from longformer_ops.nn.layer_norm import LayerNorm
from longformer_ops.nn.residual import linear_dropout_add
from longformer_ops.ops.dropout import Dropout
from longformer_ops.runtime.checks import KERNEL_DTYPES
from longformer_ops.runtime.loader import KernelNotAvailableError

_patched_classes: dict[type, type] = {}  # transformers' class -> its patched subclass
_class_patches: list[tuple[object, str, type]] = []  # (module, name, original class) replaced by patch()
_padding_originals: dict[type, object] = {}  # model class -> its own _pad_to_window_size, replaced by patch()
# pretrained-model class -> (its post_init as resolved before patch(), the one in its own __dict__ or None)
_post_init_originals: dict[type, tuple[object, object]] = {}
_warned: set[str] = set()


def _target_classes() -> list[tuple[object, str]]:
    """(transformers module, class name) of every self-attention this module can patch."""
    from transformers.models.led import modeling_led
    from transformers.models.longformer import modeling_longformer

    return [(modeling_longformer, "LongformerSelfAttention"), (modeling_led, "LEDEncoderSelfAttention")]


def _original_attention_classes() -> tuple[type, ...]:
    """transformers' own self-attention classes (the originals, also while :func:`patch` has replaced
    them in their modules)."""
    return tuple(
        getattr(cls, "_original_class", cls)
        for cls in (getattr(namespace, name) for namespace, name in _target_classes())
    )


def _padding_classes() -> list[type]:
    """The transformers classes that pad a sequence to a multiple of the attention window for it."""
    from transformers.models.led import modeling_led
    from transformers.models.longformer import modeling_longformer

    return [modeling_longformer.LongformerModel, modeling_led.LEDEncoder]


def _pad_to_window_size(self, *args, **kwargs):
    """transformers' ``_pad_to_window_size`` (the model class's own), undone when every self-attention
    of this model runs on our kernels. transformers pads the sequence to a multiple of the attention
    window (up to window - 1 tokens more through every layer: 600 tokens run as 1024 at window 512)
    because its own attention needs it; ours takes any length, and the real tokens' outputs are the
    same (padding is masked as a key either way). The same tensors, sliced back along the sequence.
    A model whose self-attention is not all patched is padded as transformers does (a patched call
    that falls back to transformers' attention pads for itself)."""
    own = next(_padding_originals[cls] for cls in type(self).__mro__ if cls in _padding_originals)
    padding_len, *tensors = own(self, *args, **kwargs)
    originals = _original_attention_classes()
    attentions = [m for m in self.modules() if isinstance(m, originals)]
    for attention in attentions:
        attention.__dict__.pop("_padded_length", None)
    if not padding_len or not attentions or not all(hasattr(type(m), "_original_class") for m in attentions):
        return (padding_len, *tensors)
    for attention in attentions:  # (their global attentions keep transformers' padded length)
        attention._padded_length = next(t for t in tensors if t is not None).shape[1]
    return (0, *(t if t is None else t[:, : t.shape[1] - padding_len] for t in tensors))


def _unpad_models() -> None:
    """Put :func:`_pad_to_window_size` in place of the models' own (neutral for unpatched models)."""
    for cls in _padding_classes():
        if cls not in _padding_originals:
            _padding_originals[cls] = cls._pad_to_window_size
            cls._pad_to_window_size = _pad_to_window_size


class _PatchedDropout(Dropout):
    """A transformers model's ``nn.Dropout`` switched by :func:`patch` (:func:`unpatch` switches it back)."""


class _PatchedLinear(dense.Linear):
    """A transformers model's ``nn.Linear`` switched by :func:`patch` (:func:`unpatch` switches it back)."""


class _PatchedLayerNorm(LayerNorm):
    """A transformers model's ``nn.LayerNorm`` switched by :func:`patch` (:func:`unpatch` switches it back)."""


def _exact_gelu(activation) -> bool:
    """Whether ``activation`` is transformers' ``gelu`` (``torch.nn.functional.gelu``, exact)."""
    from transformers.activations import GELUActivation

    return type(activation) is GELUActivation and activation.act is nn.functional.gelu


def _intermediate_forward(self, hidden_states):
    """transformers' ``LongformerIntermediate``: an exact GELU takes the dense layer's bias in our
    kernel (:func:`longformer_ops.nn.gelu.linear_gelu`); any other activation runs transformers' forward."""
    if _exact_gelu(self.intermediate_act_fn):
        return linear_gelu(hidden_states, self.dense)
    return self._original_class.forward(self, hidden_states)


def _residual_forward(self, hidden_states, input_tensor):
    """transformers' ``LongformerSelfOutput`` and ``LongformerOutput``, ``LayerNorm(dropout(dense(h)) +
    x)``: the bias, the dropout and the residual in one kernel pass
    (:func:`longformer_ops.nn.residual.linear_dropout_add`)."""
    return self.LayerNorm(linear_dropout_add(hidden_states, self.dense, self.dropout, input_tensor))


def _decoder_attention_forward(self, hidden_states, *args, **kwargs):
    """transformers' ``LEDDecoderAttention`` (the decoder's dense self- and cross-attention: ``torch.bmm``
    of queries and keys, softmax, ``torch.bmm`` of probabilities and values), its own forward, with its
    products in :func:`longformer_ops.nn.dense.float32_products` where they run in float32 (a half type
    on a CPU without a GEMM for it, where torch's own products run slow loops)."""
    # (dense's function read at each call, not a name bound at import: the tests force both answers)
    if not dense.computes_in_float32(dense.product_dtype(hidden_states), hidden_states.device):
        return self._original_class.forward(self, hidden_states, *args, **kwargs)
    with dense.float32_products():
        return self._original_class.forward(self, hidden_states, *args, **kwargs)


# transformers' Longformer and LED module classes (by name) whose patched subclass runs this forward.
_MODULE_FORWARDS = {
    "LongformerIntermediate": _intermediate_forward,
    "LongformerSelfOutput": _residual_forward,
    "LongformerOutput": _residual_forward,
    "LEDDecoderAttention": _decoder_attention_forward,
}


def _module_class(name: str) -> type:
    """transformers' own class ``name`` of :data:`_MODULE_FORWARDS` (the original, also while patched)."""
    from transformers.models.led import modeling_led
    from transformers.models.longformer import modeling_longformer

    cls = getattr(modeling_longformer, name, None) or getattr(modeling_led, name)
    return getattr(cls, "_original_class", cls)


def _patched_module_class(original: type) -> type:
    """The subclass of ``original`` (one of :data:`_MODULE_FORWARDS`) that :func:`patch` switches its
    modules to, made once."""
    if original not in _patched_classes:
        _patched_classes[original] = _subclass(original, {"forward": _MODULE_FORWARDS[original.__name__]})
    return _patched_classes[original]


def _subclass(original: type, namespace: dict) -> type:
    """A patched subclass of ``original`` with ``namespace``'s attributes, named so that pickle finds
    it again (:data:`_patched_by_name`)."""
    return type(
        original.__name__,
        (original,),
        {
            **namespace,
            "_original_class": original,
            "__module__": __name__,
            "__qualname__": f"_patched_by_name.{original.__name__}",
        },
    )


class _PatchedClassesByName:
    """Where pickle finds a patched class (``torch.save(model)``, ``multiprocessing``, anything that
    pickles a patched model): ``longformer_ops.hf._patched_by_name.<transformers class name>``. The
    classes are made at run time, so in a fresh process the name makes it on first access (a model
    loaded there is a patched model, unpadded as :func:`patch` leaves it)."""

    def __getattr__(self, name: str) -> type:
        if name in _MODULE_FORWARDS:
            return _patched_module_class(_module_class(name))
        for namespace, target in _target_classes():
            if target == name:
                original = getattr(namespace, name)
                _unpad_models()
                return _patched_class(getattr(original, "_original_class", original))
        raise AttributeError(f"longformer_ops.hf patches no transformers class named {name!r}")


_patched_by_name = _PatchedClassesByName()


def _swap_modules(model, ours: bool) -> None:
    """Switch ``model``'s plain ``nn.Dropout`` modules to :class:`_PatchedDropout`, its plain
    ``nn.LayerNorm`` modules to :class:`_PatchedLayerNorm`, its plain ``nn.Linear`` modules to
    :class:`_PatchedLinear` and its modules of
    :data:`_MODULE_FORWARDS` to :func:`_patched_module_class` (``ours``), or back. Modules keep
    their attributes and parameters, so checkpoints are untouched; a dropout with ``inplace=True``
    (not in transformers' Longformer or LED) stays torch's."""
    originals = {_module_class(name) for name in _MODULE_FORWARDS}
    for module in model.modules():
        cls = type(module)
        if ours and cls is nn.Dropout and not module.inplace:
            module.__class__ = _PatchedDropout
        elif ours and cls is nn.LayerNorm:
            module.__class__ = _PatchedLayerNorm
        elif ours and cls is nn.Linear:
            module.__class__ = _PatchedLinear
        elif ours and cls in originals:
            module.__class__ = _patched_module_class(cls)
        elif not ours and cls is _PatchedDropout:
            module.__class__ = nn.Dropout
        elif not ours and cls is _PatchedLayerNorm:
            module.__class__ = nn.LayerNorm
        elif not ours and cls is _PatchedLinear:
            module.__class__ = nn.Linear
        elif not ours and getattr(cls, "_original_class", None) in originals:
            module.__class__ = cls._original_class


def _pretrained_classes() -> list[type]:
    """The base classes of the transformers models whose modules a model built while :func:`patch`
    has patched the classes switches (:func:`_post_init`): every Longformer and LED model's."""
    from transformers.models.led import modeling_led
    from transformers.models.longformer import modeling_longformer

    return [modeling_longformer.LongformerPreTrainedModel, modeling_led.LEDPreTrainedModel]


def _post_init(self):
    """transformers' ``post_init`` (which every model's ``__init__`` ends with), then the model's
    dropouts, layer norms, linear layers, intermediate and output layers on our kernels: for models
    built while :func:`patch` has patched the classes."""
    cls = next(cls for cls in type(self).__mro__ if cls in _post_init_originals)
    _post_init_originals[cls][0](self)
    _swap_modules(self, ours=True)


def _adopt(module) -> None:
    """The attributes our layer's forward reads, from the transformers module's own configuration."""
    module.window = module.one_sided_attn_window_size
    module.dilation = (1,) * module.num_heads
    module.autoregressive = False
    module.attention_mode = AttentionMode.TVM


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"longformer_ops.hf: {reason}: this call runs transformers' own attention code", stacklevel=3)


def _unsupported_reason(hidden_states, unknown: dict) -> str | None:
    """Why this call cannot run on our kernels (checked before any work), or None."""
    if unknown:
        return f"unsupported arguments {sorted(unknown)}"
    if hidden_states.device.type not in ("cpu", "cuda"):
        return f"hidden_states on {hidden_states.device} (our kernels run on cpu and cuda)"
    if hidden_states.dtype not in KERNEL_DTYPES:
        return f"hidden_states in {hidden_states.dtype} (our kernels: {', '.join(map(str, KERNEL_DTYPES))})"
    return None


def _transformers_attentions(output, attentions, global_attentions, attention_mask, padded_length: int):
    """Our layer's attention tensors in the layout transformers' self-attention returns them; the
    global ones over ``padded_length`` keys, the length transformers' model pads the sequence to
    (see :func:`_pad_to_window_size`), padding keys with weight 0."""
    local = attentions.transpose(1, 2)  # [b, h, n, g + c] -> [b, n, h, g + c]
    if global_attentions is None:  # no global token in the batch
        return output, local
    per_slot = global_attentions.transpose(2, 3)  # [b, h, n, g] -> [b, h, g, n]
    g, n = per_slot.shape[2], per_slot.shape[3]
    per_slot = torch.nn.functional.pad(per_slot, (0, padded_length - n))
    # Slots beyond an example's own global tokens: transformers masks every key of them alike,
    # which makes a uniform row; ours are zeros.
    unused = torch.arange(g, device=per_slot.device) >= (attention_mask > 0).sum(dim=1, keepdim=True)  # [b, g]
    return output, local, per_slot.masked_fill(unused[:, None, :, None], 1.0 / padded_length)


def _patched_class(original: type) -> type:
    """``original``'s subclass whose forward runs on our kernels (one per transformers class)."""
    if original not in _patched_classes:

        def __init__(self, *args, **kwargs):  # for models built while the classes are patched
            original.__init__(self, *args, **kwargs)
            _adopt(self)

        def forward(
            self,
            hidden_states,
            attention_mask=None,
            is_index_masked=None,
            is_index_global_attn=None,
            is_global_attn=None,
            output_attentions=False,
            **unknown,
        ):
            def theirs(reason: str):
                _warn_once(reason)
                # transformers' attention needs a multiple of its window, which the model no longer
                # pads to for a patched model (_pad_to_window_size): padded here for this call.
                n = hidden_states.shape[1]
                padding = -n % (2 * self.one_sided_attn_window_size)

                def pad(x, value):  # along the sequence (dim 1)
                    return (
                        x
                        if x is None or not padding
                        else torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, padding), value=value)
                    )

                outputs = original.forward(
                    self,
                    pad(hidden_states, 0),
                    pad(attention_mask, -10000.0),
                    pad(is_index_masked, True),
                    pad(is_index_global_attn, False),
                    is_global_attn,
                    output_attentions,
                    **unknown,
                )
                if not padding:
                    return outputs
                return (outputs[0][:, :n], *((outputs[1][:, :n],) if len(outputs) > 1 else ()), *outputs[2:])

            reason = _unsupported_reason(hidden_states, unknown)
            if reason:
                return theirs(reason)
            try:
                output, attentions, global_attentions = _OurSelfAttention.forward(
                    self, hidden_states, attention_mask, output_attentions
                )
            except KernelNotAvailableError as error:
                return theirs(f"no kernel for this call ({error})")
            if not output_attentions:
                return (output,)
            padded_length = self.__dict__.get("_padded_length", hidden_states.shape[1])
            return _transformers_attentions(output, attentions, global_attentions, attention_mask, padded_length)

        # Our layer's helpers (_heads, _local_banded, _global_rows, ...), copied in rather than inherited:
        # transformers' __init__ calls super().__init__(), which must stay nn.Module's.
        helpers = {
            name: value
            for name, value in vars(_OurSelfAttention).items()
            if name.startswith("_") and not name.startswith("__") and callable(value)
        }
        clashes = sorted(name for name in helpers if hasattr(original, name))
        if clashes:
            raise RuntimeError(f"longformer_ops.hf cannot patch {original.__qualname__}: it defines {clashes} too")
        _patched_classes[original] = _subclass(original, {**helpers, "__init__": __init__, "forward": forward})
    return _patched_classes[original]


def patch(model=None):
    """Run the self-attention of ``model`` (any transformers model holding Longformer or LED encoder
    self-attention modules, PEFT-wrapped ones included) on our kernels, in place; returns ``model``.
    Without a model, patch transformers' classes, so that every model built afterwards runs on them.
    The model's ``nn.Dropout`` modules become :class:`longformer_ops.ops.dropout.Dropout` (the same
    dropout on our kernel), its ``LongformerIntermediate`` modules take their bias and GELU in
    one kernel pass, its ``LongformerSelfOutput`` and ``LongformerOutput`` modules their bias,
    dropout and residual, its ``nn.LayerNorm`` modules run on our layer norm and its other
    ``nn.Linear`` modules on :class:`longformer_ops.nn.dense.Linear`, and LED's decoder attention runs
    its products through :func:`longformer_ops.nn.dense.float32_products` (see the module docstring).
    Patching a patched model again switches what was added since (a PEFT adapter's layers). Either way ``LongformerModel``'s and ``LEDEncoder``'s ``_pad_to_window_size`` is replaced
    class-wide by :func:`_pad_to_window_size`, which pads as before for a model whose self-attention
    is not all patched (``unpatch()`` restores it)."""
    targets = _target_classes()
    if model is None:
        for namespace, name in targets:
            original = getattr(namespace, name)
            if getattr(original, "_original_class", None) is None:
                _class_patches.append((namespace, name, original))
                setattr(namespace, name, _patched_class(original))
        for cls in _pretrained_classes():
            if cls not in _post_init_originals:
                _post_init_originals[cls] = (cls.post_init, cls.__dict__.get("post_init"))
                cls.post_init = _post_init
        _unpad_models()
        return None
    originals = _original_attention_classes()
    for module in model.modules():
        cls = type(module)
        if cls in originals:
            module.__class__ = _patched_class(cls)
            _adopt(module)
    # Also for a model patched before: modules added since (a PEFT adapter's linear layers) join.
    if any(isinstance(module, originals) for module in model.modules()):
        _swap_modules(model, ours=True)
    _unpad_models()
    if _has_sliding_layers(model) and model.config._attn_implementation != hf_attention.NAME:
        register()
        model._attn_implementation_before_patch = model.config._attn_implementation
        model.set_attn_implementation(hf_attention.NAME)
    return model


def _has_sliding_layers(model) -> bool:
    """Whether ``model`` (ModernBERT, Mistral, Gemma, ...) has layers with a sliding window, which
    :mod:`longformer_ops.hf.attention` runs on our kernels through transformers' attention interface."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return getattr(config, "sliding_window", None) is not None


def unpatch(model=None):
    """Undo :func:`patch`: for ``model``, its modules run transformers' code again, its dropouts,
    layer norms and linear layers are torch's ``nn.Dropout``, ``nn.LayerNorm`` and ``nn.Linear``, its
    intermediate and output layers transformers' (returns ``model``); without a model, transformers'
    classes are restored."""
    if model is None:
        while _class_patches:
            namespace, name, original = _class_patches.pop()
            setattr(namespace, name, original)
        while _padding_originals:
            cls, original = _padding_originals.popitem()
            cls._pad_to_window_size = original
        while _post_init_originals:
            cls, (_, own) = _post_init_originals.popitem()
            if own is None:
                del cls.post_init  # inherited again
            else:
                cls.post_init = own
        return None
    _swap_modules(model, ours=False)
    if "_attn_implementation_before_patch" in vars(model):
        model.set_attn_implementation(vars(model).pop("_attn_implementation_before_patch"))
    for module in model.modules():
        original = getattr(type(module), "_original_class", None)
        if original is not None:
            module.__class__ = original
            for name in ("window", "dilation", "autoregressive", "attention_mode"):
                module.__dict__.pop(name, None)
    return model
