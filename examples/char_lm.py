"""Longformer's first experiment in miniature: an autoregressive character LM on our causal, dilated kernels.

    python -m examples.char_lm                        # 3 x 10 minutes of training on 2 cores, then the report
    python -m examples.char_lm --minutes 0.2 --context 256 --out /tmp/quick

Longformer was first shown on text8 and enwik8: character-level language models whose attention
window grows with depth, with dilation on some heads of the upper layers, which is what the original
TVM kernel was written for. Here the corpus is text that ships with every Python: the standard
library's own source files (``sysconfig``'s ``stdlib``, every ``*.py`` outside ``site-packages``, in
sorted order, read as bytes). A file is held out when the CRC-32 of its path relative to the library
is 0 mod 20 (about 5%): a split by file that does not depend on the order of the listing.

Three runs of one model size (the same parameters: windows and dilations change no weights), each
trained for the same wall-clock budget (``--minutes``) from the same seed on random contexts of
``--context`` bytes, causal attention:

- ``longformer``: one-sided windows growing with depth (``--windows``, default 32, 64, 128, 256) and
  dilation on two heads of each of the upper two layers (2 and 4): a byte's prediction can depend on
  the 1632 bytes before it (``receptive_field``);
- ``short``: the same model with every window 32 and no dilation (128 bytes);
- ``staged``: the paper's staged training in two phases: ``short`` for the first half of the budget
  (the same initial weights and the same contexts in the same order as ``short``), then ``longformer``'s windows and
  dilations on the same weights (windows and dilations change no weights).

Held-out bits per character: fixed contexts spread over the held-out files, scored on the second
half of each context (every scored byte has at least ``context / 2`` bytes before it). Writes
``<out>/char_lm.{png,md}`` with the curves of each, the corpus' size and the Python version (the
corpus is that Python's library, so numbers compare within one Python version).
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

from bench.machine import cpu_results_name, source_commit
from longformer_ops import LongformerConfig, LongformerForMaskedLM, LongformerSelfAttention

NAME = "char_lm"
VARIANTS = ("longformer", "short", "staged")
PAD = 256  # bytes are 0..255; one more id for padding (never in the data)
HELD_OUT_MODULUS = 20


def corpus_files(root: Path | None = None) -> tuple[Path, list[Path], list[Path]]:
    """The standard library's ``*.py`` files, sorted: (root, training files, held-out files)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if not {"site-packages", "dist-packages"} & set(p.parts)]
    held_out = [p for p in files if zlib.crc32(p.relative_to(root).as_posix().encode()) % HELD_OUT_MODULUS == 0]
    chosen = set(held_out)
    return root, [p for p in files if p not in chosen], held_out


def read_bytes(files: list[Path]) -> torch.Tensor:
    """The files' bytes, one after another, as an int64 tensor."""
    data = b"".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def build_config(args, variant: str) -> LongformerConfig:
    layers = len(args.windows)
    if variant in ("longformer", "staged"):
        windows = args.windows
        # The paper's recipe: dilation on some heads of the upper layers only.
        dilation = [1] * max(0, layers - 2) + [[1] * (args.heads - 2) + [2, 4]] * min(2, layers)
    else:
        windows, dilation = [args.short_window] * layers, 1
    return LongformerConfig(
        vocab_size=PAD + 1,
        pad_token_id=PAD,
        hidden_size=args.hidden,
        num_hidden_layers=layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.context + PAD + 1,
        attention_window=windows,
        attention_dilation=dilation,
        autoregressive=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def build_model(args, variant: str) -> LongformerForMaskedLM:
    return LongformerForMaskedLM(build_config(args, variant))


def set_attention_span(model, config: LongformerConfig) -> None:
    """Give every attention layer of ``model`` the windows and dilations of ``config``."""
    layers = [m for m in model.modules() if isinstance(m, LongformerSelfAttention)]
    for i, layer in enumerate(layers):
        layer.window, layer.dilation = config.attention_window[i], config.layer_dilation(i)


def receptive_field(args, variant: str) -> int:
    """How many bytes back a prediction can look: each layer adds its window times its largest dilation."""
    config = build_config(args, variant)  # per-layer lists; a layer's dilation an int or per head
    return sum(
        w * max(d if isinstance(d, list) else [d])
        for w, d in zip(config.attention_window, config.attention_dilation, strict=True)
    )


def next_byte_loss(model, contexts: torch.Tensor, scored_from: int = 0) -> torch.Tensor:
    """Mean cross-entropy (nats) of predicting byte i + 1 from bytes 0..i, over positions i >= scored_from."""
    logits = model(contexts[:, :-1]).logits[:, scored_from:]  # [b, n - scored_from, 257]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), contexts[:, 1 + scored_from :].reshape(-1)
    )


