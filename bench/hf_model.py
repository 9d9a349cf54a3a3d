"""transformers' LongformerModel or LED, patched (``longformer_ops.hf.patch``) against unpatched:
``python -m bench.hf_model [--model longformer|led] [--seq-lens 1024,2048,4096,8192,16384] [--rounds 3]
[--dtype float32]``.

One base-size model, random weights, in ``--dtype`` (float32, or bfloat16 / float16 for the whole
model, as ``model.to(dtype)`` makes it), batch 1, token 0 global (a classifier's ``<s>``):
``longformer``: ``LongformerModel`` (12 layers, hidden 768, 12 heads, transformers' default two-sided
window 512); ``led``: ``LEDForConditionalGeneration`` shaped as ``allenai/led-base-16384`` (6 encoder
and 6 decoder layers, hidden 768, 12 heads, two-sided window 1024, 50265 words) with a summary of
256 tokens as its decoder input and labels. Per length:

- memory first: the peak extra RSS of one call of each (method, pass) in a fresh process (after a
  short warm-up call there, so that loading libraries does not count), as ``python -m bench``
  measures it. A call predicted (linearly from the previous length) to need more than the memory
  budget is not run and is recorded as skipped, with the prediction;
- then time: the same model patched and unpatched (``patch`` / ``unpatch`` between calls: the same
  weights), interleaved, medians of ``--rounds`` rounds, each in a shuffled order. A warm-up round
  runs only where calls were under a second at the previous length (as ``python -m bench`` does).

The passes (``--passes``): a forward in eval mode under ``no_grad``; a training step (forward and
backward in training mode, with transformers' default dropout 0.1; LED's loss is its summary's
cross-entropy, LongformerModel's the mean square of its output); the same with activation
checkpointing (transformers' ``gradient_checkpointing_enable``), which long documents need; for LED,
generation (``generate``, greedy, 64 new tokens: a summary's first 64). Writes
``<out>/<name>.{md,csv,png}``, by default ``<cpu>-hf-model`` (``<cpu>-hf-led`` for LED; either with
``-<dtype>`` for a half type).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

METHODS = ("transformers", "patched")
# --passes: name -> (the results' "pass" column, activation checkpointing)
PASSES = {
    "forward": ("forward", False),
    "training step": ("forward+backward", False),
    "checkpointed training step": ("forward+backward, checkpointed", True),
    "generation": ("generate 64", False),
}
WARM_UP_TOKENS = 512
DTYPES = ("float32", "bfloat16", "float16")
# --model: name -> (the results' "op" column, its name in titles, file stem part, default --layers)
MODELS = {
    "longformer": ("hf LongformerModel base", "LongformerModel (base)", "hf-model", 12),
    "led": ("hf LED base, 256-token summary", "LEDForConditionalGeneration (base, a 256-token summary)", "hf-led", 6),
}
SUMMARY_TOKENS = 256
GENERATED_TOKENS = 64


def build(seq_len: int, layers: int = 12, dtype: str = "float32", model: str = "longformer"):
    """The model (base size, default window; ``layers`` of them, LED: in its encoder and its decoder
    each; in ``dtype``) and its inputs for one length."""
    import transformers

    torch.manual_seed(0)
    if model == "led":
        config = transformers.LEDConfig(
            d_model=768,
            encoder_layers=layers,
            decoder_layers=layers,
            encoder_attention_heads=12,
            decoder_attention_heads=12,
            encoder_ffn_dim=3072,
            decoder_ffn_dim=3072,
            attention_window=[1024] * layers,
            max_encoder_position_embeddings=max(16384, seq_len),
            max_decoder_position_embeddings=1024,
        )
        built = transformers.LEDForConditionalGeneration(config)
    else:
        config = transformers.LongformerConfig(max_position_embeddings=seq_len + 2, num_hidden_layers=layers)
        built = transformers.LongformerModel(config)
    generator = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(3, config.vocab_size, (1, seq_len), generator=generator)
    global_mask = torch.zeros_like(ids)
    global_mask[:, 0] = 1
    inputs = dict(input_ids=ids, global_attention_mask=global_mask)
    if model == "led":
        inputs["labels"] = torch.randint(3, config.vocab_size, (1, SUMMARY_TOKENS), generator=generator)
    return built.to(getattr(torch, dtype)), inputs


def use(model, method: str) -> None:
    """Patch or unpatch ``model`` (in place, the same weights) for ``method``."""
    import longformer_ops.hf as hf

    (hf.patch if method == "patched" else hf.unpatch)(model)


def _checkpointing(model, on: bool) -> None:
    """transformers' activation checkpointing on or off (5.x renamed gradient_checkpointing_*)."""
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    getattr(model, f"{prefix}_checkpointing_{'enable' if on else 'disable'}")()


