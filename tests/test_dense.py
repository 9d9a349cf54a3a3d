"""longformer_ops.nn.dense: the dense products in float32 for the half types where torch has no CPU
GEMM of its own for them. Which devices and dtypes take it; the products and their gradients
against float64 on the same (rounded) inputs, element by element, to one rounding of the half
type plus float32's accumulation; gradcheck of the autograd functions in float64; the
``float32_products`` context (other code's ``bmm``/``mm``/``matmul``/``@``: routed, or torch's own
call where it should be), the few-row rules (linear: torch's call; other products: the few-row
kernels) and autocast; and that the encoder, its task heads, global tokens, Poolingformer's level 2
and transformers' Longformer and LED models patched send no half-type product to torch where the
float32 path is on, forward, backward, without autograd and generating."""

from __future__ import annotations

import operator

import pytest
import torch
from conftest import stable_seed, unit_roundoff
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from longformer_ops import LongformerConfig
from longformer_ops.models.config import PoolingConfig
from longformer_ops.models.tasks import LongformerForMaskedLM
from longformer_ops.nn import dense

HALF = [torch.bfloat16, torch.float16]


def test_which_products_run_in_float32():
    assert not dense.computes_in_float32(torch.float32, "cpu") and not dense.computes_in_float32(torch.float64, "cpu")
    assert not dense.computes_in_float32(torch.bfloat16, "cuda")
    assert not dense.computes_in_float32(torch.float16, "cuda:0")
    # On the CPU: where torch's own half GEMM runs on oneDNN, it stays torch's.
    assert dense.computes_in_float32(torch.bfloat16, "cpu") == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert dense.computes_in_float32(torch.float16, "cpu") == (not torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _random(generator, *shape, dtype):
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


def _assert_one_rounding(got, exact, magnitude, terms, dtype, what, seed):
    """|got - exact| <= u |exact| + (terms + 2) u32 magnitude, element by element: the half type's
    rounding of a float32 sum of ``terms`` products (``magnitude``: the sum of their absolute values)."""
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    bound = unit_roundoff(dtype) * exact.abs() + (terms + 2) * unit_roundoff(torch.float32) * magnitude
    excess = (got.double() - exact).abs() - bound
    assert (excess <= 0).all(), (
        f"{what}: {int((excess > 0).sum())} elements over the bound, worst by "
        f"{float(excess.max()):.3e} ({dtype}, seed {seed})"
    )


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 33), (1, 130, 64)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("feature_block", [None, 4], ids=["one-block", "three-blocks"])
def test_linear_and_its_gradients_round_once(float32_products, dtype, shape, with_bias, feature_block, monkeypatch):
    """11 output features, in one block or (FEATURE_BLOCK = 4) in three: forward and gradients."""
    if feature_block:
        monkeypatch.setattr(dense, "FEATURE_BLOCK", feature_block)
    seed = stable_seed(str(dtype), shape, with_bias)
    generator = torch.Generator().manual_seed(seed)
    x = _random(generator, *shape, dtype=dtype).requires_grad_()
    weight = _random(generator, 11, shape[-1], dtype=dtype).requires_grad_()
    bias = _random(generator, 11, dtype=dtype).requires_grad_() if with_bias else None
    y = dense.linear(x, weight, bias)
    grad = _random(generator, *y.shape, dtype=dtype)
    y.backward(grad)

    x64, w64, g64 = x.detach().double(), weight.detach().double(), grad.double()
    rows, grad_rows = x64.reshape(-1, shape[-1]), g64.reshape(-1, 11)
    b64 = bias.detach().double() if with_bias else torch.zeros(11, dtype=torch.float64)
    _assert_one_rounding(y, x64 @ w64.t() + b64, x64.abs() @ w64.abs().t() + b64.abs(), shape[-1] + 1, dtype, "y", seed)
    _assert_one_rounding(x.grad, g64 @ w64, g64.abs() @ w64.abs(), 11, dtype, "dx", seed)
    _assert_one_rounding(
        weight.grad, grad_rows.t() @ rows, grad_rows.abs().t() @ rows.abs(), rows.shape[0], dtype, "dW", seed
    )
    if with_bias:
        _assert_one_rounding(bias.grad, grad_rows.sum(0), grad_rows.abs().sum(0), rows.shape[0], dtype, "db", seed)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_einsum_and_bmm_and_their_gradients_round_once(float32_products, dtype):
    """An einsum of the global slots' kind (the summed index in both operands) and a batched
    product, forward and gradients."""
    seed = stable_seed(str(dtype), "einsum")
    generator = torch.Generator().manual_seed(seed)
    x, slots = (_random(generator, *s, dtype=dtype).requires_grad_() for s in ((2, 37, 3, 19), (2, 5, 3, 19)))
    out = dense.einsum("bnhd,bghd->bnhg", x, slots)
    grad = _random(generator, *out.shape, dtype=dtype)
    out.backward(grad)
    x64, s64, g64 = (t.detach().double() for t in (x, slots, grad))
    _assert_one_rounding(
        out,
        torch.einsum("bnhd,bghd->bnhg", x64, s64),
        torch.einsum("bnhd,bghd->bnhg", x64.abs(), s64.abs()),
        19,
        dtype,
        "out",
        seed,
    )
    _assert_one_rounding(
        x.grad,
        torch.einsum("bnhg,bghd->bnhd", g64, s64),
        torch.einsum("bnhg,bghd->bnhd", g64.abs(), s64.abs()),
        5,
        dtype,
        "dx",
        seed,
    )
    _assert_one_rounding(
        slots.grad,
        torch.einsum("bnhd,bnhg->bghd", x64, g64),
        torch.einsum("bnhd,bnhg->bghd", x64.abs(), g64.abs()),
        37,
        dtype,
        "dslots",
        seed,
    )

    a, b = (_random(generator, *s, dtype=dtype).requires_grad_() for s in ((2, 37, 19), (2, 19, 5)))
    out = dense.bmm(a, b)
    grad = _random(generator, *out.shape, dtype=dtype)
    out.backward(grad)
    a64, b64, g64 = (t.detach().double() for t in (a, b, grad))
    _assert_one_rounding(out, a64 @ b64, a64.abs() @ b64.abs(), 19, dtype, "bmm", seed)
    _assert_one_rounding(a.grad, g64 @ b64.transpose(1, 2), g64.abs() @ b64.abs().transpose(1, 2), 5, dtype, "da", seed)
    _assert_one_rounding(
        b.grad, a64.transpose(1, 2) @ g64, a64.abs().transpose(1, 2) @ g64.abs(), 37, dtype, "db", seed
    )


