"""Fine-tune a small Longformer classifier on long documents whose label sits far from ``<s>``.

    python -m examples.long_document_classification                  # ~5 min on 2 cores (needs tqdm, matplotlib:
                                                                     # the bench extra, which `make setup` installs)
    python -m examples.long_document_classification --steps 20 --seq-len 512 --out /tmp/quick

The task (synthetic, so that anyone can rerun it): a document of ``--seq-len`` random filler tokens
holds, at random places in its second half, ``--markers`` copies of a marker token of one of
``--classes`` kinds; the label is the marker's kind. The classifier reads ``<s>`` (position 0), and the marker is thousands of
positions away from it: with a sliding window alone, ``<s>`` sees ``layers x window`` tokens and
can only guess (accuracy 1 / classes); with global attention on ``<s>`` (the classifier's default,
as in transformers) it attends to the whole document and finds the marker.

Trains both variants from scratch with the same data and seed (``LongformerForSequenceClassification``
on the prebuilt kernels, AdamW), evaluates on held-out documents every ``--eval-every`` steps, and
writes ``<out>/long_document_classification.{png,md}``: the loss and accuracy curves of both, and
the final held-out accuracies with the command.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.machine import cpu_results_name, source_commit
from longformer_ops import LongformerConfig, LongformerForSequenceClassification

BOS, PAD, SEP = 0, 1, 2
FIRST_FILLER = 3  # filler tokens are FIRST_FILLER..; the markers are the last `classes` ids
NAME = "long_document_classification"
VARIANTS = {"global": "global attention on <s>", "local": "sliding window only"}


def make_documents(count: int, seq_len: int, classes: int, vocab: int, generator: torch.Generator, markers: int = 1):
    """``count`` documents ``[count, seq_len]`` (``<s>`` filler... markers ...filler ``</s>``) and
    their labels: ``markers`` copies of marker ``label`` at distinct places in the second half."""
    labels = torch.randint(0, classes, (count,), generator=generator)
    ids = torch.randint(FIRST_FILLER, vocab - classes, (count, seq_len), generator=generator)
    ids[:, 0], ids[:, -1] = BOS, SEP
    second_half = seq_len - 1 - seq_len // 2  # positions seq_len // 2 .. seq_len - 2
    for row in range(count):
        where = seq_len // 2 + torch.randperm(second_half, generator=generator)[:markers]
        ids[row, where] = vocab - classes + labels[row]
    return ids, labels


def build_model(args) -> LongformerForSequenceClassification:
    config = LongformerConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.seq_len + PAD + 1,
        attention_window=args.window,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=args.classes,
    )
    return LongformerForSequenceClassification(config)


def global_mask_for(variant: str, ids: torch.Tensor) -> torch.Tensor | None:
    """None: the classifier's default (``<s>`` global); zeros: no global token at all."""
    return None if variant == "global" else torch.zeros_like(ids)


@torch.no_grad()
def accuracy(model, variant: str, ids: torch.Tensor, labels: torch.Tensor, batch_size: int) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(ids), batch_size):
        chunk = ids[start : start + batch_size]
        logits = model(chunk, global_attention_mask=global_mask_for(variant, chunk)).logits
        correct += int((logits.argmax(-1) == labels[start : start + batch_size]).sum())
    model.train()
    return correct / len(ids)


