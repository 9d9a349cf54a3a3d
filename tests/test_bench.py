"""The benchmark tool runs end to end at tiny sizes and writes its CSV, table and plot."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench.__main__ as bench_main
from bench import measure, methods
from bench.__main__ import command_line, main
from bench.measure import Case, probe_in_fresh_process


@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("dilation", [(1, 1, 1), (1, 2, 3)])
def test_methods_agree_on_local_attention(dilation, requires_grad):
    """Every method the bench compares computes the same local attention (else timings mean nothing).
    Inference takes another path (softmax in place) than training."""
    inputs = methods.make_inputs("local_attention", 1, 70, 3, 8, 5, torch.float64, "cpu", requires_grad)
    names = [
        m
        for m in ("tvm", "tvm_out", "full", "sdpa", "sliding_chunks") + methods.STEPS_METHODS
        if not methods.unsupported_reason(m, "local_attention", requires_grad, dilation, "cpu")
    ]
    assert ("tvm_out" in names) == (not requires_grad) and "tvm" in names
    for name in names:
        run = methods.runner("local_attention", name, inputs, 5, dilation, False)
        first, second = run().clone(), run()  # tvm_out: the second call writes into the first's outputs
        for out in (first, second):
            torch.testing.assert_close(
                out, methods.local_attention("full", *inputs, 5, dilation), rtol=1e-9, atol=1e-9, msg=name
            )


@pytest.mark.skipif(
    methods.unsupported_reason("flex", "local_attention", False, (1,), "cpu") is not None,
    reason="this torch has no FlexAttention",
)
@pytest.mark.parametrize("dilation", [(1, 1, 1), (2, 2, 2), (1, 2, 3)])
def test_flex_computes_the_same_local_attention(dilation):
    """Its block mask has three forms (plain window, one dilation, per-head dilations)."""
    inputs = methods.make_inputs("local_attention", 1, 150, 3, 16, 5, torch.float32, "cpu", False)
    torch.testing.assert_close(
        methods.local_attention("flex", *inputs, 5, dilation),
        methods.local_attention("full", *inputs, 5, dilation),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_inference_path_matches_float32(dtype):
    """Inference softmaxes half-precision scores in place; it must agree with the float32 computation."""
    inputs = methods.make_inputs("local_attention", 1, 70, 3, 16, 5, dtype, "cpu", False)
    out = methods.local_attention("tvm", *inputs, 5, (1, 2, 3))
    ref = methods.local_attention("full", *(x.float() for x in inputs), 5, (1, 2, 3))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2)


@pytest.mark.parametrize("dilation", [(1, 1), (2, 3)])
@pytest.mark.parametrize("op", ["qk_band", "pv_band", "transposed_band"])
def test_methods_agree_on_band_products(op, dilation):
    inputs = methods.make_inputs(op, 2, 40, 2, 8, 3, torch.float64, "cpu", False)
    names = [
        m
        for m in ("tvm", "tvm_out", "full", "sliding_chunks")
        if not methods.unsupported_reason(m, op, False, dilation, "cpu")
    ]
    assert {"tvm", "tvm_out", "full"} <= set(names)
    expected = methods.runner(op, "full", inputs, 3, dilation, False)()
    for name in names:
        run = methods.runner(op, name, inputs, 3, dilation, False)
        first = run()
        first_values = first.clone()
        second = run()
        assert (second.data_ptr() == first.data_ptr()) == (name == "tvm_out"), "tvm_out reuses its output, tvm does not"
        for out in (first_values, second):
            torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9, msg=name)


def test_layer_methods_agree_and_train_with_dropout():
    """The layer op: its three modes give one output in eval mode (forward); with gradients the layer
    runs in training mode, whose attention dropout changes the result."""
    dilation = (1, 1)
    (x,) = methods.make_inputs("layer", 1, 48, 2, 16, 4, torch.float64, "cpu", False)
    names = [m for m in methods.METHODS if not methods.unsupported_reason(m, "layer", False, dilation, "cpu")]
    assert names == ["tvm", "full", "sliding_chunks"]
    expected = methods.runner("layer", "full", (x,), 4, dilation, False)()
    for name in names:
        torch.testing.assert_close(
            methods.runner("layer", name, (x,), 4, dilation, False)(), expected, rtol=1e-9, atol=1e-9, msg=name
        )
    trained = methods.runner("layer", "tvm", (x.clone().requires_grad_(),), 4, dilation, True)()
    assert not torch.allclose(trained.detach(), expected)


def test_cli_writes_results(tmp_path):
    main(
        [
            "--seq-lens",
            "64,128",
            "--window",
            "8",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--repeats",
            "1",
            "--methods",
            "tvm,full,sliding_chunks,sdpa",
            "--dilation",
            "1",
            "--dilation",
            "1,2",
            "--max-call-seconds",
            "0.5",
            "--no-memory",
            "--out",
            str(tmp_path),
            "--name",
            "smoke",
        ]
    )
    rows = list(csv.DictReader(open(tmp_path / "smoke.csv")))
    for column in ("op", "method", "seq_len", "window", "dilation", "dtype", "device", "time_ms", "peak_mib"):
        assert column in rows[0]
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["method"] for r in ok} == {"tvm", "full", "sliding_chunks", "sdpa"}
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert any(r["reason"] == "sliding chunks has no dilation" for r in skipped)
    assert all(float(r["time_ms"]) > 0 for r in ok)
    assert (tmp_path / "smoke.png").stat().st_size > 0
    table = (tmp_path / "smoke.md").read_text()
    assert "| seq_len |" in table and "### Rates and first calls" in table

    # The table and plot re-render from the CSV alone, identically.
    from bench import report

    rows_back = report.read_csv(tmp_path / "smoke.csv")
    assert report.markdown(rows_back, table.split("\n\n###", 1)[0]) == table


@pytest.mark.parametrize(
    "name, flags, kind",
    [
        ("amd-epyc-2cpu", "avx2 avx512f avx512_bf16", "amd-epyc-avx512"),
        ("amd-epyc-2cpu", "avx2", "amd-epyc-avx2"),
        ("intel-r-xeon-r-processor-2cpu", "avx2 avx512f", "intel-xeon-avx512"),
        ("intel-r-xeon-r-processor-2cpu", "avx2 avx512f amx_bf16 amx_tile", "intel-xeon-amx"),
        ("intel-r-xeon-r-platinum-8481c-cpu-2-70ghz-16cpu", "avx512f amx_tile", "intel-xeon-platinum-8481c-amx"),
        ("amd-epyc-7b13-64-core-processor-8cpu", "avx2", "amd-epyc-7b13-avx2"),
    ],
)
def test_a_cpu_results_folder_is_its_machine_kind(monkeypatch, name, flags, kind):
    """bench/results/ holds a folder per kind of machine: the CPU's model without trademarks, clock
    and core count, with its widest vector ISA (the project's EPYCs share one model name)."""
    from bench import machine
    from longformer_ops.runtime import loader

    monkeypatch.setattr(machine, "device_name", lambda device: name)
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset(flags.split()))
    assert machine.machine_kind("cpu") == kind
    assert machine.results_dir() == machine.RESULTS / kind


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvidia-h100-80gb-hbm3", "nvidia-h100"),
        ("nvidia-h200", "nvidia-h200"),
        ("nvidia-a100-sxm4-40gb", "nvidia-a100-sxm4"),
    ],
)
def test_a_gpu_results_folder_is_its_model_without_the_memory(monkeypatch, name, kind):
    from bench import machine

    monkeypatch.setattr(machine, "device_name", lambda device: name)
    assert machine.machine_kind("cuda") == kind


