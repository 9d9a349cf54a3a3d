"""The examples: the fine-tuning task needs global attention; the character LM is causal, reaches exactly as
far back as its windows and dilations say, and splits its corpus by file; tiny runs of both write their curves."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from hf_helpers import randomize_

from examples import char_lm
from examples import long_document_classification as example


def test_documents_hold_one_marker_in_the_second_half_naming_the_label():
    ids, labels = example.make_documents(50, 40, 3, 20, torch.Generator().manual_seed(0))
    markers = ids >= 20 - 3
    assert (markers.sum(1) == 1).all() and (ids[:, 0] == example.BOS).all() and (ids[:, -1] == example.SEP).all()
    position = markers.int().argmax(1)
    assert (position >= 20).all() and (position < 39).all()
    assert torch.equal(ids[torch.arange(50), position] - (20 - 3), labels)


def test_only_global_attention_lets_the_first_token_see_the_marker():
    """The task cannot be solved by the window alone: <s>'s logits ignore the marker without global
    attention (it is beyond layers x window) and depend on it with."""
    args = example.parse_args(["--seq-len", "200", "--layers", "2", "--window", "8", "--hidden", "16", "--heads", "2"])
    model = randomize_(example.build_model(args), 0).eval()  # weights far from the init: attention not uniform
    ids, _ = example.make_documents(4, 200, args.classes, args.vocab, torch.Generator().manual_seed(1))
    other = ids.clone()
    other[ids >= args.vocab - args.classes] = (
        args.vocab
        - args.classes
        + ((ids[ids >= args.vocab - args.classes] - (args.vocab - args.classes) + 1) % args.classes)
    )
    with torch.no_grad():
        local = [model(x, global_attention_mask=example.global_mask_for("local", x)).logits for x in (ids, other)]
        assert torch.equal(*local)
        a, b = (model(x, global_attention_mask=example.global_mask_for("global", x)).logits for x in (ids, other))
        assert ((a - b).abs().amax(-1) > 1e-5).all(), (a - b).abs().amax(-1)  # (float32 noise: ~1e-7)


def test_a_tiny_run_writes_its_curves(tmp_path):
    runs = example.main(
        [
            "--seq-len",
            "96",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--eval-every",
            "2",
            "--batch-size",
            "2",
            "--held-out",
            "4",
            "--hidden",
            "16",
            "--heads",
            "2",
            "--window",
            "4",
            "--out",
            str(tmp_path),
        ]
    )
    for curves in runs.values():
        assert len(curves["loss"]) == 4 and curves["eval_steps"] == [2, 4] and len(curves["accuracy"]) == 2
        assert all(torch.isfinite(torch.tensor(curves["loss"])))
    assert (tmp_path / "long_document_classification.png").stat().st_size > 10_000
    table = (tmp_path / "long_document_classification.md").read_text()
    assert "global attention on <s>" in table and "sliding window only" in table


def test_char_lm_corpus_split_is_by_file_deterministic_and_about_one_in_twenty():
    root, train, held_out = char_lm.corpus_files()
    assert held_out and train and train == sorted(train) and held_out == sorted(held_out)
    assert 0.02 < len(held_out) / (len(train) + len(held_out)) < 0.09
    # The rule, file by file: a file's side depends on its path under the library only.
    for files, side in ((train, False), (held_out, True)):
        assert all((zlib.crc32(p.relative_to(root).as_posix().encode()) % 20 == 0) is side for p in files)
    assert all("site-packages" not in p.parts for p in train + held_out)


def test_char_lm_is_causal_and_reaches_exactly_its_receptive_field():
    """A byte's logits never depend on later bytes (else the LM would read its answer) and depend on a byte
    ``receptive_field`` positions back, not one further: the dilated model reaches beyond the short one."""
    args = char_lm.parse_args(
        ["--context", "160", "--windows", "4,8", "--short-window", "4", "--hidden", "32", "--heads", "4"]
    )
    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(2))
    last = ids.shape[1] - 1
    for variant, reach in (("longformer", 4 * 4 + 8 * 4), ("short", 4 + 4)):
        assert char_lm.receptive_field(args, variant) == reach
        model = randomize_(char_lm.build_model(args, variant), 0).eval()

        def logits_after_changing(position):
            changed = ids.clone()
            changed[0, position] = (changed[0, position] + 1) % 256
            with torch.no_grad():
                return model(changed).logits

        with torch.no_grad():
            logits = model(ids).logits
        later = logits_after_changing(100)
        assert torch.equal(logits[:, :100], later[:, :100]) and not torch.equal(logits[:, 100], later[:, 100])
        assert (logits[0, last] - logits_after_changing(last - reach)[0, last]).abs().max() > 1e-6, variant
        assert torch.equal(logits[0, last], logits_after_changing(last - reach - 1)[0, last]), variant


def test_char_lm_staged_model_attends_as_short_then_as_longformer():
    """Staged training changes only the windows and dilations: with the short span the model is the
    short one (same seed, same weights, same logits), widened it is the longformer one."""
    args = char_lm.parse_args(
        ["--context", "160", "--windows", "4,8", "--short-window", "4", "--hidden", "32", "--heads", "4"]
    )
    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(3))
    models = {}
    for variant in ("short", "longformer", "staged"):
        torch.manual_seed(5)
        models[variant] = char_lm.build_model(args, variant).eval()
    staged = models["staged"]
    with torch.no_grad():
        char_lm.set_attention_span(staged, models["short"].config)
        assert torch.equal(staged(ids).logits, models["short"](ids).logits)
        char_lm.set_attention_span(staged, staged.config)
        assert torch.equal(staged(ids).logits, models["longformer"](ids).logits)
        assert not torch.equal(staged(ids).logits, models["short"](ids).logits)


def test_a_tiny_char_lm_run_writes_its_curves(tmp_path):
    runs = char_lm.main(
        [
            "--minutes",
            "0.05",
            "--context",
            "64",
            "--windows",
            "4,8",
            "--short-window",
            "4",
            "--hidden",
            "16",
            "--heads",
            "4",
            "--batch-size",
            "2",
            "--held-out",
            "4",
            "--eval-every",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    for curves in runs.values():
        assert curves["steps"] >= 1 and curves["eval_bpc"] and all(0 < b < 12 for b in curves["eval_bpc"])
    assert (tmp_path / "char_lm.png").stat().st_size > 10_000
    table = (tmp_path / "char_lm.md").read_text()
    assert "| longformer | [4, 8] |" in table and "| short | [4, 4] |" in table
    assert "| staged | [4, 4], then [4, 8] |" in table and runs["staged"]["widened_at"] is not None


@pytest.mark.multiprocess
def test_the_sequence_parallel_example_runs_under_torchrun():
    """The README's command: two ranks under torchrun, each matching one process on its shard."""
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/sequence_parallel.py",
            "--seq-len",
            "150",
            "--window",
            "4",
            "--dilation",
            "2",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("matches one process on the whole sequence") == 2, result.stdout


@pytest.mark.multiprocess
def test_the_sequence_parallel_model_example_runs_under_torchrun():
    """The README's first command, tiny: two ranks train a classifier on one document; rank 0's loss and
    summed gradients match one process, and both ranks see the same loss at every step."""
    import re
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/sequence_parallel_model.py",
            "--seq-len",
            "150",
            "--layers",
            "2",
            "--hidden",
            "32",
            "--heads",
            "4",
            "--window",
            "4",
            "--steps",
            "2",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0: loss and gradients match one process on the whole document" in result.stdout, result.stdout
    losses = re.findall(r"rank (\d)/2: step (\d), rows \d+\.\.\d+ of 150, loss ([0-9.]+)", result.stdout)
    by_step = {step: {loss for _, s, loss in losses if s == step} for _, step, _ in losses}
    assert len(losses) == 4 and all(len(seen) == 1 for seen in by_step.values()), result.stdout