def held_out_contexts(data: torch.Tensor, count: int, context: int) -> torch.Tensor:
    """``count`` contexts of ``context + 1`` bytes at evenly spaced offsets in the held-out bytes."""
    starts = torch.linspace(0, len(data) - context - 2, count).long()
    return torch.stack([data[s : s + context + 1] for s in starts.tolist()])


@torch.no_grad()
def bits_per_character(model, contexts: torch.Tensor, batch_size: int) -> float:
    model.eval()
    half = (contexts.shape[1] - 1) // 2
    # Every context scores the same number of bytes: weigh each batch's mean by its contexts.
    total = sum(
        next_byte_loss(model, contexts[i : i + batch_size], half).item() * len(contexts[i : i + batch_size])
        for i in range(0, len(contexts), batch_size)
    )
    model.train()
    return total / len(contexts) / math.log(2)


def train(variant: str, args, train_data: torch.Tensor, held_out: torch.Tensor) -> dict:
    torch.manual_seed(args.seed)
    model = build_model(args, variant).train()
    if variant == "staged":  # phase 1 attends as the short model does
        set_attention_span(model, build_config(args, "short"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sampler = torch.Generator().manual_seed(args.seed + 1)  # the same contexts, in order, for every variant
    budget = args.minutes * 60
    curves = {
        "train_bpc": [],
        "eval_minutes": [],
        "eval_bpc": [],
        "steps": 0,
        "widened_at": None,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    trained = 0.0  # seconds spent training (evaluations do not count against the budget)
    bar = tqdm(
        total=budget,
        desc=f"{variant:>10}",
        file=sys.stderr,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s of training{postfix}",
    )
    while trained < budget:
        if variant == "staged" and curves["widened_at"] is None and trained >= budget / 2:
            set_attention_span(model, model.config)  # phase 2: the longformer windows and dilations
            curves["widened_at"] = trained / 60
        started = time.perf_counter()
        # Warm-up over the first steps, then linear decay to 0 over the time budget.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min((curves["steps"] + 1) / args.warmup, 1 - trained / budget)
        offsets = torch.randint(0, len(train_data) - args.context - 1, (args.batch_size,), generator=sampler)
        contexts = torch.stack([train_data[o : o + args.context + 1] for o in offsets.tolist()])
        loss = next_byte_loss(model, contexts)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        elapsed = time.perf_counter() - started
        trained += elapsed
        curves["steps"] += 1
        curves["train_bpc"].append((trained / 60, loss.item() / math.log(2)))
        bar.update(min(elapsed, budget - bar.n))
        if curves["steps"] % args.eval_every == 0 or trained >= budget:
            curves["eval_minutes"].append(trained / 60)
            curves["eval_bpc"].append(bits_per_character(model, held_out, args.batch_size))
        bar.set_postfix(
            step=curves["steps"],
            train_bpc=f"{loss.item() / math.log(2):.2f}",
            held_out_bpc=f"{curves['eval_bpc'][-1]:.3f}" if curves["eval_bpc"] else "-",
        )
    bar.close()
    return curves


def write_results(runs: dict, args, corpus: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    for variant, curves in runs.items():
        minutes, bpc = zip(*curves["train_bpc"], strict=True)
        span = 20
        smooth = [
            sum(bpc[max(0, i - span + 1) : i + 1]) / len(bpc[max(0, i - span + 1) : i + 1]) for i in range(len(bpc))
        ]
        (line,) = axis.plot(minutes, smooth, alpha=0.45, linewidth=1)
        axis.plot(
            curves["eval_minutes"],
            curves["eval_bpc"],
            marker="o",
            markersize=3,
            color=line.get_color(),
            label=f"{variant}: held-out (training: faint)",
        )
        if curves["widened_at"] is not None:
            axis.axvline(curves["widened_at"], color=line.get_color(), linestyle=":", linewidth=1)
    axis.set(
        xlabel="training minutes (2 cores)",
        ylabel="bits per character",
        ylim=(2, 5),
        title=f"Character LM on the Python {sys.version.split()[0]} standard library, context {args.context}",
    )
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / f"{NAME}.png", dpi=110)
    plt.close(figure)

    command = ("python -m examples.char_lm " + " ".join(sys.argv[1:])).strip()
    lines = [
        f"# Character LM on our causal dilated kernels ({cpu_results_name()}, {torch.get_num_threads()} threads)",
        "",
        f"Command: `{command}` (commit {source_commit()}, torch {torch.__version__}, Python {sys.version.split()[0]})",
        "",
        f"Corpus: the standard library's `*.py` files, {corpus['train_files']} files / {corpus['train_bytes'] / 1e6:.1f} MB "
        f"for training, {corpus['held_out_files']} files / {corpus['held_out_bytes'] / 1e6:.2f} MB held out "
        f"(CRC-32 of the path mod {HELD_OUT_MODULUS} = 0). Model: {len(args.windows)} layers, hidden {args.hidden}, "
        f"{args.heads} heads, causal, {runs and next(iter(runs.values()))['parameters']:,} parameters; context "
        f"{args.context} bytes, batch {args.batch_size}, AdamW lr {args.lr}, {args.minutes} min of training each. "
        f"Held-out: {args.held_out} contexts, bits per character on the second half of each.",
        "",
        "| model | windows (one-sided) | dilation | reach (bytes back) | steps in the budget | held-out bits/char "
        "| best |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for variant, curves in runs.items():
        short, wide = [args.short_window] * len(args.windows), args.windows
        windows = {"longformer": wide, "short": short, "staged": f"{short}, then {wide}"}[variant]
        dilation = {
            "longformer": "2 and 4 on two heads of the top 2 layers",
            "short": "none",
            "staged": "none, then as longformer",
        }[variant]
        lines.append(
            f"| {variant} | {windows} | {dilation} | {receptive_field(args, variant)} | {curves['steps']} | "
            f"{curves['eval_bpc'][-1]:.3f} | "
            f"{min(curves['eval_bpc']):.3f} |"
        )
    lines += ["", f"Curves: [`{NAME}.png`]({NAME}.png)."]
    (out / f"{NAME}.md").write_text("\n".join(lines) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="training time per model")
    parser.add_argument("--context", type=int, default=2048, help="bytes per training context")
    parser.add_argument("--windows", default="32,64,128,256", help="one-sided window per layer (longformer)")
    parser.add_argument("--short-window", type=int, default=32, help="every layer's window (short)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30, help="steps of linear learning-rate warm-up")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    parser.add_argument("--held-out", type=int, default=32, help="held-out contexts")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--stdlib", type=Path, default=None, help="the corpus' root (default: this Python's library)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    args.windows = [int(w) for w in args.windows.split(",")]
    args.variants = args.variants.split(",")
    if any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants: expected some of {','.join(VARIANTS)}, got {args.variants}")
    if args.heads < 3:
        parser.error("--heads must be >= 3 (two dilated heads and at least one undilated)")
    if args.minutes <= 0 or args.context < 16:
        parser.error("--minutes must be > 0 and --context >= 16")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    _, train_files, held_out_files = corpus_files(args.stdlib)
    train_data, held_out_data = read_bytes(train_files), read_bytes(held_out_files)
    if len(held_out_data) < args.context + 2 or len(train_data) < args.context + 2:
        raise ValueError(
            f"the corpus under {args.stdlib or 'the standard library'} is too small for --context {args.context}"
        )
    corpus = dict(
        train_files=len(train_files),
        train_bytes=len(train_data),
        held_out_files=len(held_out_files),
        held_out_bytes=len(held_out_data),
    )
    print(
        f"corpus: {len(train_files)} training files ({len(train_data) / 1e6:.1f} MB), {len(held_out_files)} held out "
        f"({len(held_out_data) / 1e6:.2f} MB)"
    )
    held_out = held_out_contexts(held_out_data, args.held_out, args.context)
    runs = {}
    for variant in args.variants:
        runs[variant] = train(variant, args, train_data, held_out)
    write_results(runs, args, corpus, args.out)
    for variant, curves in runs.items():
        print(f"{variant}: held-out {curves['eval_bpc'][-1]:.3f} bits/char after {curves['steps']} steps")
    print(f"wrote {args.out / NAME}.png and .md")
    return runs


if __name__ == "__main__":
    main()
