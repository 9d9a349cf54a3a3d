"""The CPU output cache: recycled memory never shows in a result, memory in use is never handed
out twice, the bytes parked stay within the limit, and a bad limit is a clear error."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from conftest import CPU_DTYPES
from test_diagonaled_mm import SIZES, _random

from longformer_ops import diagonaled_mm, empty_cache, sliding_window_attention
from longformer_ops.nn import dense
from longformer_ops.ops.diagonaled import transposed_product
from longformer_ops.ops.reference import diagonaled_mm_reference
from longformer_ops.runtime import output_cache as _output_cache

MIB = 2**20


@pytest.fixture
def every_output_cached(monkeypatch):
    """Every CPU kernel output (and scratch output) through the cache, which starts empty."""
    monkeypatch.setattr(_output_cache, "MIN_BYTES", 0)
    monkeypatch.delenv(_output_cache.CACHE_LIMIT_ENV, raising=False)
    empty_cache()
    yield
    empty_cache()


def _outputs(op: str, size, dtype) -> list[torch.Tensor]:
    """One call of ``op`` on inputs fixed by its arguments; what it returns (gradients for the backward)."""
    b, n, h, f, w = size
    generator = torch.Generator().manual_seed(n * 131 + f * 7 + w)
    d = torch.randint(1, 9, (h,), generator=generator)
    if op in ("qk", "pv", "transposed"):
        t1 = _random((b, n, h, f if op == "qk" else 2 * w + 1), dtype, "cpu", generator)
        t2 = _random((b, n, h, f), dtype, "cpu", generator)
        if op == "transposed":
            return [transposed_product(t1, t2, w, d)]
        return [diagonaled_mm(t1, t2, w, d, op == "pv", -2.0)]
    q, k, v = (
        _random((b, n, h, f), dtype, "cpu", generator).requires_grad_(op == "attention_backward") for _ in range(3)
    )
    out, lse = sliding_window_attention(q, k, v, w, d, return_lse=True)
    if op == "attention":
        return [out, lse]
    grad = _random(out.shape, dtype, "cpu", generator)
    return list(torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("op", ["qk", "pv", "transposed", "attention", "attention_backward"])
@pytest.mark.parametrize("size", [s for s in SIZES if s[1] > 1], ids=str)
def test_recycled_outputs_hold_a_fresh_calls_result(cpu_library, every_output_cached, monkeypatch, size, op, dtype):
    """A call on recycled memory returns, bit for bit, what the first call returned on fresh (zeroed)
    memory, though every parked byte was first set to NaN: each kernel writes every element."""
    expected = [x.detach().clone() for x in _outputs(op, size, dtype)]
    parked = list(_output_cache._parked)
    assert parked, "the first call's outputs were not parked when freed"
    for mapping in parked:
        mapping[:] = b"\xff" * len(mapping)  # NaN in every float dtype
    taken = []
    take = _output_cache._take
    monkeypatch.setattr(_output_cache, "_take", lambda nbytes: taken.append(take(nbytes)) or taken[-1])
    got = _outputs(op, size, dtype)
    assert any(m is p for m in taken for p in parked), "the second call took nothing from the cache"
    for x, y in zip(got, expected, strict=True):
        assert torch.equal(x, y)


def _dense_outputs(op: str, dtype) -> list[torch.Tensor]:
    """dense.py's half-type products in float32 (their temporaries from the cache): a linear layer's
    output and gradients, or ``mm_into`` with a bias."""
    generator = torch.Generator().manual_seed(11)
    x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in ((2, 37, 24), (19, 24), (19,)))
    if op == "mm_into":
        out = torch.empty(37, 19, dtype=dtype)
        return [dense.mm_into(x[0], weight.t(), out, bias)]
    x, weight, bias = (t.requires_grad_() for t in (x, weight, bias))
    y = dense.linear(x, weight, bias)
    return [y.detach(), *torch.autograd.grad(y, (x, weight, bias), torch.randn(y.shape, generator=generator).to(dtype))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["linear", "mm_into"])
def test_dense_temporaries_on_recycled_memory_change_no_result(every_output_cached, monkeypatch, op, dtype):
    """Where the half types' products run in float32, their widened operands, products and rounded
    results come from the cache: on memory first set to NaN, the same results bit for bit."""
    monkeypatch.setattr(dense, "computes_in_float32", lambda dtype, device: dtype in dense.HALF_TYPES)
    expected = [x.clone() for x in _dense_outputs(op, dtype)]
    parked = list(_output_cache._parked)
    assert len(parked) >= 3, "the float32 temporaries were not parked when freed"
    for mapping in parked:
        mapping[:] = b"\xff" * len(mapping)
    taken = []
    take = _output_cache._take
    monkeypatch.setattr(_output_cache, "_take", lambda nbytes: taken.append(take(nbytes)) or taken[-1])
    got = _dense_outputs(op, dtype)
    assert sum(any(m is p for p in parked) for m in taken) >= 3, "the second call took little from the cache"
    for x, y in zip(got, expected, strict=True):
        assert x.dtype == dtype and torch.equal(x, y)


def test_memory_in_use_is_never_handed_out_again(every_output_cached):
    like = torch.empty(0)
    first = _output_cache.new_output(like, (256, 1024))
    address = first.data_ptr()
    second = _output_cache.new_output(like, (256, 1024))
    assert second.data_ptr() != address
    row = first[3]  # a view keeps the memory in use after the tensor it came from is gone
    del first
    third = _output_cache.new_output(like, (256, 1024))
    assert third.data_ptr() != address
    del row
    assert _output_cache.new_output(like, (256, 1024)).data_ptr() == address  # now free: recycled
    assert _output_cache.new_output(like, (128, 1024)).data_ptr() != address  # another size: a new mapping


def test_empty_outputs_need_no_mapping(every_output_cached):
    q = torch.randn(0, 5, 2, 4)
    assert diagonaled_mm(q, q, 1, 1).shape == (0, 5, 2, 3)


def test_outputs_freed_on_another_thread_are_parked(every_output_cached):
    holder = [_output_cache.new_output(torch.empty(0), (4, MIB // 4))]
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()
    assert [len(m) for m in _output_cache._parked] == [MIB * 4]


def test_parked_bytes_stay_within_the_limit(every_output_cached, monkeypatch):
    like = torch.empty(0, dtype=torch.uint8)
    monkeypatch.setenv(_output_cache.CACHE_LIMIT_ENV, "0")
    freed = _output_cache.new_output(like, (MIB,))
    del freed
    assert _output_cache._parked == []
    monkeypatch.setenv(_output_cache.CACHE_LIMIT_ENV, "2.5")
    outputs = [_output_cache.new_output(like, (MIB,)) for _ in range(3)]
    addresses = [x.data_ptr() for x in outputs]
    for index in range(3):  # freed in order: the first parked is the first released
        outputs[index] = None
    assert len(_output_cache._parked) == 2
    assert _output_cache.new_output(like, (MIB,)).data_ptr() in addresses[1:]
    assert empty_cache() == 2 * MIB and _output_cache._parked == []


def test_large_outputs_use_the_cache_by_default(monkeypatch):
    monkeypatch.delenv(_output_cache.CACHE_LIMIT_ENV, raising=False)
    empty_cache()
    q = torch.randn(1, 700, 2, 64)
    scores = diagonaled_mm(q, q, 200, 1)  # 700 x 2 x 401 float32: 2.1 MiB
    address = scores.data_ptr()
    small = diagonaled_mm(q[:, :20], q[:, :20], 2, 1)  # 800 bytes: torch's allocator
    del scores, small
    assert [len(m) for m in _output_cache._parked] == [700 * 2 * 401 * 4]
    assert diagonaled_mm(q, q, 200, 1).data_ptr() == address
    empty_cache()


@pytest.mark.parametrize("value", ["lots", "-1", "nan", "inf"])
def test_a_bad_limit_is_a_clear_error(every_output_cached, monkeypatch, value):
    monkeypatch.setenv(_output_cache.CACHE_LIMIT_ENV, value)
    q = torch.randn(1, 9, 2, 4)
    with pytest.raises(
        ValueError, match=rf"LONGFORMER_OPS_OUTPUT_CACHE_MIB must be a number of MiB >= 0 .*got '{value}'"
    ):
        diagonaled_mm(q, q, 2, 1)


def _smaps_flags(address: int) -> list[str]:
    lines = open("/proc/self/smaps").read().splitlines()
    for index, line in enumerate(lines):
        span = line.split()[0]
        if "-" in span and all(c in "0123456789abcdef-" for c in span):
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return next(e for e in lines[index + 1 :] if e.startswith("VmFlags:")).split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_write_into_the_parents_outputs(every_output_cached):
    """Private mappings, as malloc's memory: Python's default anonymous mmap is shared across fork."""
    out = _output_cache.new_output(torch.empty(0), (MIB // 4,))
    out[0] = 1.0
    assert "sh" not in _smaps_flags(out.data_ptr())
    child = os.fork()
    if child == 0:  # one element, no torch thread pool: safe in a forked child
        out[0] = 5.0
        os._exit(0)
    os.waitpid(child, 0)
    assert out[0].item() == 1.0


def test_cached_outputs_are_tensors_of_their_own(every_output_cached):
    """Not views: autograd allows in-place changes to a custom Function's output only then."""
    q = torch.randn(1, 9, 2, 4, requires_grad=True)
    scores = diagonaled_mm(q, q, 2, 1)
    assert scores._base is None and scores.is_contiguous()
    scores.masked_fill_(scores > 0, 0.0).sum().backward()
    exact = q.detach().double().requires_grad_()
    ref = diagonaled_mm_reference(exact, exact, 2, 1)
    ref.masked_fill(ref > 0, 0.0).sum().backward()
    torch.testing.assert_close(q.grad.double(), exact.grad, rtol=1e-5, atol=1e-5)