def test_committed_results_are_in_their_machines_folders():
    """Every committed result lies in a machine kind's folder (bench/results/README.md indexes them)."""
    from bench import machine

    loose = [p.name for p in machine.RESULTS.iterdir() if p.is_file() and p.name != "README.md"]
    assert not loose, f"results outside a machine kind's folder: {loose}"
    assert machine.machine_kind("cpu") == machine.results_dir().name


def test_cli_writes_into_the_machines_folder_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(measure, "GEMM_SIZE", 128)
    monkeypatch.setattr(bench_main, "results_dir", lambda device: tmp_path / f"kind-of-{device}")
    main(
        [
            "--seq-lens",
            "64",
            "--window",
            "8",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--repeats",
            "1",
            "--ops",
            "qk_band",
            "--methods",
            "tvm",
            "--passes",
            "forward",
            "--dilation",
            "1",
            "--no-memory",
            "--name",
            "default",
        ]
    )
    assert {p.name for p in (tmp_path / "kind-of-cpu").iterdir()} == {"default.csv", "default.md", "default.png"}


@pytest.fixture
def gemm_rates(monkeypatch):
    """Sets the GFLOP/s that the GEMM probe measures per dtype (the real ones depend on the CPU)."""

    def set_rates(**rates):
        monkeypatch.setattr(measure, "_gemm_rate", lambda device, dtype: rates[dtype])
        measure.slow_gemm_reason.cache_clear()

    yield set_rates
    measure.slow_gemm_reason.cache_clear()


def test_cli_times_several_dtypes_in_one_run(tmp_path, gemm_rates, monkeypatch):
    gemm_rates(float32=100.0, bfloat16=50.0)
    monkeypatch.setattr(measure, "GEMM_SIZE", 128)  # a CPU without a bfloat16 GEMM takes minutes at 2048
    main(
        [
            "--seq-lens",
            "64",
            "--window",
            "8",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--repeats",
            "1",
            "--ops",
            "qk_band",
            "--methods",
            "tvm,full",
            "--dtype",
            "float32,bfloat16",
            "--dilation",
            "1",
            "--no-memory",
            "--out",
            str(tmp_path),
            "--name",
            "dtypes",
        ]
    )
    rows = list(csv.DictReader(open(tmp_path / "dtypes.csv")))
    assert sorted((r["dtype"], r["method"]) for r in rows) == [
        ("bfloat16", "full"),
        ("bfloat16", "tvm"),
        ("float32", "full"),
        ("float32", "tvm"),
    ]
    # One GEMM in the rounds of both dtypes: the dtype comparison holds under the same conditions.
    assert len({r["gemm_gflops"] for r in rows}) == 1
    assert all((r["vs_float32"] != "") == (r["dtype"] == "bfloat16") for r in rows)
    # bfloat16 is also compared with a bfloat16 GEMM of the same rounds (one for both methods).
    assert all((r["dtype_gemm_share"] != "") == (r["dtype"] == "bfloat16") for r in rows)
    assert len({r["dtype_gemm_gflops"] for r in rows if r["dtype"] == "bfloat16"}) == 1
    table = (tmp_path / "dtypes.md").read_text()
    assert "### Against float32, round by round" in table and "### Share of the same dtype's GEMM" in table
    assert (
        "### qk_band, forward, dilation 1, float32" in table and "### qk_band, forward, dilation 1, bfloat16" in table
    )