_PRODUCT_CALLS = {  # how code that is not ours asks torch for a product: (name, call, operand shapes)
    "torch.bmm": (torch.bmm, ((3, 9, 19), (3, 19, 5))),
    "Tensor.bmm": (torch.Tensor.bmm, ((3, 9, 19), (3, 19, 5))),
    "torch.mm": (torch.mm, ((9, 19), (19, 5))),
    "Tensor.mm": (torch.Tensor.mm, ((9, 19), (19, 5))),
    "torch.matmul 2-D": (torch.matmul, ((9, 19), (19, 5))),
    "Tensor.matmul 3-D": (torch.Tensor.matmul, ((3, 9, 19), (3, 19, 5))),
    "@ 4-D": (lambda a, b: a @ b, ((2, 3, 9, 19), (2, 3, 19, 5))),
}


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("call", sorted(_PRODUCT_CALLS))
def test_float32_products_routes_other_codes_products(float32_products, dtype, call):
    """Inside ``dense.float32_products()`` torch's products of half-type tensors (functions, methods,
    ``@``; a transposed operand as attention passes its keys) run in float32 and round once, forward and
    gradients: no half-type product reaches torch."""
    seed = stable_seed(str(dtype), call)
    generator = torch.Generator().manual_seed(seed)
    product, (shape_a, shape_b) = _PRODUCT_CALLS[call]
    a = _random(generator, *shape_a, dtype=dtype).requires_grad_()
    b_stored = _random(generator, *shape_b[:-2], shape_b[-1], shape_b[-2], dtype=dtype).requires_grad_()
    with _HalfTypeProducts() as products:
        with dense.float32_products():
            out = product(a, b_stored.transpose(-1, -2))
        grad = _random(generator, *out.shape, dtype=dtype)
        out.backward(grad)
    assert not products.seen, products.seen
    a64, b64, g64 = a.detach().double(), b_stored.detach().double().transpose(-1, -2), grad.double()
    _assert_one_rounding(out, a64 @ b64, a64.abs() @ b64.abs(), 19, dtype, call, seed)
    _assert_one_rounding(
        a.grad, g64 @ b64.transpose(-1, -2), g64.abs() @ b64.abs().transpose(-1, -2), 5, dtype, f"{call}: da", seed
    )
    _assert_one_rounding(
        b_stored.grad,
        (a64.transpose(-1, -2) @ g64).transpose(-1, -2),
        (a64.abs().transpose(-1, -2) @ g64.abs()).transpose(-1, -2),
        9,
        dtype,
        f"{call}: db",
        seed,
    )