def train(variant: str, args, held_out) -> dict:
    """One run; returns its curves: steps, training loss per step, held-out accuracy per evaluation."""
    torch.manual_seed(args.seed)
    model = build_model(args).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # Linear warm-up, then linear decay to 0 (transformers' default schedule for fine-tuning).
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / args.warmup, (args.steps - step) / (args.steps - args.warmup))
    )
    data = torch.Generator().manual_seed(args.seed + 1)  # the same training documents for both variants
    curves = {"loss": [], "eval_steps": [], "accuracy": []}
    started = time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc=f"{variant:>6}", unit="step", file=sys.stderr)
    for step in bar:
        ids, labels = make_documents(args.batch_size, args.seq_len, args.classes, args.vocab, data, args.markers)
        loss = model(ids, global_attention_mask=global_mask_for(variant, ids), labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        curves["loss"].append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            curves["eval_steps"].append(step)
            curves["accuracy"].append(accuracy(model, variant, *held_out, args.batch_size))
        bar.set_postfix(
            loss=f"{loss.item():.3f}", held_out_acc=f"{curves['accuracy'][-1]:.2f}" if curves["accuracy"] else "-"
        )
    curves["seconds"] = time.perf_counter() - started
    return curves


def smoothed(values: list[float], span: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= span:
            total -= values[i - span]
        out.append(total / min(i + 1, span))
    return out


def write_results(runs: dict, args, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, curves in runs.items():
        steps = range(1, len(curves["loss"]) + 1)
        left.plot(steps, smoothed(curves["loss"], 10), label=VARIANTS[variant])
        right.plot(curves["eval_steps"], curves["accuracy"], marker="o", markersize=3, label=VARIANTS[variant])
    right.axhline(1 / args.classes, color="grey", linestyle=":", label="chance")
    left.set(xlabel="step", ylabel="training loss (mean of 10 steps)", title="loss")
    right.set(xlabel="step", ylabel="held-out accuracy", title=f"{args.held_out} held-out documents", ylim=(0, 1.02))
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(
        f"Label = the marker token ({args.markers} copies) in the second half of {args.seq_len}-token documents; "
        f"{args.layers} layers x one-sided window {args.window}"
    )
    figure.tight_layout()
    figure.savefig(out / f"{NAME}.png", dpi=110)
    plt.close(figure)

    command = "python -m examples.long_document_classification " + " ".join(sys.argv[1:])
    lines = [
        f"# Long-document classification, trained from scratch ({cpu_results_name()}, "
        f"{torch.get_num_threads()} threads)",
        "",
        f"Command: `{command.strip()}` (commit {source_commit()}, torch {torch.__version__})",
        "",
        f"Documents of {args.seq_len} tokens, {args.markers} copies of one of {args.classes} marker tokens in "
        f"the second half, label = the marker; `LongformerForSequenceClassification`, {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads, one-sided window {args.window} (`<s>` sees {args.layers * args.window} tokens "
        f"to each side without global attention); batch {args.batch_size}, {args.steps} steps, AdamW lr {args.lr}.",
        "",
        "| variant | final held-out accuracy | best | training time |",
        "|---|---:|---:|---:|",
    ]
    for variant, curves in runs.items():
        lines.append(
            f"| {VARIANTS[variant]} | {curves['accuracy'][-1]:.3f} | {max(curves['accuracy']):.3f} | "
            f"{curves['seconds']:.0f} s |"
        )
    lines += ["", f"Chance: {1 / args.classes:.3f}. Curves: [`{NAME}.png`]({NAME}.png)."]
    (out / f"{NAME}.md").write_text("\n".join(lines) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--markers", type=int, default=16, help="copies of the marker in a document")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--held-out", type=int, default=128, help="held-out documents")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--window", type=int, default=32, help="one-sided attention window")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--variants", default="global,local", help=f"which of {','.join(VARIANTS)} to train")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}, expected some of {list(VARIANTS)}")
    if args.seq_len < 8 or args.classes < 2 or args.vocab < FIRST_FILLER + args.classes + 1:
        parser.error("--seq-len must be >= 8, --classes >= 2, --vocab > classes + 3")
    if not 1 <= args.warmup < args.steps:
        parser.error(
            f"--warmup must be in [1, --steps) (the learning rate rises over it, then decays to 0), "
            f"got {args.warmup} with --steps {args.steps}"
        )
    if not 1 <= args.markers <= args.seq_len - 1 - args.seq_len // 2:
        parser.error(f"--markers must be in [1, {args.seq_len - 1 - args.seq_len // 2}] (the second half's positions)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    held_out = make_documents(
        args.held_out,
        args.seq_len,
        args.classes,
        args.vocab,
        torch.Generator().manual_seed(args.seed + 2),
        args.markers,
    )
    runs = {variant: train(variant, args, held_out) for variant in args.variants}
    write_results(runs, args, args.out)
    for variant, curves in runs.items():
        print(
            f"{VARIANTS[variant]}: held-out accuracy {curves['accuracy'][-1]:.3f} after {args.steps} steps "
            f"({curves['seconds']:.0f} s)"
        )
    print(f"wrote {args.out / NAME}.png and .md")
    return runs


if __name__ == "__main__":
    main()
