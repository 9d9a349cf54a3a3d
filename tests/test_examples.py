"""The fine-tuning example: its task needs global attention, and a tiny run writes its curves."""

from __future__ import annotations

import torch

from examples import long_document_classification as example
from hf_helpers import randomize_


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
    other[ids >= args.vocab - args.classes] = args.vocab - args.classes + (
        (ids[ids >= args.vocab - args.classes] - (args.vocab - args.classes) + 1) % args.classes)
    with torch.no_grad():
        local = [model(x, global_attention_mask=example.global_mask_for("local", x)).logits for x in (ids, other)]
        assert torch.equal(*local)
        a, b = (model(x, global_attention_mask=example.global_mask_for("global", x)).logits for x in (ids, other))
        assert ((a - b).abs().amax(-1) > 1e-5).all(), (a - b).abs().amax(-1)  # (float32 noise: ~1e-7)


def test_a_tiny_run_writes_its_curves(tmp_path):
    runs = example.main(["--seq-len", "96", "--steps", "4", "--eval-every", "2", "--batch-size", "2", "--held-out", "4",
                         "--hidden", "16", "--heads", "2", "--window", "4", "--out", str(tmp_path)])
    for curves in runs.values():
        assert len(curves["loss"]) == 4 and curves["eval_steps"] == [2, 4] and len(curves["accuracy"]) == 2
        assert all(torch.isfinite(torch.tensor(curves["loss"])))
    assert (tmp_path / "long_document_classification.png").stat().st_size > 10_000
    table = (tmp_path / "long_document_classification.md").read_text()
    assert "global attention on <s>" in table and "sliding window only" in table