def test_float32_products_leaves_the_rest_to_torch(float32_products):
    """Inside ``dense.float32_products()``: float32 products, broadcast batches, ``out=`` and bad ranks
    are torch's own calls, bit for bit and error for error; without the context nothing is routed."""
    torch.manual_seed(8)
    a, b = torch.randn(3, 9, 19), torch.randn(3, 19, 5)
    with dense.float32_products():
        assert torch.equal(torch.bmm(a, b), torch.bmm(a.clone(), b.clone()))
    half_a, half_b = a.bfloat16(), b.bfloat16()
    for product in (
        lambda: half_a[:1] @ half_b,
        lambda: torch.bmm(half_a, half_b, out=torch.empty(3, 9, 5).bfloat16()),
    ):
        with _HalfTypeProducts() as products, dense.float32_products():
            product()
        assert products.seen, "routed where torch's own call was due"
    for bad in (
        lambda: torch.bmm(half_a[0], half_b[0]),
        lambda: torch.mm(half_a, half_b),
        lambda: torch.bmm(half_a, b),
    ):
        with pytest.raises(RuntimeError) as torchs:
            bad()
        with pytest.raises(RuntimeError) as ours, dense.float32_products():
            bad()
        assert str(ours.value) == str(torchs.value)
    with _HalfTypeProducts() as products:
        torch.bmm(half_a, half_b)
    assert products.seen


def test_few_rows_without_grad_are_torchs_own_call(float32_products):
    """``dense.linear`` leaves a product of at most ``FEW_ROWS`` rows that needs no gradient to torch
    (faster there: a generation step); more rows, or a gradient to compute, go through float32."""
    torch.manual_seed(9)
    weight, bias = torch.randn(6, 40).bfloat16(), torch.randn(6).bfloat16()
    few, many = (torch.randn(1, rows, 40).bfloat16() for rows in (dense.FEW_ROWS, dense.FEW_ROWS + 1))
    for x, torchs in ((few, True), (many, False), (few.clone().requires_grad_(), False)):
        with _HalfTypeProducts(few_rows_without_grad=False) as products:
            y = dense.linear(x, weight, bias)
        assert bool(products.seen) == torchs, (x.shape, x.requires_grad, products.seen)
        if torchs:
            assert torch.equal(y, torch.nn.functional.linear(x, weight, bias))
    with torch.no_grad(), _HalfTypeProducts(few_rows_without_grad=False) as products:
        dense.linear(few, weight.clone().requires_grad_(), bias)
    assert products.seen, "no gradient under no_grad: torch's call"