def runner(model, inputs, step: str):
    """One call of ``step``."""

    def run():
        if step == "forward":
            model.eval()
            with torch.no_grad():
                model(**inputs)
        elif step == "generation":
            model.eval()
            prompt = {key: value for key, value in inputs.items() if key != "labels"}
            with torch.no_grad():
                model.generate(
                    **prompt,
                    max_new_tokens=GENERATED_TOKENS,
                    min_new_tokens=GENERATED_TOKENS,
                    num_beams=1,
                    do_sample=False,
                )
        else:
            _checkpointing(model, PASSES[step][1])
            model.train()
            model.zero_grad(set_to_none=True)
            out = model(**inputs)
            (out.loss if "labels" in inputs else out.last_hidden_state.float().square().mean()).backward()

    return run


def time_rounds(
    seq_len: int, layers: int, dtype: str, model_name: str, entries: list[tuple[str, str]], rounds: int, warm_up: set
) -> dict:
    """Median seconds per call of each (method, pass) entry."""
    model, inputs = build(seq_len, layers, dtype, model_name)
    runs = {key: runner(model, inputs, key[1]) for key in entries}
    samples = {key: [] for key in runs}
    order = random.Random(seq_len)
    for round_index in tqdm(range(rounds + 1), desc=f"n = {seq_len}: timing", unit="round", leave=False):
        for key in order.sample(list(runs), len(runs)):
            if round_index == 0 and key not in warm_up:
                continue
            use(model, key[0])
            started = time.perf_counter()
            runs[key]()
            if round_index:  # round 0 warms up
                samples[key].append(time.perf_counter() - started)
    return {key: statistics.median(values) for key, values in samples.items()}


def _prepared_calls(seq_len: int, layers: int, dtype: str, model_name: str, method: str, step: str):
    """For :func:`bench.measure.peak_of_call_mib`: a warm-up call on a short prefix, then the call."""
    model, inputs = build(seq_len, layers, dtype, model_name)
    use(model, method)

    def warm_up():
        runner(model, {key: value[:, :WARM_UP_TOKENS] for key, value in inputs.items()}, step)()
        model.zero_grad(set_to_none=True)

    return warm_up, runner(model, inputs, step)


def peak_mib(seq_len: int, layers: int, dtype: str, model_name: str, method: str, step: str) -> float | str:
    """Peak extra RSS (MiB) of one call in a fresh process, or why it could not be measured."""
    from bench.measure import peak_of_call_mib

    return peak_of_call_mib(_prepared_calls, seq_len, layers, dtype, model_name, method, step)


def measure(
    seq_lens: list[int],
    layers: int,
    dtype: str,
    passes: list[str],
    rounds: int,
    budget_mib: float,
    model_name: str = "longformer",
    methods: tuple[str, ...] = METHODS,
) -> list[dict]:
    """One row per (length, method, pass), in the layout of ``python -m bench``'s results."""
    rows, last = [], {}  # last: (method, pass) -> (seq_len, peak MiB, seconds) at the previous length
    for seq_len in seq_lens:
        entries, warm_up, by_key = [], set(), {}
        for key in ((m, s) for s in passes for m in methods):
            row = dict(
                op=MODELS[model_name][0],
                method=key[0],
                seq_len=seq_len,
                window=512 if model_name == "led" else 256,
                dilation="1",
                heads=12,
                head_dim=64,
                batch=1,
                dtype=dtype,
                device="cpu",
                status="ok",
                **{"pass": PASSES[key[1]][0]},
            )
            rows.append(row)
            by_key[key] = row
            previous = last.get(key)
            predicted = previous[1] * seq_len / previous[0] if previous else 0.0
            if predicted > budget_mib:
                row.update(
                    status="skipped",
                    reason=f"predicted {predicted / 1024:.1f} GiB > budget {budget_mib / 1024:.1f} GiB",
                )
                continue
            print(f"n = {seq_len}: peak memory of {key[0]}, {key[1]} ...", file=sys.stderr)
            peak = peak_mib(seq_len, layers, dtype, model_name, *key)
            if isinstance(peak, str):
                row.update(status="skipped", reason=peak)
                continue
            row["peak_mib"] = peak
            entries.append(key)
            if previous is None or previous[2] < 1.0:
                warm_up.add(key)
        medians = time_rounds(seq_len, layers, dtype, model_name, entries, rounds, warm_up) if entries else {}
        for key, seconds in medians.items():
            by_key[key]["time_ms"] = seconds * 1e3
            last[key] = (seq_len, by_key[key]["peak_mib"], seconds)
        for step in passes:
            print(table_row(by_key.get(("transformers", step)), by_key.get(("patched", step)), step), file=sys.stderr)
    return rows


