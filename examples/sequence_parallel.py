"""Local attention over one long sequence split across processes (sequence parallelism):

    torchrun --nproc-per-node 2 examples/sequence_parallel.py [--seq-len 65536] [--window 256]
        [--dilation 1] [--heads 12] [--head-dim 64] [--causal] [--check]

Every rank draws the same random q, k, v (one seed), keeps its contiguous shard of the sequence
(rank r the r-th), and calls ``longformer_ops.distributed.sliding_window_attention`` forward and
backward: each rank exchanges only ``w * d`` border rows of K and V with its neighbours (and, in the
backward, their gradients). With ``--check`` every rank also computes the whole sequence in one
process and compares its shard of the result and of the gradients (float64, small sizes).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from longformer_ops import distributed, sliding_window_attention


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--window", type=int, default=256, help="w: keys on each side of a query")
    parser.add_argument("--dilation", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--check", action="store_true", help="compare with one process on the whole sequence (float64)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (one machine: loopback)
    dist.init_process_group("gloo")  # torchrun's environment: rank, world size, address
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    dtype = torch.float64 if args.check else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (
        torch.randn(1, args.seq_len, args.heads, args.head_dim, generator=g, dtype=dtype) for _ in range(4)
    )
    lengths = [args.seq_len // ranks + (r < args.seq_len % ranks) for r in range(ranks)]
    rows = slice(sum(lengths[:rank]), sum(lengths[: rank + 1]))
    shard = [x[:, rows].clone().requires_grad_() for x in (q, k, v)]

    started = time.perf_counter()
    out = distributed.sliding_window_attention(*shard, args.window, args.dilation, args.causal)
    out.backward(grad[:, rows])
    seconds = time.perf_counter() - started
    print(
        f"rank {rank}/{ranks}: rows {rows.start}..{rows.stop - 1} of {args.seq_len}, forward and backward "
        f"{seconds:.2f} s",
        flush=True,
    )

    if args.check:
        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        want = sliding_window_attention(*whole, args.window, args.dilation, args.causal)
        want.backward(grad)
        errors = [
            float((got - ref[:, rows]).abs().max())
            for got, ref in [
                (out.detach(), want.detach()),
                *((x.grad, y.grad) for x, y in zip(shard, whole, strict=True)),
            ]
        ]
        ok = max(errors) < 1e-10
        print(
            f"rank {rank}: {'matches' if ok else 'DIFFERS FROM'} one process on the whole sequence "
            f"(largest difference of result, dq, dk, dv: {max(errors):.1e})",
            flush=True,
        )
        if not ok:
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