class _OpCalls(TorchDispatchMode):
    """Records the name of every op dispatched (ours appear as ``longformer_ops::...``)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


_FEW_ROW_CASES = {  # a product and which few-row kernel it takes: (call, shapes of a and of b as stored, kernel)
    "query x keys^T": (lambda a, b: torch.bmm(a, b.transpose(1, 2)), ((12, 1, 64), (12, 300, 64)), "few_rows_mm_nt"),
    "probs x values": (torch.bmm, ((12, 1, 300), (12, 300, 64)), "few_rows_mm"),
    "4-D, 8 rows": (lambda a, b: a @ b, ((2, 3, 8, 19), (2, 3, 19, 33)), "few_rows_mm"),
    "mm of a strided b": (lambda a, b: torch.mm(a, b[:, ::2]), ((2, 40), (40, 66)), "few_rows_mm"),
}


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("case", sorted(_FEW_ROW_CASES))
def test_few_row_products_without_grad_run_in_the_few_row_kernels(float32_products, dtype, case):
    """Inside ``dense.float32_products()`` a product of at most ``FEW_ROWS`` rows that needs no gradient
    (a generation step's attention over its cache) runs in the few-row kernels, a transposed key
    cache read as it lies; rounded once."""
    seed = stable_seed(str(dtype), case)
    generator = torch.Generator().manual_seed(seed)
    product, (shape_a, shape_b), kernel = _FEW_ROW_CASES[case]
    a, b = _random(generator, *shape_a, dtype=dtype), _random(generator, *shape_b, dtype=dtype)
    with _OpCalls() as calls, dense.float32_products():
        out = product(a, b)
    ours = [name for name in calls.names if name.startswith("longformer_ops::")]
    assert ours == [f"longformer_ops::{kernel}"], calls.names
    a64, b64 = a.double(), b.double()
    exact, magnitude = product(a64, b64), product(a64.abs(), b64.abs())
    _assert_one_rounding(out, exact, magnitude, shape_a[-1], dtype, case, seed)


def test_few_row_products_under_autocast_run_in_the_few_row_kernels(float32_products):
    """Under CPU autocast to bfloat16, float32 operands are cast to it (as autocast casts them) and
    multiplied in the few-row kernel: a bfloat16 result, rounded once from the cast operands."""
    generator = torch.Generator().manual_seed(14)
    query, keys = (
        _random(generator, 12, 1, 64, dtype=torch.float32),
        _random(generator, 12, 300, 64, dtype=torch.float32),
    )
    with _OpCalls() as calls, torch.autocast("cpu", torch.bfloat16), dense.float32_products():
        out = torch.bmm(query, keys.transpose(1, 2))
    assert [name for name in calls.names if name.startswith("longformer_ops::")] == ["longformer_ops::few_rows_mm_nt"]
    q64, k64 = query.bfloat16().double(), keys.bfloat16().double().transpose(1, 2)
    _assert_one_rounding(out, q64 @ k64, q64.abs() @ k64.abs(), 64, torch.bfloat16, "autocast", 14)


def test_few_row_kernels_leave_more_rows_gradients_and_float32_alone(float32_products):
    """More than ``FEW_ROWS`` rows, a gradient to compute, or float32 operands: no few-row kernel."""
    torch.manual_seed(12)
    keys = torch.randn(12, 300, 64).bfloat16()
    for query, grad in (
        (torch.randn(12, dense.FEW_ROWS + 1, 64).bfloat16(), False),
        (torch.randn(12, 1, 64).bfloat16(), True),
        (torch.randn(12, 1, 64), False),
    ):
        query.requires_grad_(grad)
        with _OpCalls() as calls, dense.float32_products():
            torch.bmm(query, (keys if query.dtype == keys.dtype else keys.float()).transpose(1, 2))
        assert not [name for name in calls.names if "few_rows" in name], (query.shape, grad, query.dtype, calls.names)


def test_products_under_autocast_run_in_float32(float32_products):
    """Under CPU autocast to a half type, float32 operands of einsum, bmm and matmul are cast to it and
    multiplied in float32, as dense.linear does: no half-type product reaches torch."""
    torch.manual_seed(10)
    a, b = torch.randn(2, 9, 19), torch.randn(2, 19, 5)
    with _HalfTypeProducts() as products, torch.autocast("cpu", torch.bfloat16):
        outs = [dense.einsum("bij,bjk->bik", a, b), dense.bmm(a, b), dense.matmul(a, b)]
        with dense.float32_products():
            outs.append(a @ b)
    assert not products.seen, products.seen
    assert all(out.dtype == torch.bfloat16 for out in outs)
    assert all(torch.equal(out, outs[0]) for out in outs)


@pytest.mark.parametrize("equation", ["bnd,bd->b", "ij,jk->i", "ii,ij->j"])
def test_einsum_refuses_what_its_backward_cannot_express(float32_products, equation):
    """An index summed in one operand alone (its gradient is a broadcast) or repeated (a diagonal)."""
    a, b = torch.ones(2, 2, 2, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.bfloat16)
    operands = (a, b) if equation.startswith("bnd") else (b, b)
    with pytest.raises(ValueError, match=r"dense.einsum: .* its gradient is not an einsum of the other two"):
        dense.einsum(equation, *operands)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_mm_into_rounds_once(float32_products, dtype, with_bias):
    seed = stable_seed(str(dtype), "mm_into", with_bias)
    generator = torch.Generator().manual_seed(seed)
    a, weight, bias = (
        _random(generator, 9, 70, dtype=dtype),
        _random(generator, 13, 70, dtype=dtype),
        _random(generator, 13, dtype=dtype),
    )
    out = torch.full((9, 13), float("nan"), dtype=dtype)
    assert dense.mm_into(a, weight.t(), out, bias if with_bias else None) is out
    a64, w64 = a.double(), weight.double()
    b64 = bias.double() if with_bias else torch.zeros(13, dtype=torch.float64)
    _assert_one_rounding(out, a64 @ w64.t() + b64, a64.abs() @ w64.abs().t() + b64.abs(), 71, dtype, "out", seed)


def test_mixed_dtypes_fail_as_torch_fails(float32_products):
    """Operands of two dtypes outside autocast are not widened into agreeing: torch's error, as without dense.py."""
    x, w = torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(3, 4)
    for call in (
        lambda: dense.linear(x, w),
        lambda: dense.einsum("ij,kj->ik", x, w),
        lambda: dense.bmm(x[None], w.t()[None]),
        lambda: dense.mm_into(x, w.t(), torch.empty(2, 3)),
    ):
        with pytest.raises(RuntimeError, match="dtype|type"):
            call()
    with torch.autocast("cpu", torch.bfloat16):  # autocast casts them to its dtype: widened from there
        assert dense.linear(w, x).dtype == torch.bfloat16


def test_autograd_functions_gradcheck_in_float64():
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (
        torch.randn(*s, generator=generator, dtype=torch.float64, requires_grad=True) for s in ((3, 4, 5), (6, 5), (6,))
    )
    assert torch.autograd.gradcheck(dense._Float32Linear.apply, (x, weight, bias))
    assert torch.autograd.gradcheck(lambda x, weight: dense._Float32Linear.apply(x, weight, None), (x, weight))
    a, b = (
        torch.randn(*s, generator=generator, dtype=torch.float64, requires_grad=True)
        for s in ((2, 4, 3, 5), (2, 6, 3, 5))
    )
    assert torch.autograd.gradcheck(lambda a, b: dense._Float32Einsum.apply("bnhd,bghd->bnhg", a, b), (a, b))
    # Only one input needing a gradient: the other gets None.
    assert torch.autograd.gradcheck(lambda a: dense._Float32Einsum.apply("bnhd,bghd->bnhg", a, b.detach()), (a,))


def test_linear_under_torch_compile_is_eagers(float32_products):
    """torch.compile(fullgraph=True) traces the float32 path (its temporaries then torch's, not the
    output cache's): eager's output and gradients."""
    torch.manual_seed(6)
    x, weight, bias = (torch.randn(*shape).bfloat16().requires_grad_() for shape in ((3, 300, 40), (1100, 40), (1100,)))

    def loss(x, weight, bias):
        return dense.linear(x, weight, bias).float().square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        value = fn(x, weight, bias)
        results.append([value, *torch.autograd.grad(value, (x, weight, bias))])
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=unit_roundoff(torch.bfloat16), atol=0)


