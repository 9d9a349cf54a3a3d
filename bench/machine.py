"""Where a result comes from: the machine's name for results' file names, the machine kind whose
folder they go into (``bench/results/<kind>/``), this checkout's commit for their headers, and the
default memory budget of the CPU benches. Shared by every bench and the examples that write results."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

import torch


def device_name(device: str) -> str:
    """The GPU's or the CPU's model name and core count, lower-case with dashes (``amd-epyc-2cpu``)."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        model = next(
            (line.split(":", 1)[1] for line in open("/proc/cpuinfo") if line.startswith("model name")),
            platform.processor(),
        )
        name = f"{model}-{os.cpu_count()}cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cpu_results_name() -> str:
    """:func:`device_name` of the CPU with its vector ISA (the project's AMD machines come with AVX-512
    or AVX2 only, under the same model name), for the results' file names of the smaller benches."""
    from longformer_ops.runtime.loader import cpu_flags

    isa = "avx512" if "avx512f" in cpu_flags() else "avx2"
    name = device_name("cpu")
    return name.replace("-2cpu", f"-{isa}-2cpu") if name.endswith("-2cpu") else f"{name}-{isa}"


RESULTS = Path(__file__).resolve().parent / "results"

# (a /proc/cpuinfo flag, the kind's suffix), the first present wins: AMX (where Linux shows it; its
# CPUs also have AVX-512), AVX-512, AVX2.
_CPU_ISAS = (("amx_tile", "amx"), ("avx512f", "avx512"), ("avx2", "avx2"))


def machine_kind(device: str = "cpu") -> str:
    """The kind of machine a result was measured on, and the name of its folder in ``bench/results``:
    a GPU's model without its memory size (``nvidia-h100`` for ``nvidia-h100-80gb-hbm3``); a CPU's
    model without trademarks, "processor", clock and core count, with its widest vector ISA
    (``amd-epyc-avx512``, ``amd-epyc-avx2``, ``intel-xeon-amx``, ``intel-xeon-avx512``)."""
    if device.startswith("cuda"):
        return re.sub(r"-\d+gb(-.*)?$", "", device_name(device))
    from longformer_ops.runtime.loader import cpu_flags

    model = re.sub(r"-\d+cpu$", "", device_name("cpu"))
    model = re.sub(r"(-cpu)?-\d+-\d+ghz$", "", model)  # Intel's "CPU @ 2.70GHz"
    model = re.sub(r"-\d+-core(?=-|$)", "", model)  # AMD's "64-Core"
    words = [w for w in model.split("-") if w not in ("r", "tm", "processor", "cpu")]
    flags = cpu_flags()
    isa = next((suffix for flag, suffix in _CPU_ISAS if flag in flags), None)
    return "-".join(words + ([isa] if isa else [])) or "cpu"


def results_dir(device: str = "cpu") -> Path:
    """The default output folder of the benches' results: ``bench/results/<machine_kind(device)>``."""
    return RESULTS / machine_kind(device)


def source_commit() -> str:
    """This checkout's commit, ``-dirty`` when tracked files differ from it: for results' headers
    ("" outside a git checkout or without git). A tree made by ``tools/gpu_check.sh baseline`` (a
    ``git archive``, inside another checkout whose commit git would report) names its own."""
    archived = Path(__file__).resolve().parent.parent / ".source-commit"
    if archived.is_file():
        return archived.read_text().strip()
    try:
        return subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return ""


def default_cpu_memory_budget_bytes() -> float:
    """60% of the memory available now (MemAvailable): the default budget of the CPU benches."""
    available = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
    return 0.6 * available * 1024