def _cell(row: dict | None) -> str:
    if row is None:
        return "not run"
    if row["status"] != "ok":
        return f"skipped: {row['reason']}"
    return f"{row['time_ms']:.0f} ms / {row['peak_mib']:.0f} MiB"


def table_row(theirs: dict | None, ours: dict | None, step: str) -> str:
    both = theirs is not None and ours is not None and theirs["status"] == ours["status"] == "ok"
    speed_up = f"{theirs['time_ms'] / ours['time_ms']:.2f}x" if both else ""
    memory = f"{theirs['peak_mib'] / ours['peak_mib']:.1f}x" if both else ""
    return f"| {(ours or theirs)['seq_len']} | {step} | {_cell(theirs)} | {_cell(ours)} | {speed_up} | {memory} |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.hf_model",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="longformer", choices=MODELS)
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated: transformers (unpatched), patched; unpatched half types on a CPU "
        "without a GEMM for them take minutes per call",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192,16384")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="fewer for a quick run (default and the committed results: 12, LED 6 and 6)",
    )
    parser.add_argument("--passes", default="forward,training step", help=f"comma-separated, from: {', '.join(PASSES)}")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="the model's parameters and activations")
    parser.add_argument(
        "--name",
        default=None,
        help="results file stem (default: <cpu>-hf-model or <cpu>-hf-led, -<dtype> added for a half type)",
    )
    parser.add_argument(
        "--memory-budget-gib",
        type=float,
        default=None,
        help="skip a call predicted to need more (default: 60%% of the memory available at the start)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: bench/results/<machine kind>)")
    args = parser.parse_args(argv)
    passes = [p.strip() for p in args.passes.split(",")]
    if any(p not in PASSES for p in passes) or ("generation" in passes and args.model != "led"):
        parser.error(f"--passes: choose from {list(PASSES)} (generation: LED only), got {passes}")
    methods = tuple(m.strip() for m in args.methods.split(","))
    if not methods or any(m not in METHODS for m in methods):
        parser.error(f"--methods: choose from {list(METHODS)}, got {list(methods)}")
    _, title, stem_part, default_layers = MODELS[args.model]
    layers = args.layers or default_layers
    from bench import report
    from bench.machine import cpu_results_name, default_cpu_memory_budget_bytes, results_dir, source_commit

    args.out = args.out or results_dir()
    name, commit = cpu_results_name(), source_commit()
    budget = (
        args.memory_budget_gib * 1024
        if args.memory_budget_gib is not None
        else default_cpu_memory_budget_bytes() / 2**20
    )
    rows = measure(
        [int(s) for s in args.seq_lens.split(",")], layers, args.dtype, passes, args.rounds, budget, args.model, methods
    )
    lines = [
        f"# transformers' {title}, patched against unpatched ({name}, at {commit})",
        "",
        f"`python -m bench.hf_model --model {args.model} --methods {','.join(methods)} --seq-lens {args.seq_lens} "
        f"--rounds {args.rounds} --layers {layers} --dtype {args.dtype} --passes '{args.passes}'`: "
        f"{layers} layers{' (encoder) and as many (decoder)' if args.model == 'led' else ''}, batch 1, "
        f"token 0 global, "
        f"{args.dtype}, {torch.get_num_threads()} threads; time per call (median of the rounds) / peak extra RSS of "
        f"one call in a fresh process; memory budget {budget / 1024:.1f} GiB.",
        "",
        "| n | pass | transformers | patched | speed-up | memory saved |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    by_key = {(r["seq_len"], r["method"], r["pass"]): r for r in rows}
    for seq_len in dict.fromkeys(r["seq_len"] for r in rows):
        for step in passes:
            lines.append(
                table_row(
                    by_key.get((seq_len, "transformers", PASSES[step][0])),
                    by_key.get((seq_len, "patched", PASSES[step][0])),
                    step,
                )
            )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (args.name or f"{name}-{stem_part}" + ("" if args.dtype == "float32" else f"-{args.dtype}"))
    stem.with_suffix(".md").write_text(text)
    report.write_csv(rows, stem.with_suffix(".csv"))
    report.plot(
        rows, stem.with_suffix(".png"), f"{name}: transformers' {title}, patched vs unpatched, batch 1, {args.dtype}"
    )
    print(f"wrote {stem}.md, .csv and .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