def test_float32_products_under_torch_compile_are_eagers(float32_products):
    """torch.compile(fullgraph=True) traces through the context: eager's output and gradients, and the
    graph's products in float32 (none in the half type)."""
    torch.manual_seed(7)
    q, k = (torch.randn(3, n, 16).bfloat16().requires_grad_() for n in (20, 30))

    def attention(q, k):
        with dense.float32_products():
            probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1)
            return (probs @ k).float().square().sum()

    from torch._dynamo.testing import CompileCounterWithBackend

    with _HalfTypeProducts() as products:  # (a dispatch mode stops torch.compile: eager only)
        value = attention(q, k)
        results = [[value, *torch.autograd.grad(value, (q, k))]]
    assert not products.seen, products.seen
    backend = CompileCounterWithBackend("aot_eager")
    value = torch.compile(attention, fullgraph=True, backend=backend)(q, k)
    results.append([value, *torch.autograd.grad(value, (q, k))])
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=unit_roundoff(torch.bfloat16), atol=0)
    products = [
        node
        for graph in backend.graphs
        for module in graph.modules()
        if hasattr(module, "graph")
        for node in module.graph.nodes
        if node.target in (torch.bmm, torch.matmul, torch.einsum, operator.matmul)
    ]
    operand_dtypes = {
        arg.meta["example_value"].dtype for node in products for arg in node.args if isinstance(arg, torch.fx.Node)
    }
    assert products and operand_dtypes == {torch.float32}, (products, operand_dtypes)


