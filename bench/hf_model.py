"""transformers' LongformerModel, patched (``longformer_ops.hf.patch``) against unpatched:
``python -m bench.hf_model [--seq-lens 1024,2048,4096] [--rounds 3]``.

One base-size model (12 layers, hidden 768, 12 heads, transformers' default two-sided window 512,
float32, random weights), batch 1, token 0 global (a classifier's ``<s>``). Per length: a forward
in eval mode under ``no_grad`` and a training step (forward and backward in training mode, with
transformers' default dropout 0.1), for the same model patched and unpatched (``patch`` /
``unpatch`` between calls: the same weights), timed interleaved (medians of ``--rounds`` rounds,
each in a shuffled order, after one warm-up round), and the peak extra RSS of one call of each in a
fresh process (as ``python -m bench`` measures it). Writes ``bench/results/<device>-hf-model.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
METHODS = ("transformers", "patched")
PASSES = ("forward", "training step")


def build(seq_len: int):
    """The model (base size, default window) and its inputs for one length."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LongformerConfig(max_position_embeddings=seq_len + 2)
    model = transformers.LongformerModel(config)
    generator = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(3, config.vocab_size, (1, seq_len), generator=generator)
    global_mask = torch.zeros_like(ids)
    global_mask[:, 0] = 1
    return model, dict(input_ids=ids, global_attention_mask=global_mask)


def use(model, method: str) -> None:
    """Patch or unpatch ``model`` (in place, the same weights) for ``method``."""
    import longformer_ops.hf as hf

    (hf.patch if method == "patched" else hf.unpatch)(model)


def runner(model, inputs, step: str):
    """One call of ``step``."""

    def run():
        if step == "forward":
            model.eval()
            with torch.no_grad():
                model(**inputs)
        else:
            model.train()
            model.zero_grad(set_to_none=True)
            model(**inputs).last_hidden_state.square().mean().backward()

    return run


def time_rounds(seq_len: int, rounds: int) -> dict:
    model, inputs = build(seq_len)
    runs = {(m, s): runner(model, inputs, s) for m in METHODS for s in PASSES}
    samples = {key: [] for key in runs}
    order = random.Random(seq_len)
    for round_index in range(rounds + 1):
        for key in order.sample(list(runs), len(runs)):
            use(model, key[0])
            started = time.perf_counter()
            runs[key]()
            if round_index:  # round 0 warms up
                samples[key].append(time.perf_counter() - started)
    return {key: statistics.median(values) for key, values in samples.items()}


def _peak_child(seq_len: int, method: str, step: str, connection) -> None:
    from bench.measure import _rss_kib

    model, inputs = build(seq_len)
    use(model, method)
    run = runner(model, inputs, step)
    run()  # first call: library loads, allocator warm-up
    import longformer_ops

    longformer_ops.empty_cache()
    with open("/proc/self/clear_refs", "w") as handle:  # reset VmHWM to the current RSS
        handle.write("5")
    before = _rss_kib("VmRSS")
    run()
    connection.send((_rss_kib("VmHWM") - before) / 1024)


def peak_mib(seq_len: int, method: str, step: str) -> float:
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_peak_child, args=(seq_len, method, step, sender))
    process.start()
    sender.close()
    try:
        return receiver.recv()
    finally:
        process.join()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_model", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="1024,2048,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    from bench.__main__ import cpu_results_name, source_commit
    name = cpu_results_name()
    commit = source_commit()
    lines = [f"# transformers' LongformerModel (base), patched against unpatched ({name}, at {commit})", "",
             f"`python -m bench.hf_model --seq-lens {args.seq_lens} --rounds {args.rounds}`: batch 1, token 0 global, "
             "float32; time per call (median of the rounds) / peak extra RSS of one call in a fresh process.", "",
             "| n | pass | transformers | patched | speed-up |", "|---:|---|---:|---:|---:|"]
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        print(f"n = {seq_len}: timing ...", file=sys.stderr)
        medians = time_rounds(seq_len, args.rounds)
        for step in PASSES:
            peaks = {m: peak_mib(seq_len, m, step) for m in METHODS}
            theirs, ours = medians[("transformers", step)], medians[("patched", step)]
            lines.append(f"| {seq_len} | {step} | {theirs * 1e3:.0f} ms / {peaks['transformers']:.0f} MiB | "
                         f"{ours * 1e3:.0f} ms / {peaks['patched']:.0f} MiB | {theirs / ours:.2f}x |")
            print(lines[-1], file=sys.stderr)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}-hf-model.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
