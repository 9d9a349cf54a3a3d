"""A Longformer classifier trained on one long document split across processes (sequence parallelism):

    torchrun --nproc-per-node 2 examples/sequence_parallel_model.py [--seq-len 16384] [--steps 3]
        [--layers 12] [--hidden 768] [--heads 12] [--window 256] [--check]

Every rank builds the same model (one seed), wraps it with
``longformer_ops.distributed.sequence_parallel`` and feeds it its own contiguous slice of the
document (rank r the r-th): input ids, attention mask and global attention mask (the document's
first token is global, the classifier's default). The logits and the loss come out the same on every
rank; each rank backpropagates ``loss / ranks``, the ranks' gradients are summed (an all_reduce), and
every rank takes the same optimizer step, so the replicas stay identical. With ``--check`` (tiny
sizes, float64) rank 0 also runs the whole document in one process and compares the loss and the
summed gradients.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from longformer_ops import LongformerConfig, LongformerForSequenceClassification, distributed


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--window", type=int, default=256, help="w: keys on each side of a token")
    parser.add_argument(
        "--check", action="store_true", help="compare with one process on the whole document (float64; use tiny sizes)"
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (one machine: loopback)
    dist.init_process_group("gloo")  # torchrun's environment: rank, world size, address
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))

    torch.manual_seed(0)  # the same model and document on every rank
    config = LongformerConfig(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_hidden_layers=args.layers,
        intermediate_size=4 * args.hidden,
        attention_window=args.window,
        max_position_embeddings=args.seq_len + 2,
        num_labels=2,
        hidden_dropout_prob=0.0 if args.check else 0.1,
        attention_probs_dropout_prob=0.0 if args.check else 0.1,
    )
    model = LongformerForSequenceClassification(config).to(torch.float64 if args.check else torch.float32)
    ids = torch.randint(3, config.vocab_size, (1, args.seq_len))
    label = torch.tensor([1])
    reference = None
    if args.check and rank == 0:
        reference = LongformerForSequenceClassification(config).double()
        reference.load_state_dict(model.state_dict())

    distributed.sequence_parallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    lengths = [args.seq_len // ranks + (r < args.seq_len % ranks) for r in range(ranks)]
    rows = slice(sum(lengths[:rank]), sum(lengths[: rank + 1]))
    for step in range(args.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        out = model(ids[:, rows], labels=label)  # the <s> token (rank 0's first) is global by default
        (out.loss / ranks).backward()
        for parameter in model.parameters():  # each rank holds its share: the sum is the gradient
            dist.all_reduce(parameter.grad)
        if args.check and step == 0:
            check(model, reference, ids, label, out.loss, rank)
        optimizer.step()
        print(
            f"rank {rank}/{ranks}: step {step}, rows {rows.start}..{rows.stop - 1} of {args.seq_len}, loss "
            f"{out.loss.item():.4f}, {time.perf_counter() - started:.2f} s",
            flush=True,
        )
    dist.destroy_process_group()


def check(model, reference, ids, label, loss, rank: int) -> None:
    """Rank 0: the loss and the summed gradients against one process on the whole document."""
    if rank != 0:
        return
    want = reference(ids, labels=label)
    want.loss.backward()
    errors = [abs(float(loss.detach() - want.loss.detach()))] + [
        float((got.grad - ref.grad).abs().max())
        for got, ref in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    ok = max(errors) < 1e-10
    print(
        f"rank 0: loss and gradients {'match' if ok else 'DIFFER FROM'} one process on the whole document "
        f"(largest difference {max(errors):.1e})",
        flush=True,
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