def test_few_row_products_under_torch_compile_are_eagers(float32_products):
    """torch.compile(fullgraph=True) traces the few-row kernel as one op: eager's result, bit for bit."""
    torch.manual_seed(13)
    query, keys = torch.randn(12, 1, 64).bfloat16(), torch.randn(12, 300, 64).bfloat16()

    def scores(query, keys):
        with dense.float32_products():
            return torch.bmm(query, keys.transpose(1, 2))

    with torch.no_grad():
        assert torch.equal(torch.compile(scores, fullgraph=True, backend="aot_eager")(query, keys), scores(query, keys))


def test_a_linear_that_is_not_plain_runs_its_own_forward(float32_products):
    """An adapter or hooked layer's output is not ``x W^T + b``: it runs as it is, not through the weights."""
    linear = nn.Linear(4, 3).to(torch.bfloat16)
    linear.register_forward_hook(lambda module, inputs, output: output * 2)
    x = torch.randn(2, 4).to(torch.bfloat16)
    assert torch.equal(dense.apply_linear(linear, x), linear(x))
    assert not torch.equal(dense.apply_linear(linear, x), dense.linear(x, linear.weight, linear.bias))


class _HalfTypeProducts(TorchDispatchMode):
    """Records each matrix product torch is asked for with a half-type operand, but those that
    dense.linear leaves to torch by design: at most ``dense.FEW_ROWS`` rows with no gradient."""

    PRODUCTS = {
        torch.ops.aten.mm,
        torch.ops.aten.addmm,
        torch.ops.aten.bmm,
        torch.ops.aten.baddbmm,
        torch.ops.aten.mv,
        torch.ops.aten.addmv,
        torch.ops.aten.dot,
        torch.ops.aten.addbmm,
    }
    WITH_ADDEND = {torch.ops.aten.addmm, torch.ops.aten.baddbmm, torch.ops.aten.addmv, torch.ops.aten.addbmm}

    def __init__(self, few_rows_without_grad: bool = True):
        super().__init__()
        self.few_rows_without_grad = few_rows_without_grad
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.PRODUCTS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            left = tensors[1 if func.overloadpacket in self.WITH_ADDEND else 0]
            few_rows = (
                func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and left.shape[0] <= dense.FEW_ROWS
            )
            allowed = self.few_rows_without_grad and few_rows and not torch.is_grad_enabled()
            if {t.dtype for t in tensors} & set(dense.HALF_TYPES) and not allowed:
                self.seen.append((str(func), tuple(t.shape for t in tensors)))
        return func(*args, **(kwargs or {}))


