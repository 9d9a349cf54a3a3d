"""Run every CUDA kernel (each band product and the fused attention forward and backward; each dtype,
symmetric/causal, mixed dilation; the fused ones also soft-capped with one key/value head) once at an
awkward size.

Meant to run under NVIDIA's compute-sanitizer on a GPU machine (`make gpu-check`):

    compute-sanitizer --tool memcheck  python tools/sanitize_cuda_kernels.py
    compute-sanitizer --tool racecheck python tools/sanitize_cuda_kernels.py

Exits non-zero if a result differs from the float64 reference.
"""

from __future__ import annotations

import sys

import torch

from longformer_ops import diagonaled_mm, sliding_window_attention
from longformer_ops.ops.reference import diagonaled_mm_reference, sliding_window_attention_reference


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    failures = 0
    b, n, h, f, w = 2, 67, 3, 33, 5  # awkward: odd length, head_dim not a multiple of anything
    d = [1, 3, 7]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for autoregressive in (False, True):
            c = w + (0 if autoregressive else w) + 1
            q = torch.randn(b, n, h, f, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(b, n, h, f, device="cuda", dtype=dtype, requires_grad=True)
            p = torch.randn(b, n, h, c, device="cuda", dtype=dtype, requires_grad=True)
            s = diagonaled_mm(q, k, w, d, False, 0, autoregressive)
            o = diagonaled_mm(p, k, w, d, True, 0, autoregressive)
            (s.float().sum() + o.float().sum()).backward()  # runs the transposed mode too
            torch.cuda.synchronize()
            ref_s = diagonaled_mm_reference(q.double(), k.double(), w, d, False, 0, autoregressive)
            ref_o = diagonaled_mm_reference(p.double(), k.double(), w, d, True, 0, autoregressive)
            v = torch.randn(b, n, h, f, device="cuda", dtype=dtype)
            mask = torch.rand(b, n, device="cuda") < 0.2  # key padding: the fused kernel's key bias
            with torch.no_grad():  # inference: the fused forward
                a = sliding_window_attention(q, k, v, w, d, autoregressive, 0.5, key_padding_mask=mask)
            ref_a = sliding_window_attention_reference(
                q.double(), k.double(), v.double(), w, d, autoregressive, 0.5, mask
            )
            # Training: the fused backward (its two kernels), through the result.
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            grad = torch.randn(b, n, h, f, device="cuda", dtype=dtype)
            grads = torch.autograd.grad(
                sliding_window_attention(*inputs, w, d, autoregressive, 0.5, key_padding_mask=mask), inputs, grad
            )
            exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
            ref_grads = torch.autograd.grad(
                sliding_window_attention_reference(*exact, w, d, autoregressive, 0.5, mask), exact, grad.double()
            )
            # Soft-capped, with one key/value head for the three query heads (grouped heads read in place).
            capped = [q.detach().requires_grad_(), *(x[:, :, :1].detach().requires_grad_() for x in (k, v))]
            capped_out = sliding_window_attention(
                *capped, w, d, autoregressive, 0.5, key_padding_mask=mask, softcap=1.5
            )
            capped_grads = torch.autograd.grad(capped_out, capped, grad)
            exact = [x.detach().double().requires_grad_() for x in capped]
            ref_capped = sliding_window_attention_reference(
                exact[0], *(x.expand(-1, -1, h, -1) for x in exact[1:]), w, d, autoregressive, 0.5, mask, softcap=1.5
            )
            ref_capped_grads = torch.autograd.grad(ref_capped, exact, grad.double())
            torch.cuda.synchronize()
            tol = 1e-3 if dtype == torch.float32 else 0.1
            checks = [("qk", s, ref_s), ("pv", o, ref_o), ("attention", a, ref_a), ("capped", capped_out, ref_capped)]
            checks += [
                (f"d{name} (attention)", got, ref) for name, got, ref in zip("qkv", grads, ref_grads, strict=True)
            ]
            checks += [
                (f"d{name} (capped)", got, ref)
                for name, got, ref in zip("qkv", capped_grads, ref_capped_grads, strict=True)
            ]
            for name, got, ref in checks:
                error = (got.double() - ref).abs().max().item()
                ok = error <= tol * (1 + ref.abs().max().item())
                failures += not ok
                print(
                    f"{name:15s} {str(dtype):15s} autoregressive={autoregressive!s:5s} max error {error:.2e} {'ok' if ok else 'FAIL'}"
                )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
