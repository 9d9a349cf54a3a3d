"""transformers' sliding-window models on ``attn_implementation="longformer_ops"`` against ``sdpa`` and
against a zero-cost stub: ``python -m bench.hf_attention [--model modernbert] [--seq-lens
1024,2048,4096,8192] [--rounds 3] [--dtype float32] [--passes forward] [--layers N]
[--decode-tokens 32]``.

``--model``, random weights, ``--dtype``, batch 1, no padding, no cache:

- ``modernbert``: ``ModernBertModel`` at base size (transformers' defaults: 22 layers, hidden 768,
  12 heads, bidirectional local window 128, one full-attention layer in three);
- ``gemma3``: ``Gemma3TextModel`` shaped as Gemma 3 1B (hidden 1152, 4 query heads on 1 key/value
  head of 256, causal window 512, five sliding layers in six), ``--layers`` of them (default 6:
  one full layer); its forward is a prefill's work.

Three attention implementations for the same weights:

- ``sdpa``: transformers' own, as every model runs its sliding layers on a CPU: a dense ``n x n``
  mask per sliding layer;
- ``longformer_ops``: the sliding layers on our fused local-attention kernels
  (:mod:`longformer_ops.hf.attention`), the full layers on sdpa;
- ``stub``: the sliding layers' attention replaced by one that costs nothing (zeros of the output's
  shape, and in a backward zero gradients for the query, key and value, so that the projections'
  backward still runs), the full layers on sdpa: every other cost unchanged, the lower bound for any
  kernel of the sliding layers.

Per length: the peak extra RSS of one call of each in a fresh process (after a warm-up call on 512
tokens there), then times interleaved in shuffled rounds, medians. The passes: a forward in eval
mode under ``no_grad``, a training step (forward and backward of the output's mean square), and
(causal models) ``decode``: ``--decode-tokens`` steps of one token each after an ``n``-token prefill
into transformers' cache (the prefill, on longformer_ops, and the cache's copy are not timed; the
memory probes are skipped: a prefill's peak would hide a step's). Tokens per second count the
tokens a call processes: ``n`` for a forward or step, one per decode step. Writes
``<out>/<cpu>-hf-<model>[-<dtype>].{md,csv,png}`` (the plot: time and memory against n per pass;
``--plot CSV`` draws it again from a results CSV, e.g. one joined from two runs).
"""

from __future__ import annotations

import argparse
import csv
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

METHODS = ("sdpa", "longformer_ops", "stub")
MODELS = {"modernbert": ("ModernBERT-base", 22), "gemma3": ("Gemma-3-1B-like", 6)}  # (title, default layers)
PASSES = {"forward": "forward", "training step": "forward+backward", "decode": "decode"}
DECODE_TOKENS = 32
WARM_UP_TOKENS = 512


class _FreeAttention(torch.autograd.Function):
    """Attention that costs nothing: zeros ``[b, n, H, d]``, and zero gradients for the query, key and
    value. An output that did not depend on them (plain zeros) would also spare the training step
    the backward of the projections that make them (a third fewer GEMMs in ModernBERT's sliding
    layers), which no kernel can spare: the stub would not be a lower bound there."""

    @staticmethod
    def forward(ctx, query, key, value):
        ctx.shapes = [(x.shape, x.dtype) for x in (query, key, value)]
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.shapes)


def _stub_attention(module, query, key, value, attention_mask, sliding_window=None, **kwargs):
    """Zero-cost attention for the sliding layers (:class:`_FreeAttention`); the full layers as
    "longformer_ops" runs them (sdpa)."""
    if sliding_window is None:
        from longformer_ops.hf.attention import attention_forward

        return attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _FreeAttention.apply(query, key, value), None


def _config(model: str, layers: int, seq_len: int):
    import transformers

    if model == "modernbert":
        return transformers.ModernBertModel, transformers.ModernBertConfig(
            num_hidden_layers=layers, max_position_embeddings=max(seq_len, 8192)
        )
    return transformers.Gemma3TextModel, transformers.Gemma3TextConfig(
        vocab_size=32768,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        max_position_embeddings=max(seq_len, 32768),
        layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(layers)],
    )


