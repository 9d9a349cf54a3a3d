"""Bad input gets a clear Python exception, from our own checks, naming the argument."""

from __future__ import annotations

import pytest
import torch

from longformer_ops import diagonaled_mm, mask_invalid_locations, sliding_window_attention
from longformer_ops.ops.diagonaled import transposed_product


def qk_inputs(b=1, n=8, h=2, f=4, dtype=torch.float32):
    return torch.randn(b, n, h, f, dtype=dtype), torch.randn(b, n, h, f, dtype=dtype)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda q, k: diagonaled_mm(q.int(), k.int(), 1, 1), TypeError, r"t1 must be one of .*got dtype=torch.int32"),
        (
            lambda q, k: diagonaled_mm(q, k.double(), 1, 1),
            TypeError,
            r"same dtype.*t1.dtype=torch.float32, t2.dtype=torch.float64",
        ),
        (
            lambda q, k: diagonaled_mm(q[0], k, 1, 1),
            ValueError,
            r"t1 must be 4-D \[batch, seq_len, heads, features\], got shape \(8, 2, 4\)",
        ),
        (lambda q, k: diagonaled_mm(q, k[:, :5], 1, 1), ValueError, r"agree in \[batch, seq_len, heads\]"),
        (
            lambda q, k: diagonaled_mm(q, torch.randn(2, 8, 2, 4), 1, 1),
            ValueError,
            r"agree in \[batch, seq_len, heads\]",
        ),
        (
            lambda q, k: diagonaled_mm(q, torch.randn(1, 8, 3, 4), 1, 1),
            ValueError,
            r"agree in \[batch, seq_len, heads\]",
        ),
        (lambda q, k: diagonaled_mm(q, k[..., :3], 1, 1), ValueError, r"same head_dim"),
        (
            lambda q, k: diagonaled_mm(q, k, 1, torch.tensor([1, 2, 3])),
            ValueError,
            r"d \(dilation\) must have one value per head: expected length 2, got 3",
        ),
        (lambda q, k: diagonaled_mm(q, k, 1, 0), ValueError, r"d \(dilation\) values must be in \[1, .*got \[0, 0\]"),
        (lambda q, k: diagonaled_mm(q, k, 1, torch.tensor([1, -2])), ValueError, r"d \(dilation\) values must be in"),
        (
            lambda q, k: diagonaled_mm(q, k, 1, torch.tensor([1.0, 2.0])),
            TypeError,
            r"d \(dilation\) must be an integer tensor",
        ),
        (
            lambda q, k: diagonaled_mm(q, k, 1, torch.ones(2, 1, dtype=torch.int64)),
            ValueError,
            r"1-D tensor with one value per head",
        ),
        (lambda q, k: diagonaled_mm(q, k, 1, 1.5), TypeError, r"d \(dilation\) must be an int"),
        (lambda q, k: diagonaled_mm(q, k, -1, 1), ValueError, r"w \(one-sided window\) must be >= 0, got w=-1"),
        (lambda q, k: diagonaled_mm(q, k, 2.0, 1), TypeError, r"w \(one-sided window\) must be an int"),
        (lambda q, k: diagonaled_mm(q, k, True, 1), TypeError, r"w \(one-sided window\) must be an int"),
        (
            lambda q, k: diagonaled_mm(torch.randn(1, 8, 2, 4), k, 1, 1, True),
            ValueError,
            r"t1 \(the band\) must have last dimension c = 3 for w=1, autoregressive=False",
        ),
        (
            lambda q, k: diagonaled_mm(torch.randn(1, 8, 2, 3), k, 1, 1, True, 0, True),
            ValueError,
            r"c = 2 for w=1, autoregressive=True",
        ),
        (lambda q, k: diagonaled_mm(q.numpy(), k, 1, 1), TypeError, r"t1 must be a torch.Tensor, got ndarray"),
        (lambda q, k: diagonaled_mm(q, [1, 2], 1, 1), TypeError, r"t2 must be a torch.Tensor, got list"),
        (lambda q, k: diagonaled_mm(q, k, 1, 1, padding="x"), TypeError, r"padding must be a real number"),
        (lambda q, k: diagonaled_mm(q, k, 1, 1, is_t1_diagonaled=1), TypeError, r"is_t1_diagonaled must be a bool"),
        (lambda q, k: diagonaled_mm(q, k, 1, 1, autoregressive="yes"), TypeError, r"autoregressive must be a bool"),
        (
            lambda q, k: diagonaled_mm(q.to("meta"), k.to("meta"), 1, 1),
            NotImplementedError,
            r"t1 is on device meta; supported devices: cpu, cuda",
        ),
        (lambda q, k: diagonaled_mm(q, k.to("meta"), 1, 1), NotImplementedError, r"t2 is on device meta"),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else None,
)
def test_diagonaled_mm_rejects(call, error, message):
    q, k = qk_inputs()
    with pytest.raises(error, match=message):
        call(q, k)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda q, k: diagonaled_mm(q, k, 1, 1, out=[0.0]), TypeError, r"out must be a torch.Tensor or None, got list"),
        (
            lambda q, k: diagonaled_mm(q, k, 1, 1, out=torch.empty(1, 8, 2, 4)),
            ValueError,
            r"out must have the result's shape \(1, 8, 2, 3\), got \(1, 8, 2, 4\)",
        ),
        (
            lambda q, k: diagonaled_mm(q, k, 1, 1, out=torch.empty(1, 8, 2, 3, dtype=torch.float64)),
            TypeError,
            r"out must have the inputs' dtype torch.float32, got dtype=torch.float64",
        ),
        (
            lambda q, k: diagonaled_mm(q, k, 1, 1, out=torch.empty(1, 8, 3, 2).transpose(2, 3)),
            ValueError,
            r"out must be contiguous",
        ),
        (
            lambda q, k: diagonaled_mm(torch.randn(1, 8, 2, 3), k, 1, 1, True, out=k),
            ValueError,
            r"out must not share memory with t1 or t2",
        ),
        (
            lambda q, k: diagonaled_mm(q.requires_grad_(), k, 1, 1, out=torch.empty(1, 8, 2, 3)),
            RuntimeError,
            r"out= is not differentiable: call under torch.no_grad\(\)",
        ),
        (
            lambda q, k: diagonaled_mm(q, k, 1, 1, out=torch.empty(1, 8, 2, 3, requires_grad=True)),
            RuntimeError,
            r"out= is not differentiable",
        ),
        (
            lambda q, k: transposed_product(torch.randn(1, 8, 2, 3), k, 1, 1, out=torch.empty(1, 8, 2, 3)),
            ValueError,
            r"out must have the result's shape \(1, 8, 2, 4\)",
        ),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else None,
)
def test_out_rejects(call, error, message):
    q, k = qk_inputs()
    with pytest.raises(error, match=message):
        call(q, k)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda q, k, v: sliding_window_attention(q, k[:, :5], v, 1),
            ValueError,
            r"k must have q's shape \(1, 8, 2, 4\) \[batch, seq_len, heads, head_dim\], or fewer heads dividing q's 2 "
            r"\(grouped key/value heads\), got k.shape=\(1, 5, 2, 4\)",
        ),
        (lambda q, k, v: sliding_window_attention(q, k, v[..., :3], 1), ValueError, r"v must have q's shape"),
        (
            lambda q, k, v: sliding_window_attention(q, k, v.double(), 1),
            TypeError,
            r"v must have q's dtype torch.float32, got v.dtype=torch.float64",
        ),
        (lambda q, k, v: sliding_window_attention(q, k.to("meta"), v, 1), NotImplementedError, r"k is on device meta"),
        (lambda q, k, v: sliding_window_attention(q.int(), k, v, 1), TypeError, r"q must be one of"),
        (lambda q, k, v: sliding_window_attention(q[0], k, v, 1), ValueError, r"q must be 4-D"),
        (lambda q, k, v: sliding_window_attention(q, k, v, -2), ValueError, r"w \(one-sided window\) must be >= 0"),
        (lambda q, k, v: sliding_window_attention(q, k, v, 1, [1, 0]), ValueError, r"d \(dilation\) values must be in"),
        (
            lambda q, k, v: sliding_window_attention(q, k, v, 1, autoregressive=None),
            TypeError,
            r"autoregressive must be a bool",
        ),
        (
            lambda q, k, v: sliding_window_attention(q, k, v, 1, scale="big"),
            TypeError,
            r"scale must be a finite real number or None \(1/sqrt\(head_dim\)\), got 'big'",
        ),
        (
            lambda q, k, v: sliding_window_attention(q, k, v, 1, scale=float("nan")),
            TypeError,
            r"scale must be a finite",
        ),
        (
            lambda q, k, v: sliding_window_attention(q, k, v, 1, key_padding_mask=torch.zeros(1, 8)),
            TypeError,
            r"key_padding_mask must be a bool tensor \[batch, seq_len\] \(True: a key no query attends to\), got torch.float32",
        ),
        (
            lambda q, k, v: sliding_window_attention(q, k, v, 1, key_padding_mask=torch.zeros(1, 7, dtype=torch.bool)),
            ValueError,
            r"key_padding_mask must be \[batch, seq_len\] = \(1, 8\), got shape \(1, 7\)",
        ),
        (
            lambda q, k, v: sliding_window_attention(
                q, k, v, 1, key_padding_mask=torch.zeros(1, 8, dtype=torch.bool, device="meta")
            ),
            ValueError,
            r"key_padding_mask must be on q's device cpu, got meta",
        ),
        (
            lambda q, k, v: sliding_window_attention(q, k, v, 1, out=torch.empty(1, 8, 2, 3)),
            ValueError,
            r"out must have the result's shape \(1, 8, 2, 4\)",
        ),
        (
            lambda q, k, v: sliding_window_attention(q, k, v, 1, out=v),
            ValueError,
            r"out must not share memory with q or k or v",
        ),
        (
            lambda q, k, v: sliding_window_attention(q.requires_grad_(), k, v, 1, out=torch.empty(1, 8, 2, 4)),
            RuntimeError,
            r"out= is not differentiable",
        ),
        (
            lambda q, k, v: sliding_window_attention(q, k, v, 1, return_lse=1),
            TypeError,
            r"return_lse must be a bool, got int",
        ),
        (
            lambda q, k, v: sliding_window_attention(
                q, k, v, 1, autoregressive=pytest.importorskip("numpy").bool_(True)
            ),
            TypeError,
            r"autoregressive must be a bool, got numpy.bool",
        ),
        (
            lambda q, k, v: sliding_window_attention(q, k, v, 1, dropout_p=1.5),
            ValueError,
            r"dropout_p must be a probability in \[0, 1\], got 1.5",
        ),
        (
            lambda q, k, v: sliding_window_attention(q, k, v, 1, dropout_p=True),
            ValueError,
            r"dropout_p must be a probability",
        ),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else None,
)
def test_sliding_window_attention_rejects(call, error, message):
    q, k = qk_inputs()
    with pytest.raises(error, match=message):
        call(q, k, torch.randn(1, 8, 2, 4))