def test_a_dtype_without_a_native_gemm_is_not_timed_beside_the_cases(tmp_path, gemm_rates, capsys):
    """bfloat16's torch.mm on an AVX2 CPU is a scalar loop (~15 s per reference call): left out, and said so."""
    gemm_rates(float32=100.0, bfloat16=100.0 / measure.SLOW_GEMM_FACTOR - 0.1)
    main(
        [
            "--seq-lens",
            "64",
            "--window",
            "8",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--repeats",
            "1",
            "--ops",
            "qk_band",
            "--methods",
            "tvm",
            "--dtype",
            "float32,bfloat16",
            "--dilation",
            "1",
            "--no-memory",
            "--out",
            str(tmp_path),
            "--name",
            "slow",
        ]
    )
    rows = list(csv.DictReader(open(tmp_path / "slow.csv")))
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"] and all(r["gemm_share"] for r in rows)
    assert all(r["dtype_gemm_share"] == "" for r in rows)
    reason = "torch.mm in bfloat16 runs at 12.4 GFLOP/s here against float32's 100 (256^3): no native bfloat16 GEMM"
    assert reason in capsys.readouterr().out and reason in (tmp_path / "slow.md").read_text()
    gemm_rates(float32=100.0, bfloat16=100.0 / measure.SLOW_GEMM_FACTOR)  # at the factor: timed
    assert measure.slow_gemm_reason("cpu", "bfloat16") is None and measure.slow_gemm_reason("cpu", "float32") is None


def test_the_gemm_probe_measures_a_rate():
    assert 0.01 < measure._gemm_rate("cpu", "float32") < 1e5


def test_cases_timed_together_share_every_round(monkeypatch, gemm_rates):
    """time_interleaved runs each round over every (case, method) and the GEMM, shuffled per round."""
    gemm_rates(float32=100.0, bfloat16=50.0)
    calls = []
    monkeypatch.setattr(
        methods, "runner", lambda op, method, inputs, *rest: lambda: calls.append((inputs[0].dtype, method))
    )
    monkeypatch.setattr(measure, "gemm_runner", lambda device, dtype: lambda: calls.append(measure.gemm_key(dtype)))
    cases = [Case("qk_band", False, 64, 8, (1, 1), 2, 16, 1, dtype, "cpu") for dtype in ("float32", "bfloat16")]
    entries = [(case, m) for case in cases for m in ("tvm", "full")]
    samples = measure.time_interleaved(entries, repeats=4)
    gemms = [measure.GEMM, "gemm-bfloat16"]  # float32's, every case's reference, and bfloat16's own
    assert set(samples) == {*gemms, *entries} and all(len(s) == 4 for s in samples.values())
    per_round = len(entries) + 2
    assert len(calls) == 5 * per_round  # the warm-up round, then 4
    rounds = [calls[i : i + per_round] for i in range(0, len(calls), per_round)]
    for order in rounds:
        assert sorted(map(str, order)) == sorted(
            map(str, [*gemms, *[(getattr(torch, c.dtype), m) for c, m in entries]])
        )
    assert len({tuple(map(str, order)) for order in rounds}) > 1, "the order should change between rounds"


def test_a_method_out_of_gpu_memory_is_skipped_not_fatal(tmp_path, monkeypatch):
    """A dense method that runs out of (GPU) memory while timed is recorded as skipped with the
    reason, and not tried at longer lengths; the other methods' sweep goes on."""
    real_runner = methods.runner

    def runner(op, method, inputs, *rest):
        if method == "full" and inputs[0].shape[1] >= 128:

            def out_of_memory():
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB.")

            return out_of_memory
        return real_runner(op, method, inputs, *rest)

    monkeypatch.setattr(methods, "runner", runner)
    main(
        [
            "--seq-lens",
            "64,128,256",
            "--window",
            "8",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--ops",
            "qk_band",
            "--methods",
            "tvm,full",
            "--dilation",
            "1",
            "--repeats",
            "2",
            "--no-memory",
            "--out",
            str(tmp_path),
            "--name",
            "oom",
        ]
    )
    rows = {(r["method"], int(r["seq_len"])): r for r in csv.DictReader(open(tmp_path / "oom.csv"))}
    assert all(rows[("tvm", n)]["status"] == "ok" for n in (64, 128, 256))
    assert rows[("full", 64)]["status"] == "ok"
    assert rows[("full", 128)]["status"] == "skipped"
    assert rows[("full", 128)]["reason"].startswith("out of memory while timing: CUDA out of memory")
    assert rows[("full", 256)]["status"] == "skipped"
    assert rows[("full", 256)]["reason"] == "out of memory: already at n=128"