def test_dense_linear_is_an_nn_linear_through_linear(float32_products):
    """dense.Linear: torch's own result in float32, dense.linear's in the half types (rounded once);
    plain for the layers that read weights, unless a subclass gives it a forward of its own."""
    torch.manual_seed(4)
    ours, theirs = dense.Linear(8, 5), nn.Linear(8, 5)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 8)
    assert torch.equal(ours(x), theirs(x))
    half = ours.to(torch.bfloat16)
    with _HalfTypeProducts() as products:
        y = half(x.bfloat16())
    assert not products.seen and torch.equal(y, dense.linear(x.bfloat16(), half.weight, half.bias))
    assert dense.plain_linear(ours)

    class Doubled(dense.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert not dense.plain_linear(Doubled(8, 5)) and not dense.plain_linear(dense.Linear(8, 5, bias=False))


def _encoder_config(pooling_kind: str | None, autoregressive: bool = False) -> LongformerConfig:
    return LongformerConfig(
        vocab_size=24,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        attention_window=[2, 3],
        attention_dilation=[1, [1, 2, 1, 2]],
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        autoregressive=autoregressive,
        pooling=None
        if pooling_kind is None
        else PoolingConfig(window=4, kernel_size=2, stride=2, kind=pooling_kind, layers=[1]),
    )


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize(
    "pooling_kind, slots", [(None, 1), (None, 3), (None, 8), ("mean", 2), ("ldconv", 1), ("max", 1)]
)
def test_the_encoder_sends_no_half_type_product_to_torch(float32_products, dtype, pooling_kind, slots):
    """Masked LM (encoder and LM head); global tokens against the rows block-diagonally (up to
    BLOCK_DIAGONAL_SLOTS) and by einsum (more), their rows through the weights (heads x slots <
    hidden) and projected (8 slots); Poolingformer's level 2: training step and inference."""
    torch.manual_seed(stable_seed(str(dtype), pooling_kind, slots))
    model = LongformerForMaskedLM(_encoder_config(pooling_kind)).to(dtype)
    ids = torch.randint(4, 24, (2, 17))
    is_global = torch.zeros_like(ids)
    is_global[:, :slots] = 1
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, -100)
    with _HalfTypeProducts() as products:
        out = model.train()(ids, global_attention_mask=is_global, labels=labels)
        out.loss.backward()
        with torch.no_grad():
            inference = model.eval()(ids, global_attention_mask=is_global).logits
    assert not products.seen, products.seen
    assert out.logits.dtype == inference.dtype == dtype and torch.isfinite(inference).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_the_float32_path_gives_what_torch_gives_up_to_rounding():
    """The bfloat16 encoder with the float32 path and with torch's own products: the same function
    (both within a few bfloat16 roundings of the float32 encoder's hidden states)."""
    config = _encoder_config(None).replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(1)
    model = LongformerForMaskedLM(config).eval()
    ids = torch.randint(4, 24, (2, 17))
    with torch.no_grad():
        exact = model.longformer(ids).last_hidden_state.double()
        half = model.to(torch.bfloat16)
        torch_products = half.longformer(ids).last_hidden_state
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dense, "computes_in_float32", lambda dtype, device: dtype in dense.HALF_TYPES)
            ours = half.longformer(ids).last_hidden_state
    errors = [float((h.double() - exact).norm() / exact.norm()) for h in (ours, torch_products)]
    # Two layers of bfloat16 weights and activations: a few roundings of 2^-8 each, both ways alike.
    assert max(errors) < 0.05 and errors[0] < 2 * errors[1] + 4 * unit_roundoff(torch.bfloat16), errors


@pytest.mark.parametrize(
    "name",
    [
        "LongformerModel",
        "LongformerForMaskedLM",
        "LongformerForSequenceClassification",
        "LongformerForTokenClassification",
        "LongformerForQuestionAnswering",
        "LongformerForMultipleChoice",
    ],
)
def test_transformers_models_patched_send_no_half_type_product_to_torch(float32_products, name):
    """transformers' models patched by ``hf.patch``: attention, FFN and output blocks run our layer,
    the rest of their linear layers (heads, pooler, the masked LM's vocabulary projection) dense.Linear:
    no half-type product reaches torch, training step and inference."""
    transformers = pytest.importorskip("transformers")
    from hf_helpers import hf_config

    from longformer_ops import hf

    torch.manual_seed(stable_seed(name))
    model = getattr(transformers, name)(hf_config([4, 8])).to(torch.bfloat16)
    hf.patch(model)
    ids = torch.randint(3, 97, (2, 21))
    is_global = torch.zeros_like(ids)
    is_global[:, 0] = 1
    if name == "LongformerForMultipleChoice":  # [batch, choices, n]
        ids, is_global = ids[None], is_global[None]
    with _HalfTypeProducts() as products:
        outputs = model.train()(ids, global_attention_mask=is_global).to_tuple()  # (the pooler's too)
        sum(out.float().square().sum() for out in outputs).backward()
        with torch.no_grad():
            model.eval()(ids, global_attention_mask=is_global)
    assert not products.seen, products.seen
    assert all(out.dtype == torch.bfloat16 and torch.isfinite(out).all() for out in outputs)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _led_config(transformers, **kwargs):
    return transformers.LEDConfig(
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
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        **kwargs,
    )