def build(seq_len: int, layers: int, dtype: str, model_name: str = "modernbert"):
    """``model_name`` with ``layers`` layers, random weights, and ``seq_len`` random token ids."""
    import transformers

    from longformer_ops import hf
    from longformer_ops.hf import attention as hf_attention

    hf.register()
    transformers.AttentionInterface.register("stub", _stub_attention)
    transformers.AttentionMaskInterface.register("stub", hf_attention.padding_mask)
    torch.manual_seed(0)
    model_class, config = _config(model_name, layers, seq_len)
    model = model_class(config).to(getattr(torch, dtype))
    ids = torch.randint(5, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, inputs | ({"use_cache": False} if model_name != "modernbert" else {})


def runner(model, method: str, inputs: dict, step: str, decode_tokens: int = DECODE_TOKENS):
    """The timed call of ``step``; a decode call has a ``prepare`` (run before the clock starts)."""
    if step == "decode":
        return _decoder(model, method, inputs, decode_tokens)

    def forward():
        model.set_attn_implementation(method)
        model.eval()
        with torch.no_grad():
            model(**inputs)

    def training_step():
        model.set_attn_implementation(method)
        model.train()
        model.zero_grad(set_to_none=True)
        model(**inputs).last_hidden_state.float().square().mean().backward()

    return forward if step == "forward" else training_step


def _decoder(model, method: str, inputs: dict, tokens: int):
    """``tokens`` decode steps (fixed random token ids, as greedy decoding's cost does not depend on
    which) on a copy of the cache of a prefill of ``inputs``, made once per model on longformer_ops."""
    import copy

    if not hasattr(model, "_bench_prefill_cache"):
        model.set_attn_implementation("longformer_ops")
        model.eval()
        with torch.no_grad():
            model._bench_prefill_cache = model(**(inputs | {"use_cache": True})).past_key_values
    n = inputs["input_ids"].shape[1]
    next_ids = torch.randint(5, model.config.vocab_size, (tokens, 1, 1), generator=torch.Generator().manual_seed(2))
    state = {}

    def prepare():
        state["cache"] = copy.deepcopy(model._bench_prefill_cache)

    def decode():
        model.set_attn_implementation(method)
        model.eval()
        mask = torch.ones(1, n, dtype=torch.long)
        with torch.no_grad():
            for i in range(tokens):
                mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
                model(
                    input_ids=next_ids[i],
                    attention_mask=mask,
                    past_key_values=state["cache"],
                    use_cache=True,
                    cache_position=torch.tensor([n + i]),
                )

    decode.prepare = prepare
    return decode


def _prefix(inputs: dict) -> dict:
    return {
        key: value[:, :WARM_UP_TOKENS] if isinstance(value, torch.Tensor) else value for key, value in inputs.items()
    }


def _prepared_calls(seq_len: int, layers: int, dtype: str, method: str, step: str, model_name: str):
    """For :func:`bench.measure.peak_of_call_mib`: a warm-up call on a short prefix, then the call."""
    model, inputs = build(seq_len, layers, dtype, model_name)

    def warm_up():
        runner(model, method, _prefix(inputs), step)()
        model.zero_grad(set_to_none=True)

    return warm_up, runner(model, method, inputs, step)


def peak_mib(seq_len: int, layers: int, dtype: str, method: str, step: str, model_name: str) -> float | str:
    """Peak extra RSS (MiB) of one call in a fresh process, or why it could not be measured."""
    from bench.measure import peak_of_call_mib

    return peak_of_call_mib(_prepared_calls, seq_len, layers, dtype, method, step, model_name)


def time_rounds(
    seq_len: int,
    layers: int,
    dtype: str,
    step: str,
    rounds: int,
    model_name: str = "modernbert",
    decode_tokens: int = DECODE_TOKENS,
) -> dict[str, float]:
    """Median seconds of each method's call, over ``rounds`` shuffled rounds on the same weights."""
    model, inputs = build(seq_len, layers, dtype, model_name)
    calls = {method: runner(model, method, inputs, step, decode_tokens) for method in METHODS}
    for method in METHODS:  # warm-up on a short prefix: libraries load
        warm_up = (
            runner(model, method, inputs, step, 2)
            if step == "decode"  # (two steps)
            else runner(model, method, _prefix(inputs), step)
        )
        getattr(warm_up, "prepare", lambda: None)()
        warm_up()
    samples = {method: [] for method in METHODS}
    order = list(METHODS)
    for _ in range(rounds):
        random.shuffle(order)
        for method in order:
            getattr(calls[method], "prepare", lambda: None)()
            started = time.perf_counter()
            calls[method]()
            samples[method].append(time.perf_counter() - started)
    return {method: statistics.median(values) for method, values in samples.items()}


def _number(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:  # "-" (not measured) or why a probe failed
        return None


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Time (and peak memory, where measured) against n for each method, one row of panels per pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import log_log_axis

    steps = list(dict.fromkeys(row["step"] for row in rows))
    figure, axes = plt.subplots(len(steps), 2, figsize=(11, 3.6 * len(steps)), squeeze=False)
    colours = {"sdpa": "tab:red", "longformer_ops": "tab:blue", "stub": "tab:gray"}
    for step, (time_axis, memory_axis) in zip(steps, axes, strict=True):
        members = sorted((row for row in rows if row["step"] == step), key=lambda row: int(row["n"]))
        for method in METHODS:
            style = dict(marker="o", label=method, color=colours[method], linestyle="--" if method == "stub" else "-")
            times = [(int(row["n"]), _number(str(row[f"{method} s"]))) for row in members]
            time_axis.plot(*zip(*times, strict=True), **style)
            memory = [(int(row["n"]), _number(str(row[f"{method} MiB"]))) for row in members]
            memory = [(n, mib) for n, mib in memory if mib is not None]
            if memory:
                memory_axis.plot(*zip(*memory, strict=True), **style)
        tokens = members[0].get("tokens", members[0]["n"])
        for axis, label in ((time_axis, f"seconds per call ({step})"), (memory_axis, "peak extra RSS (MiB)")):
            if not axis.lines:
                axis.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axis.transAxes)
                continue
            then = f" (then {tokens} decode steps)" if step == "decode" else ""
            log_log_axis(axis, f"sequence length n{then}", label)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_csv(path: Path) -> None:
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    model = path.stem.partition("-hf-")[2].split("-")[0]
    plot(rows, path.with_suffix(".png"), f"{path.stem}: {MODELS[model][0] if model in MODELS else model}, batch 1")
    print(f"wrote {path.with_suffix('.png')}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_attention", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="modernbert", choices=list(MODELS))
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--passes", default="forward", help=f"comma-separated, of {list(PASSES)}")
    parser.add_argument("--layers", type=int, help="default: the model's (modernbert 22, gemma3 6)")
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="decode steps per call of 'decode'")
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory probes")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: bench/results/<machine kind>)")
    parser.add_argument("--plot", type=Path, metavar="CSV", help="only draw CSV's plot (beside it, .png) and exit")
    args = parser.parse_args(argv)
    if args.plot is not None:
        if not args.plot.is_file():
            parser.error(f"--plot: no such results CSV: {args.plot}")
        _plot_csv(args.plot)
        return 0
    passes = [p.strip() for p in args.passes.split(",")]
    unknown = [p for p in passes if p not in PASSES]
    if unknown:
        parser.error(f"--passes: unknown {unknown}; choose from {list(PASSES)}")
    if "decode" in passes and args.model == "modernbert":
        parser.error("--passes: 'decode' needs a causal model (--model gemma3); modernbert is an encoder")
    if args.decode_tokens < 1:
        parser.error(f"--decode-tokens: expected a positive count, got {args.decode_tokens}")
    seq_lens = [int(n) for n in args.seq_lens.split(",")]
    title, default_layers = MODELS[args.model]
    args.layers = args.layers or default_layers
    random.seed(0)
    from bench.machine import cpu_results_name, results_dir, source_commit

    args.out = args.out or results_dir()

    rows = []
    for step in passes:
        for n in seq_lens:
            print(f"{step}, n = {n}: memory ...", file=sys.stderr)
            skip_memory = args.no_memory or step == "decode"
            peaks = {
                m: ("-" if skip_memory else peak_mib(n, args.layers, args.dtype, m, step, args.model)) for m in METHODS
            }
            print(f"{step}, n = {n}: {args.rounds} rounds ...", file=sys.stderr)
            times = time_rounds(n, args.layers, args.dtype, step, args.rounds, args.model, args.decode_tokens)
            tokens = args.decode_tokens if step == "decode" else n
            rows.append(
                dict(
                    step=PASSES[step],
                    n=n,
                    tokens=tokens,
                    **{f"{m} s": times[m] for m in METHODS},
                    **{f"{m} MiB": peaks[m] for m in METHODS},
                )
            )
            print("  " + ", ".join(f"{m} {times[m]:.2f} s" for m in METHODS), file=sys.stderr)
    name = f"{cpu_results_name()}-hf-{args.model}" + ("" if args.dtype == "float32" else f"-{args.dtype}")
    mib = lambda value: value if isinstance(value, str) else f"{value:.0f}"  # noqa: E731
    lines = [
        f"# {title} ({args.layers} layers) on transformers' sdpa, on longformer_ops, and with its sliding "
        f"layers' attention free ({cpu_results_name()}, {args.dtype}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, at {source_commit()})",
        "",
        f"`python -m bench.hf_attention --model {args.model} --seq-lens {args.seq_lens} --rounds {args.rounds} --dtype {args.dtype} "
        f"--passes {shlex.quote(args.passes)} --layers {args.layers}"
        + (f" --decode-tokens {args.decode_tokens}" if "decode" in passes else "")
        + f"`; batch 1, no padding, medians of {args.rounds} "
        "shuffled rounds; memory: peak extra RSS of one call in a fresh process.",
        "",
        "| pass | n | tokens | sdpa s | longformer_ops s | stub s | ours / sdpa | ours / stub | sdpa tokens/s | "
        "longformer_ops tokens/s | sdpa MiB | longformer_ops MiB | stub MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ours, theirs, stub = row["longformer_ops s"], row["sdpa s"], row["stub s"]
        lines.append(
            f"| {row['step']} | {row['n']} | {row['tokens']} | {theirs:.2f} | {ours:.2f} | {stub:.2f} | "
            f"{ours / theirs:.2f} | {ours / stub:.2f} | {row['tokens'] / theirs:.1f} | {row['tokens'] / ours:.1f} | "
            f"{mib(row['sdpa MiB'])} | {mib(row['longformer_ops MiB'])} | "
            f"{mib(row['stub MiB'])} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    with open(args.out / f"{name}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / f"{name}.png", f"{name}: {title}, {args.layers} layers, {args.dtype}, batch 1")
    print("\n".join(lines))
    print(f"wrote {args.out / name}.md, .csv and .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