def test_paired_ratio_compares_round_by_round():
    """A slow round slows both entries of it: the ratio within rounds sees through it, medians do not."""
    assert measure.paired_ratio([1.0, 10.0, 11.0], [1.0, 10.0, 1.0]) == 1.0


def test_shares_and_dtype_ratios_are_taken_round_by_round(tmp_path, monkeypatch):
    """Round 2 is slow for everything timed in it; per-round ratios see through it."""

    def fake_rounds(entries, repeats, expected=None, failures=None):
        samples = {measure.GEMM: [1.0, 10.0, 1.0], "gemm-bfloat16": [0.5, 5.0, 0.5]}
        for case, method in entries:
            samples[(case, method)] = [0.5, 5.0, 5.0] if case.dtype == "bfloat16" else [1.0, 10.0, 10.0]
        return samples

    monkeypatch.setattr(bench_main, "time_interleaved", fake_rounds)
    main(
        [
            "--seq-lens",
            "64",
            "--window",
            "8",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--ops",
            "qk_band",
            "--methods",
            "tvm",
            "--dtype",
            "float32,bfloat16",
            "--dilation",
            "1",
            "--no-memory",
            "--out",
            str(tmp_path),
            "--name",
            "paired",
        ]
    )
    rows = {r["dtype"]: r for r in csv.DictReader(open(tmp_path / "paired.csv"))}
    flops = methods.useful_flops("qk_band", False, 1, 64, 2, 16, 8)
    assert float(rows["float32"]["time_ms"]) == 10_000.0  # times stay medians
    assert float(rows["float32"]["gemm_share"]) == pytest.approx(flops / measure.GEMM_FLOPS)  # median of 1, 1, 0.1
    assert float(rows["bfloat16"]["vs_float32"]) == pytest.approx(0.5)
    assert rows["float32"]["vs_float32"] == ""
    # bfloat16 against its own GEMM, round by round: 0.5/0.5, 5/5, 0.5/5 -> median 1 (x flops / GEMM flops)
    assert float(rows["bfloat16"]["dtype_gemm_share"]) == pytest.approx(flops / measure.GEMM_FLOPS)
    assert rows["float32"]["dtype_gemm_share"] == ""


def test_cli_runs_the_layer_op(tmp_path):
    main(
        [
            "--seq-lens",
            "64",
            "--window",
            "8",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--repeats",
            "1",
            "--ops",
            "layer",
            "--methods",
            "tvm,sdpa",
            "--dilation",
            "1",
            "--no-memory",
            "--out",
            str(tmp_path),
            "--name",
            "layer",
        ]
    )
    rows = {(r["pass"], r["method"]): r for r in csv.DictReader(open(tmp_path / "layer.csv"))}
    assert rows[("forward", "tvm")]["status"] == rows[("forward+backward", "tvm")]["status"] == "ok"
    assert rows[("forward", "sdpa")]["reason"] == "the layer's attention modes are tvm, sliding_chunks, full"


def test_poolingformer_op_compares_its_three_methods(tmp_path):
    """--ops poolingformer: ours and the dense reference give one output (eval); the Longformer layers
    at its two windows, its yardsticks, others; the CLI runs the four by default, both passes."""
    dilation = (1, 1)
    (x,) = methods.make_inputs("poolingformer", 1, 45, 2, 16, 3, torch.float64, "cpu", False)
    ours, dense, narrow, wide = (
        methods.runner("poolingformer", m, (x,), 3, dilation, False)()
        for m in ("tvm", "full", "longformer_w1", "longformer_w2")
    )
    torch.testing.assert_close(ours, dense, rtol=1e-9, atol=1e-9)
    for other in (narrow, wide):
        assert other.shape == ours.shape and not torch.allclose(other, ours)
    main(
        [
            "--seq-lens",
            "45",
            "--window",
            "3",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--repeats",
            "1",
            "--ops",
            "poolingformer",
            "--dilation",
            "1",
            "--no-memory",
            "--out",
            str(tmp_path),
            "--name",
            "pf",
        ]
    )
    rows = list(csv.DictReader(open(tmp_path / "pf.csv")))
    assert {(r["pass"], r["method"]) for r in rows if r["status"] == "ok"} == {
        (p, m) for p in ("forward", "forward+backward") for m in methods.POOLINGFORMER_METHODS
    }


def test_memory_probe_runs_in_a_fresh_process():
    case = Case("local_attention", False, 2048, 64, (1,) * 4, 4, 64, 1, "float32", "cpu")
    probe = probe_in_fresh_process(case, "full", timeout_s=120)
    assert "error" not in probe, probe
    # full attention materialises [h, n, n] float32 scores: at least 64 MiB here.
    assert probe["peak_mib"] >= 4 * 2048 * 2048 * 4 / 2**20, probe
    assert probe["first_call_ms"] > 0