@pytest.mark.parametrize("name", ["LEDModel", "LEDForConditionalGeneration", "LEDForQuestionAnswering"])
def test_transformers_led_models_patched_send_no_half_type_product_to_torch(half_gemm, name):
    """LED patched by ``hf.patch``: besides the encoder's layers and the linear layers, the decoder's
    dense self- and cross-attention (``torch.bmm`` in transformers' own forward) runs its products in
    float32 where dense.py does: none in a half type reaches torch, training step, inference and a
    generation's steps of one row (there only the linear layers' few-row products without gradient,
    which are torch's by design). Where torch has its own half GEMM, they are torch's."""
    transformers = pytest.importorskip("transformers")
    from longformer_ops import hf

    torch.manual_seed(stable_seed(name))
    model = getattr(transformers, name)(_led_config(transformers)).to(torch.bfloat16)
    hf.patch(model)
    ids = torch.randint(3, 97, (2, 21))
    is_global = torch.zeros_like(ids)
    is_global[:, 0] = 1
    with _HalfTypeProducts() as products:
        outputs = [
            t for t in model.train()(ids, global_attention_mask=is_global).to_tuple() if isinstance(t, torch.Tensor)
        ]
        sum(out.float().square().sum() for out in outputs).backward()
        with torch.no_grad():
            model.eval()(ids, global_attention_mask=is_global)
            if name == "LEDForConditionalGeneration":
                generated = model.generate(
                    ids,
                    global_attention_mask=is_global,
                    max_new_tokens=4,
                    min_new_tokens=4,
                    do_sample=False,
                    num_beams=1,
                )
    if half_gemm == "float32_products":
        assert not products.seen, products.seen
    else:  # the decoder's attention (and the projections) left to torch
        assert any(op == "aten.bmm.default" for op, _ in products.seen), products.seen
    assert all(out.dtype == torch.bfloat16 and torch.isfinite(out).all() for out in outputs)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    if name == "LEDForConditionalGeneration":
        assert generated.shape[1] >= 5


def test_patched_led_in_bfloat16_errs_as_transformers_own(half_gemm):
    """LED in bfloat16, patched (encoder on our kernels, decoder attention and linear layers through the
    float32 path where dense.py takes it, else torch's): its logits err against float32 at most twice
    as much as transformers' own bfloat16 code (plus a few units roundoff)."""
    transformers = pytest.importorskip("transformers")
    from hf_helpers import randomize_

    from longformer_ops import hf

    config = _led_config(transformers, dropout=0.0, attention_dropout=0.0)
    model = randomize_(transformers.LEDForConditionalGeneration(config), 0).eval()
    generator = torch.Generator().manual_seed(11)
    inputs = dict(
        input_ids=torch.randint(3, 97, (2, 21), generator=generator),
        decoder_input_ids=torch.randint(3, 97, (2, 13), generator=generator),
    )
    inputs["global_attention_mask"] = torch.zeros_like(inputs["input_ids"])
    inputs["global_attention_mask"][:, 0] = 1
    with torch.no_grad():
        exact = model(**inputs).logits.double()
        half = model.to(torch.bfloat16)
        theirs = half(**inputs).logits.double()
        with _HalfTypeProducts() as products:
            ours = hf.patch(half)(**inputs).logits.double()
    assert not products.seen or half_gemm == "torch_half_gemm", products.seen
    error, their_error = ((x - exact).abs().max().item() for x in (ours, theirs))
    assert error <= 2 * their_error + 4 * unit_roundoff(torch.bfloat16) * exact.abs().max().item(), (error, their_error)
