"""The dense products (projections, the FFN, the global slots' products) in bfloat16 and float16
on CPUs where torch has no GEMM of its own for them.

torch's CPU matmuls in the half types run on oneDNN only where the CPU has instructions for them
(bfloat16: AVX-512 or AMX; float16: AVX512-FP16 or AMX-FP16). Elsewhere, on every AVX2 CPU, they
fall back to loops many times slower than float32's GEMM (docs/performance.md). There the products
below run in float32 on the same values (a half type widens to float32 exactly) and round their
result to the half type once, as torch's half GEMMs accumulate in float32 and round once: the
same numbers up to the order of the sums, at float32's rate, for the price of widening the
operands (O(rows x features) against the product's O(rows x features^2)). Nothing is kept in
float32 between forward and backward, and the float32 temporaries come from recycled memory
(below). Everywhere else they are torch's own calls.

``linear`` and ``apply_linear`` (the projections, the FFN, the heads), ``Linear`` (an ``nn.Linear``
computed by ``linear``: what ``hf.patch`` makes of a transformers model's other linear layers),
``mm_into`` (the same without autograd, into recycled memory), ``einsum``, ``bmm`` and ``matmul`` (the
global slots' and Poolingformer's products), ``float32_products`` (a context that sends other code's
``torch.bmm``/``mm``/``matmul`` calls through ``matmul``: transformers' LED decoder attention);
``plain_linear`` says which ``nn.Linear`` may be computed from its weights. ``matmul``'s products of
a few rows without gradient (a generation step's attention over its cache) run in the CPU
libraries' few-row kernels instead, which widen each half-type element in a register.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from longformer_ops.runtime import kernels
from longformer_ops.runtime.output_cache import new_output

HALF_TYPES = (torch.bfloat16, torch.float16)


def _cpu_has_half_gemm(dtype: torch.dtype) -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(torch.backends.mkldnn.is_available() and getattr(mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch without the query: assume its GEMM is native
        return True


# Asked once, at import: a constant that torch.compile reads without tracing the query. Read at each
# call of computes_in_float32 (never bound elsewhere): the tests set it to force either path on any CPU.
CPU_HAS_HALF_GEMM = {dtype: _cpu_has_half_gemm(dtype) for dtype in HALF_TYPES}


def computes_in_float32(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether products in ``dtype`` on ``device`` run here in float32 (a half type on a CPU
    without torch's native GEMM for it)."""
    return dtype in HALF_TYPES and torch.device(device).type == "cpu" and not CPU_HAS_HALF_GEMM[dtype]


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes ``x W^T + b`` from its ``weight`` and ``bias`` and nothing else: not a
    subclass or wrapper (a LoRA adapter, a quantized layer) whose output the weights do not tell, no
    hooks, and no ``forward`` of its own instance (accelerate's offloading hooks replace it)."""
    plain_class = type(module) is nn.Linear or (isinstance(module, Linear) and type(module).forward is Linear.forward)
    return (
        plain_class
        and module.bias is not None
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and "forward" not in module.__dict__
    )


# The widened operands, float32 products and rounded results below are as large as the layer's
# activations and made anew for every product: taken from torch's allocator, each is fresh memory
# from the OS, faulted in page by page. So they come from the kernels' output cache
# (runtime/output_cache.py), but under torch.compile, which plans its own memory.


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or as it is if wider (float64: the autograd functions below are gradchecked so)."""
    dtype = torch.promote_types(t.dtype, torch.float32)
    if t.dtype == dtype or not t.is_contiguous() or torch.compiler.is_compiling():
        return t.to(dtype)
    return new_output(t, t.shape, dtype).copy_(t)


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (``+ bias``) of 2-D ``a`` and ``b``."""
    out = None if torch.compiler.is_compiling() else new_output(a, (a.shape[0], b.shape[1]))
    return torch.mm(a, b, out=out) if bias is None else torch.addmm(bias, a, b, out=out)


def _narrow(t: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """``t`` rounded to ``dtype``, viewed as ``shape``."""
    if torch.compiler.is_compiling():
        return t.to(dtype).view(shape)
    return new_output(t, shape, dtype).copy_(t.view(shape))


def product_dtype(x: torch.Tensor, *others: torch.Tensor | None) -> torch.dtype | None:
    """The dtype torch would multiply ``x`` and ``others`` in: autocast's where it is on for their
    device, else their common dtype; None where they differ (torch's own call then raises, as it
    would anyway). The rule every layer here that picks a kernel by dtype follows."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype if all(t is None or t.dtype == x.dtype for t in others) else None


def _float32_dtype(x: torch.Tensor, *others: torch.Tensor | None) -> torch.dtype | None:
    """The half type a product of ``x`` and ``others`` multiplies in (:func:`product_dtype`) where
    that runs in float32 here (:func:`computes_in_float32`), else None."""
    dtype = product_dtype(x, *others)
    return dtype if dtype is not None and computes_in_float32(dtype, x.device) else None


# A layer with many output features (a language model's 50265-word head) runs in blocks of this
# many: its float32 temporaries (the widened weight, the product, the widened output gradient) are
# then a block's, not the layer's (at 4096 rows of a hidden-768 model: 25 MiB of weight and 128 MiB
# of product a block, against 154 MiB and 824 MiB whole). Every other layer is one block.
FEATURE_BLOCK = 8192


def _feature_blocks(features: int) -> list[slice]:
    return [slice(start, min(start + FEATURE_BLOCK, features)) for start in range(0, max(features, 1), FEATURE_BLOCK)]


def _empty(like: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor from recycled memory (torch's under torch.compile)."""
    if torch.compiler.is_compiling():
        return torch.empty(shape, dtype=dtype, device=like.device)
    return new_output(like, shape, dtype)


class _Float32Linear(torch.autograd.Function):
    """``x W^T + b`` for half-type tensors, each product in float32, results rounded to the half
    type, in blocks of :data:`FEATURE_BLOCK` output features; saves the half-type inputs only."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = _empty(x, (*x.shape[:-1], weight.shape[0]), x.dtype)
        out_rows = out.view(-1, weight.shape[0])
        with torch.autocast(x.device.type, enabled=False):
            rows = _wide(x).reshape(-1, x.shape[-1])
            for block in _feature_blocks(weight.shape[0]):
                out_rows[:, block] = _product(
                    rows, _wide(weight[block]).t(), None if bias is None else _wide(bias[block])
                )
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.empty_like(weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = weight.new_empty(weight.shape[0])
        with torch.autocast(x.device.type, enabled=False):
            x_rows = _wide(x).reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
            for block in _feature_blocks(weight.shape[0]):
                rows = _wide(grad_rows[:, block])
                if ctx.needs_input_grad[0]:  # summed over the blocks in float32
                    wide_weight = _wide(weight[block])
                    grad_x = _product(rows, wide_weight) if grad_x is None else grad_x.addmm_(rows, wide_weight)
                if grad_weight is not None:
                    grad_weight[block] = rows.t() @ x_rows
                if grad_bias is not None:
                    grad_bias[block] = rows.sum(0)
            if grad_x is not None:
                grad_x = _narrow(grad_x, x.dtype, x.shape)
        return grad_x, grad_weight, grad_bias


# The float32 path widens the whole weight for every call, where torch's half-type loops read it
# once per row: with no gradient to compute and at most this many rows (a decoder's generation
# step), torch's call takes less time (the crossover measured: bench/NOTES.md, "Few-row products").
# With gradients the float32 path wins from 2 rows on (torch's backward loops are slower still).
# The same limit sends matmul's products that need no gradient to the few-row kernels (below).
FEW_ROWS = 8


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _few_rows_without_grad(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    return not _needs_grad(x, *others) and x.numel() <= FEW_ROWS * x.shape[-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``nn.functional.linear(x, weight, bias)``, in float32 where :func:`computes_in_float32` says
    so for the dtype it multiplies in (autocast's, when on; then cast to it first, as autocast does),
    but for :data:`FEW_ROWS` rows or fewer that need no gradient (torch's call is faster there)."""
    dtype = _float32_dtype(x, weight, bias)
    if dtype is None or _few_rows_without_grad(x, weight, bias):
        return nn.functional.linear(x, weight, bias)
    return _Float32Linear.apply(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


class Linear(nn.Linear):
    """``nn.Linear`` whose product goes through :func:`linear`: the same parameters, state dict and
    result (torch's own call but where :func:`computes_in_float32`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def apply_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an ``nn.Linear``: through :func:`linear` when it is a plain one
    (:func:`plain_linear`); any other module (an adapter, a hooked layer) runs its own forward."""
    return linear(x, module.weight, module.bias) if plain_linear(module) else module(x)


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.mm(a, b, out=out)`` (``torch.addmm(bias, a, b, out=out)`` with a bias) outside autograd,
    in float32 where :func:`computes_in_float32` says so (into a float32 temporary, then ``out``)."""
    if product_dtype(a, b, out, bias) is None or not computes_in_float32(a.dtype, a.device):
        return torch.mm(a, b, out=out) if bias is None else torch.addmm(bias, a, b, out=out)
    return out.copy_(_product(_wide(a), _wide(b), None if bias is None else _wide(bias)))


def _gradient_equations(equation: str) -> tuple[str, str]:
    """For ``"A,B->C"``: the einsums of C's gradient with B giving A's (``"C,B->A"``) and with A giving B's."""
    inputs, output = equation.replace(" ", "").split("->")
    a, b = inputs.split(",")
    for mine, other in ((a, b), (b, a)):
        if not set(mine) <= set(other) | set(output) or len(set(mine)) != len(mine):
            raise ValueError(
                f"dense.einsum: {equation!r} sums an index of one operand alone or repeats one: "
                "its gradient is not an einsum of the other two"
            )
    return f"{output},{b}->{a}", f"{a},{output}->{b}"


class _Float32Einsum(torch.autograd.Function):
    """``torch.einsum(equation, a, b)`` for half-type tensors, in float32, rounded back; saves the
    half-type inputs only."""

    @staticmethod
    def forward(ctx, equation, a, b):
        ctx.equation = equation
        ctx.save_for_backward(a, b)
        with torch.autocast(a.device.type, enabled=False):
            return torch.einsum(equation, _wide(a), _wide(b)).to(a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        for_a, for_b = _gradient_equations(ctx.equation)
        grad_a = grad_b = None
        with torch.autocast(a.device.type, enabled=False):
            if ctx.needs_input_grad[1]:
                grad_a = torch.einsum(for_a, _wide(grad), _wide(b)).to(a.dtype)
            if ctx.needs_input_grad[2]:
                grad_b = torch.einsum(for_b, _wide(a), _wide(grad)).to(b.dtype)
        return None, grad_a, grad_b


def einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, a, b)`` (two operands; every index of each in the other or the
    output), in float32 where :func:`computes_in_float32` says so for the dtype it multiplies in
    (autocast's, when on; then cast to it first, as autocast does)."""
    dtype = _float32_dtype(a, b)
    if dtype is None:
        return torch.einsum(equation, a, b)
    _gradient_equations(equation)  # checked here, where the call is, not in the backward
    return _Float32Einsum.apply(equation, a.to(dtype), b.to(dtype))


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)``, in float32 where :func:`computes_in_float32` says so."""
    if a.dim() != b.dim() or a.dim() != 3 or _float32_dtype(a, b) is None:
        return torch.bmm(a, b)
    return matmul(a, b)


_BATCH_INDICES = "abcdefgh"  # matmul's einsum letters for up to 8 batch dimensions


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)``, in float32 where :func:`computes_in_float32` says so, for operands of
    the same rank (2 to 10) and the same batch dimensions: ``mm``, ``bmm`` and the attention products
    of ``[batch, heads, n, d]`` tensors. Other shapes (batches broadcast, vectors) are torch's call.
    Products of at most :data:`FEW_ROWS` rows of ``a`` that need no gradient (a generation step's
    attention over its key/value cache) run in the few-row kernels, where the CPU library has them."""
    dtype = _float32_dtype(a, b)
    if (
        dtype is None
        or a.dim() != b.dim()
        or not 2 <= a.dim() <= 2 + len(_BATCH_INDICES)
        or a.shape[:-2] != b.shape[:-2]
    ):
        return torch.matmul(a, b)
    if _few_row_kernels_serve(a, b, dtype):
        return _few_row_product(a.to(dtype), b.to(dtype))  # (autocast's cast, as einsum's; .to keeps a transpose)
    batch = _BATCH_INDICES[: a.dim() - 2]
    return einsum(f"{batch}ij,{batch}jk->{batch}ik", a, b)


# Widening a half-type key/value cache for a float32 product of one query row costs more than the
# product; the few-row kernels read each element once in its own dtype and widen it in a register.
def _few_row_kernels_serve(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return not _needs_grad(a, b) and a.shape[-2] <= FEW_ROWS and kernels.available("few_row_products", a.device, dtype)


def _few_row_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (same batch dimensions) by the few-row kernels, ``b`` read as it lies when it is a
    transposed contiguous matrix (a key cache's ``transpose(-1, -2)``)."""
    batch = math.prod(a.shape[:-2])
    rows, inner, cols = a.shape[-2], a.shape[-1], b.shape[-1]
    a = a.reshape(batch, rows, inner)
    if b.transpose(-1, -2).is_contiguous():
        out = kernels.few_rows_mm_nt(a, b.transpose(-1, -2).reshape(batch, cols, inner))
    else:
        out = kernels.few_rows_mm(a, b.reshape(batch, inner, cols))
    return out.view(*b.shape[:-2], rows, cols)


class _Float32Products(TorchFunctionMode):
    """:func:`float32_products`: torch's matrix products of two tensors, called by name, through
    :func:`matmul` where its rank rules hold (``bmm`` of 3-D tensors, ``mm`` of 2-D ones); every other
    call (a wrong rank, keyword arguments such as ``out=``) is torch's own, errors included."""

    RANKS = {
        torch.bmm: 3,
        torch.Tensor.bmm: 3,
        torch.mm: 2,
        torch.Tensor.mm: 2,
        torch.matmul: None,
        torch.Tensor.matmul: None,
        torch.Tensor.__matmul__: None,
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rank = self.RANKS.get(func, 0)
        if rank != 0 and not kwargs and len(args) == 2 and all(isinstance(t, torch.Tensor) for t in args):
            a, b = args
            if (rank is None or a.dim() == b.dim() == rank) and _float32_dtype(a, b) is not None:
                return matmul(a, b)  # (the mode is off inside this method: no recursion)
        return func(*args, **(kwargs or {}))


def float32_products() -> TorchFunctionMode:
    """A context in which ``torch.bmm``, ``torch.mm``, ``torch.matmul`` and ``@`` (functions and
    tensor methods) run as :func:`matmul`: in float32 on half-type values where
    :func:`computes_in_float32` says so (where torch's own products run slow loops), torch's own
    call everywhere else. For code that is not ours,
    such as transformers' LED decoder attention, which ``hf.patch`` runs in it::

        with longformer_ops.nn.dense.float32_products():
            scores = torch.bmm(q, k.transpose(1, 2))   # bfloat16 on an AVX2 CPU: float32's speed
    """
    return _Float32Products()