def test_unsupported_dtype_for_device_is_named():
    # float64 ships on CPU only; on CUDA the loader says which (device, dtype) pairs exist.
    from longformer_ops.runtime import loader as _loader

    with pytest.raises(
        _loader.KernelNotAvailableError, match=r"no prebuilt kernel for device='cuda', dtype=float64; available"
    ):
        _loader.choose_library(_loader._manifest_or_raise(_loader.prebuilt_dir()), "cuda", "float64")


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda s: mask_invalid_locations(s, 1, 1, False),
            ValueError,
            r"scores must have last dimension c = 3 for w=1",
        ),
        (lambda s: mask_invalid_locations(s.long(), 2, 1, False), TypeError, r"scores must be a floating-point tensor"),
        (lambda s: mask_invalid_locations(s[0], 2, 1, False), ValueError, r"scores must be 4-D"),
        (
            lambda s: mask_invalid_locations(s, 2, [1, 2, 3], False),
            ValueError,
            r"one value per head: expected length 2, got 3",
        ),
        (lambda s: mask_invalid_locations(s, -2, 1, False), ValueError, r"w \(one-sided window\) must be >= 0"),
        (lambda s: mask_invalid_locations(s.tolist(), 2, 1, False), TypeError, r"scores must be a torch.Tensor"),
        (
            lambda s: mask_invalid_locations(s[:, :1].expand(1, 8, 2, 5), 2, 1, False),
            ValueError,
            r"scores must not have elements sharing memory \(it is written in place\), got shape \(1, 8, 2, 5\) "
            r"with strides \(80, 0, 5, 1\): pass scores.contiguous\(\)",
        ),
    ],
)
def test_mask_invalid_locations_rejects(call, error, message):
    scores = torch.randn(1, 8, 2, 5)
    with pytest.raises(error, match=message):
        call(scores)


def test_cuda_grid_limit_is_named():
    # The CUDA kernels take a grid row per (batch, head), at most 65535: past it a clear error, not a
    # failed launch. Fake CUDA tensors: the checks run before any kernel, so no GPU is needed.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fits = torch.empty(65535, 3, 1, 16, device="cuda")
        past = torch.empty(32768, 3, 2, 16, device="cuda")
        diagonaled_mm(fits, fits, 1, 1)  # at the limit: accepted
        with pytest.raises(
            ValueError,
            match=r"t1 has batch \* heads = 32768 \* 2 = 65536; on CUDA the kernels take at most "
            r"65535 \(a grid row each\): split the batch",
        ):
            diagonaled_mm(past, past, 1, 1)
        with pytest.raises(ValueError, match=r"q has batch \* heads = 32768 \* 2 = 65536"):
            sliding_window_attention(past, past, past, 1)