def test_memory_probe_counts_outputs_from_the_output_cache():
    """The probe's first call parks its output for reuse; the measured second call must still count it."""
    case = Case("local_attention", False, 4096, 64, (1,) * 4, 4, 64, 1, "float32", "cpu")
    probe = probe_in_fresh_process(case, "tvm", timeout_s=120)
    assert "error" not in probe, probe
    assert probe["peak_mib"] >= 4096 * 4 * 64 * 4 / 2**20, probe  # the [b, n, h, f] float32 context: 4 MiB


def test_command_line_records_the_environment_that_changes_results(monkeypatch):
    for name in [
        n for n in os.environ if n.startswith(("LONGFORMER_OPS_", "GLIBC_", "MALLOC_", "OMP_", "LD_PRELOAD", "TVM_"))
    ]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0")
    monkeypatch.setenv("LONGFORMER_OPS_THREAD_POOL", "tvm")
    monkeypatch.setenv("UNRELATED", "x")
    assert command_line(["--seq-lens", "512", "--name", "a b"]) == (
        "GLIBC_TUNABLES=glibc.malloc.mmap_max=0 LONGFORMER_OPS_THREAD_POOL=tvm python -m bench --seq-lens 512 --name 'a b'"
    )


def test_hf_model_bench_writes_results_and_skips_what_would_not_fit(tmp_path):
    """``python -m bench.hf_model`` at a tiny size: both methods timed and probed at the first length;
    at the second, every call predicted (from the first) to exceed the budget is skipped, not run."""
    pytest.importorskip("transformers")
    from bench import hf_model, report

    budget_gib = 0.001  # far below any call: the second length must be skipped entirely
    assert (
        hf_model.main(
            [
                "--seq-lens",
                "256,512",
                "--rounds",
                "1",
                "--layers",
                "1",
                "--memory-budget-gib",
                str(budget_gib),
                "--passes",
                "forward,training step,checkpointed training step",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    stem = next(tmp_path.glob("*-hf-model.csv")).with_suffix("")
    rows = report.read_csv(stem.with_suffix(".csv"))
    assert len(rows) == 12 and stem.with_suffix(".png").stat().st_size > 0
    first = [r for r in rows if r["seq_len"] == 256]
    assert {(r["method"], r["pass"]) for r in first} == {
        (m, p)
        for m in ("transformers", "patched")
        for p in ("forward", "forward+backward", "forward+backward, checkpointed")
    }
    assert all(r["status"] == "ok" and r["time_ms"] > 0 and r["peak_mib"] > 0 for r in first), first
    second = [r for r in rows if r["seq_len"] == 512]
    assert all(r["status"] == "skipped" and "budget" in r["reason"] for r in second), second
    table = stem.with_suffix(".md").read_text()
    assert table.count("| 256 |") == 3 and "x |" in table and table.count("skipped: predicted") == 6


def test_hf_model_bench_runs_a_half_type(tmp_path):
    """``--dtype bfloat16``: the model in bfloat16 both ways, recorded so, in a file of its own name."""
    pytest.importorskip("transformers")
    from bench import hf_model, report

    assert (
        hf_model.main(
            [
                "--seq-lens",
                "64",
                "--rounds",
                "1",
                "--layers",
                "1",
                "--passes",
                "forward",
                "--dtype",
                "bfloat16",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    stem = next(tmp_path.glob("*-hf-model-bfloat16.csv")).with_suffix("")
    rows = report.read_csv(stem.with_suffix(".csv"))
    assert {(r["method"], r["dtype"], r["status"]) for r in rows} == {
        ("transformers", "bfloat16", "ok"),
        ("patched", "bfloat16", "ok"),
    }, rows
    assert "--dtype bfloat16" in stem.with_suffix(".md").read_text()
    model, _ = hf_model.build(64, 1, "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_hf_model_bench_runs_led(tmp_path):
    """``--model led``: LED's training step and generation, both methods, in a file of its own name;
    ``--methods patched`` alone (a forward) leaves the other column "not run"; generation is LED's only."""
    pytest.importorskip("transformers")
    from bench import hf_model, report

    assert (
        hf_model.main(
            [
                "--model",
                "led",
                "--seq-lens",
                "64",
                "--rounds",
                "1",
                "--layers",
                "1",
                "--passes",
                "training step,generation",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    stem = next(tmp_path.glob("*-hf-led.csv")).with_suffix("")
    rows = report.read_csv(stem.with_suffix(".csv"))
    assert {(r["method"], r["pass"], r["status"]) for r in rows} == {
        (m, p, "ok") for m in ("transformers", "patched") for p in ("forward+backward", "generate 64")
    }
    assert all(r["op"].startswith("hf LED") and r["time_ms"] > 0 for r in rows)
    assert "LEDForConditionalGeneration" in stem.with_suffix(".md").read_text()
    assert (
        hf_model.main(
            [
                "--model",
                "led",
                "--methods",
                "patched",
                "--seq-lens",
                "64",
                "--rounds",
                "1",
                "--layers",
                "1",
                "--passes",
                "forward",
                "--dtype",
                "bfloat16",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    stem = next(tmp_path.glob("*-hf-led-bfloat16.csv")).with_suffix("")
    assert {r["method"] for r in report.read_csv(stem.with_suffix(".csv"))} == {"patched"}
    assert "| not run |" in stem.with_suffix(".md").read_text()
    for bad in (["--passes", "generation"], ["--methods", "patched,ours"]):
        with pytest.raises(SystemExit):
            hf_model.main(bad + ["--out", str(tmp_path)])


def test_model_op_runs_the_encoder(tmp_path):
    """``--ops model``: the 12-layer encoder, forward and a training step, in its tvm and full modes."""
    inputs = methods.make_inputs("model", 1, 40, 2, 8, 3, torch.float64, "cpu", False)
    outputs = [methods.runner("model", m, inputs, 3, (1, 2), False)() for m in ("tvm", "full")]
    assert outputs[0].shape == (1, 40, 16)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-9, atol=1e-9)
    assert methods.unsupported_reason("sdpa", "model", False, (1,), "cpu")


def test_scale_points_measure_and_write(tmp_path):
    """bench.scale: one point measured in this process, and its CSV, table and plot written."""
    from bench import scale

    point = dict(op="local_attention", backward=True, dilation=(1, 2) * 6, dtype="float32", n=700)
    result = scale.measure(point)
    assert result["status"] == "ok" and result["time_s"] > 0 and result["peak_mib"] > 0
    full = scale.measure(dict(op="full", backward=False, dilation=(1,) * 12, dtype="float32", n=300))
    rows = [scale._row(point, result, "abc"), scale._row(dict(point, op="full", backward=False, n=300), full, "abc")]
    scale.write(rows, tmp_path, "test-scale", "python -m bench.scale --quick", "a test")
    assert (tmp_path / "test-scale.png").stat().st_size > 0
    table = (tmp_path / "test-scale.md").read_text()
    assert "| local_attention | forward+backward | 1..8 | float32 | 700 |" in table and table.count("| abc |") == 2
    assert {p["op"] for p in scale.points(quick=True)} == {"local_attention", "layer", "model", "full"}
    layer = scale.measure(dict(op="layer", backward=False, dilation=(1,) * 12, dtype="float32", n=600))
    assert layer["status"] == "ok" and layer["peak_mib"] > 0


@pytest.mark.parametrize(
    "switch, kernel, per_pass",
    [
        ("ffn", "bias_gelu_", 12),
        ("global-merge", "global_merge_", 12),
        ("layer-norm", "layer_norm", 25),
        ("residual", "bias_dropout_add_", 24),
        ("all", "bias_dropout_add_", 24),
    ],
)
def test_alternate_bench_times_both_and_restores_ours(tmp_path, monkeypatch, switch, kernel, per_pass):
    """bench.alternate times the encoder as shipped and with one part on torch's ops in every
    round (our kernel runs in one of the two), writes its table, and leaves the shipped code in place."""
    from bench import alternate
    from longformer_ops.models.model import LongformerIntermediate, _DenseResidualNorm
    from longformer_ops.runtime import kernels

    shipped = (LongformerIntermediate.forward, kernels.available, _DenseResidualNorm.forward)
    calls = []
    op = getattr(torch.ops.longformer_ops, kernel)
    monkeypatch.setattr(torch.ops.longformer_ops, kernel, lambda *args: calls.append(kernel) or op(*args))
    alternate.main(
        [
            "--switch",
            switch,
            "--dtypes",
            "float32",
            "--passes",
            "forward",
            "--rounds",
            "2",
            "--seq-len",
            "64",
            "--out",
            str(tmp_path),
        ]
    )
    assert (LongformerIntermediate.forward, kernels.available, _DenseResidualNorm.forward) == shipped
    assert len(calls) == per_pass * 3  # (12 layers) in the warm-up round and both timed rounds
    table = (tmp_path / next(p.name for p in tmp_path.glob(f"*-{switch}.md"))).read_text()
    row = next(line for line in table.splitlines() if line.startswith("| float32 | forward |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells[2].split()) == len(cells[3].split()) == 2 and float(cells[4]) > 0


def test_results_of_an_archived_tree_name_its_own_commit(tmp_path):
    """A tree that `tools/gpu_check.sh baseline` made with `git archive` inside this checkout: its
    results' headers must name the tree's commit (from .source-commit), not this checkout's."""
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "bench" / "machine.py", tree / "bench" / "machine.py")
    (tree / "bench" / "__init__.py").write_text("")
    (tree / ".source-commit").write_text("abc1234\n")
    probe = "from bench.machine import source_commit; print(source_commit())"
    run = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tree,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
        check=True,
    )
    assert run.stdout.strip() == "abc1234"


def test_libraries_bench_alternates_the_fused_kernels_of_each_library(capsys):
    """bench.libraries times each library's fused forward and backward in the same rounds, and a
    library against itself (once from an explicit directory, once with a soft-cap) comes out as one
    forward and one backward line each, with ratios to the first."""
    from bench import libraries
    from longformer_ops.runtime import loader as _loader

    target = _loader.library_for(torch.device("cpu"), "float32").name.split("/")[0]
    assert (
        libraries.main(
            [
                "--libraries",
                f"{target}:float32,{_loader.prebuilt_dir()}:{target}:float32,{target}:float32@2.5",
                "--seq-len",
                "96",
                "--window",
                "8",
                "--dilated",
                "--seconds",
                "0.2",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("n = 96, w = 8, 12 heads of 64, dilated")
    timed = [line.split() for line in lines[1:]]
    assert [(cells[0].count(":"), cells[1]) for cells in timed] == [
        (1, "forward"),
        (1, "backward"),
        (2, "forward"),
        (2, "backward"),
        (1, "forward"),
        (1, "backward"),
    ]
    assert timed[-1][0].endswith("@2.5")
    assert all(float(cells[2]) > 0 for cells in timed) and [cells[4] for cells in timed[:2]] == ["1.000", "1.000"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("cpu-avx512", "expected \\[DIR:\\]TARGET:DTYPE"),
        ("cpu-avx512:float32@big", "the soft-cap after '@' .* is not a number"),
        ("cpu-avx512:float8", "'float8' .* is not a torch dtype"),
        ("cpu-none:float32", "no library cpu-none/longformer_float32.so"),
    ],
)
def test_libraries_bench_names_a_bad_library(spec, message, capsys):
    from bench import libraries

    with pytest.raises(SystemExit):
        libraries.main(["--libraries", spec])
    assert re.search(message, capsys.readouterr().err)


def test_few_rows_bench_times_its_five_ways(capsys):
    """bench.few_rows prints one step's products timed five ways, each a positive time."""
    from bench import few_rows

    assert few_rows.main(["--keys", "300", "--layers", "2", "--rounds", "1"]) == 0
    rows = [
        line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "way" not in line
    ]
    assert [cells[1].strip() for cells in rows] == [
        "few-row kernels",
        "float32 path",
        "float32 bmm, float32 caches",
        "autocast, float32 caches: few-row kernels",
        "autocast, float32 caches: float32 path",
    ]
    assert all(float(cells[2]) > 0 for cells in rows)


def test_elementwise_bench_times_every_kernel_in_three_dtypes(capsys):
    """bench.elementwise prints each elementwise kernel's time in float32, bfloat16 and float16, the
    half types with a positive ratio to float32; a hidden size the 12 heads do not divide is refused
    by name."""
    from bench import elementwise

    assert (
        elementwise.main(
            ["--rows", "40", "--hidden", "48", "--ffn", "70", "--globals", "2", "--window", "9", "--rounds", "1"]
        )
        == 0
    )
    rows = [
        line.split("|")[1:-1]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and "kernel" not in line
    ]
    assert [cells[0].strip() for cells in rows] == [
        "bias_gelu",
        "bias_gelu_backward",
        "dropout (ffn wide)",
        "dropout_column_sums",
        "bias_dropout_add",
        "layer_norm",
        "layer_norm_backward",
        "global_merge",
        "global_merge_backward",
        "band_softmax_",
        "band_softmax_backward",
    ]
    for cells in rows:
        assert float(cells[1]) > 0
        for cell in cells[2:]:
            milliseconds, ratio = re.fullmatch(r"\s*([0-9.]+) \(([0-9.]+)\)\s*", cell).groups()
            assert float(milliseconds) > 0 and float(ratio) > 0
    with pytest.raises(SystemExit):
        elementwise.main(["--hidden", "50"])
    assert "--hidden must be a multiple of 12" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        elementwise.main(["--window", "-1"])
    assert "--window must be >= 0, got -1" in capsys.readouterr().err


def test_startup_bench_times_both_setups(tmp_path, capsys):
    """bench.startup writes one row per setup, each time positive; with the runtime's dependencies
    alone a first call leaves neither torch's compiler nor ml_dtypes in the process."""
    from bench import startup

    assert startup.main(["--runs", "1", "--out", str(tmp_path)]) == 0
    written = next(tmp_path.glob("*-startup.md")).read_text()
    rows = {
        cells[1].strip(): cells[2:-1]
        for cells in (line.split("|") for line in written.splitlines())
        if len(cells) > 3 and cells[1].strip() in startup.SETUPS
    }
    assert set(rows) == set(startup.SETUPS), written
    assert all(float(cell) > 0 for cells in rows.values() for cell in cells[:4])
    assert rows["runtime dependencies"][-1].strip() == "tvm_ffi", written


@pytest.mark.parametrize("model", ["modernbert", "gemma3"])
def test_hf_attention_bench_times_three_implementations(tmp_path, model):
    """bench.hf_attention writes a row per pass and length with the three implementations' times
    (positive) and their ratios, for each model; an unknown pass is refused by name."""
    from bench import hf_attention

    assert (
        hf_attention.main(
            [
                "--model",
                model,
                "--seq-lens",
                "80",
                "--rounds",
                "1",
                "--layers",
                "2",
                "--no-memory",
                "--passes",
                "forward",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    written = next(tmp_path.glob(f"*-hf-{model}.md")).read_text()
    rows = [line.split("|")[1:-1] for line in written.splitlines() if line.startswith("| forward")]
    assert len(rows) == 1 and rows[0][1].strip() == "80" and rows[0][2].strip() == "80", written
    assert all(float(cell) > 0 for cell in rows[0][3:10])
    with pytest.raises(SystemExit):
        hf_attention.main(["--passes", "generation"])
    plot = next(tmp_path.glob(f"*-hf-{model}.png"))
    plot.unlink()
    assert hf_attention.main(["--plot", str(plot.with_suffix(".csv"))]) == 0 and plot.stat().st_size > 0
    with pytest.raises(SystemExit):
        hf_attention.main(["--plot", str(tmp_path / "missing.csv")])


def test_hf_attention_bench_times_decode_steps(tmp_path):
    """The decode pass times --decode-tokens steps after a prefill (tokens per second from those
    steps), and is refused for an encoder."""
    from bench import hf_attention

    assert (
        hf_attention.main(
            [
                "--model",
                "gemma3",
                "--seq-lens",
                "70",
                "--rounds",
                "1",
                "--layers",
                "2",
                "--passes",
                "decode",
                "--decode-tokens",
                "3",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    written = next(tmp_path.glob("*-hf-gemma3.md")).read_text()
    rows = [line.split("|")[1:-1] for line in written.splitlines() if line.startswith("| decode")]
    assert len(rows) == 1 and [cell.strip() for cell in rows[0][1:3]] == ["70", "3"], written
    assert all(float(cell) > 0 for cell in rows[0][3:10])
    assert "--decode-tokens 3" in written
    with pytest.raises(SystemExit):
        hf_attention.main(["--model", "modernbert", "--passes", "decode"])


def test_grouped_heads_bench_times_both_calls(tmp_path, capsys):
    """bench.grouped_heads prints a row per pass and length with both calls' times (positive), and
    refuses query heads that are not a multiple of the key/value heads."""
    from bench import grouped_heads

    assert (
        grouped_heads.main(
            [
                "--seq-lens",
                "70",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--head-dim",
                "32",
                "--window",
                "8",
                "--rounds",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| forward")]
    assert [cells[0].strip() for cells in rows] == ["forward", "forward+backward"]
    assert all(float(cell) > 0 for cells in rows for cell in cells[2:5])
    assert next(tmp_path.glob("*-grouped-heads.md")).read_text().count("| forward") == 2
    with pytest.raises(SystemExit):
        grouped_heads.main(["--heads", "4", "--kv-heads", "3"])


def test_hf_attention_stub_keeps_the_projections_backward():
    """The stub's training step still reaches every parameter (its zero-cost attention passes zero
    gradients to the query, key and value), so it stays a lower bound for a kernel's step."""
    from bench import hf_attention

    model, inputs = hf_attention.build(40, 2, "float32")
    hf_attention.runner(model, "stub", inputs, "training step")()
    assert model.layers[1].attn.Wqkv.weight.grad is not None  # (layer 1: a sliding layer)
    assert all(parameter.grad is not None for parameter in model.parameters())


@pytest.mark.multiprocess
def test_distributed_bench_measures_one_process_and_two_ranks_and_writes(tmp_path):
    """bench.distributed: a layer's training step in one process and on two gloo ranks (tiny length),
    each rank's traffic counted (the halo: K and V rows forward, their gradients back), and its CSV,
    table (with the fit summary) and plot written."""
    from bench import distributed

    one = distributed.measure("layer", 1, 600, 1, 240)
    two = distributed.measure("layer", 2, 600, 1, 240)
    assert one["status"] == "ok" and two["status"] == "ok", (one, two)
    assert one["halo_kib_per_layer"] == 0 and one["peak_mib"] > 0
    # Each rank sends its neighbour w = 256 rows of K and V (768 float32 each) and their gradients back.
    assert two["halo_kib_per_layer"] == 2 * 2 * 256 * 768 * 4 / 1024 and two["other_kib_per_layer"] > 0
    distributed.write(
        [one, two],
        {"latency_us": 70.0, "bandwidth_gb_s": 1.5},
        tmp_path,
        "test-distributed",
        "python -m bench.distributed --quick",
        "a test",
        budget_gib=4,
    )
    table = (tmp_path / "test-distributed.md").read_text()
    assert "one process fits 600 tokens" in table and "two ranks 600" in table
    assert "| layer | 2 | " in table and (tmp_path / "test-distributed.png").stat().st_size > 0


def test_headline_plot_draws_local_attentions_forward_against_the_dense_ways(tmp_path):
    """The README's plot: from a `make bench` CSV, local attention's undilated forward, ours against full
    attention, sdpa and FlexAttention (not the band products, the dilated cases or sliding chunks)."""
    from bench import machine, report

    rows = report.read_csv(machine.RESULTS / "amd-epyc-avx512" / "amd-epyc-2cpu.csv")
    chosen = report.headline_rows(rows)
    assert {r["method"] for r in chosen} == set(report.HEADLINE_METHODS)
    assert {(r["op"], r["pass"], str(r["dilation"]), r["dtype"]) for r in chosen} == {
        ("local_attention", "forward", "1", "float32")
    }
    assert report.headline_plot(rows, tmp_path / "headline.png", "test") and (tmp_path / "headline.png").stat().st_size
    assert not report.headline_plot([r for r in rows if r["op"] != "local_attention"], tmp_path / "none.png", "test")
    assert not (tmp_path / "none.png").exists()
