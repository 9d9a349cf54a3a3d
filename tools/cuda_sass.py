"""The tensor-core CUDA kernels' machine code, without a GPU: registers, shared memory and SASS
instruction counts per kernel, for comparing a schedule change before a GPU can time it.

Generates the half types' fused forward and backward (``tvm_kernels/schedules/cuda/``) for one
architecture, compiles each with nvcc (``-Xptxas -v``) and disassembles it with cuobjdump, which
needs nvdisasm beside it (both in a CUDA toolkit; or unpacked from the PyPI wheels
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``, their ``nvidia/cu13/bin`` put on PATH):

    python tools/cuda_sass.py [--dtype bfloat16] [--arch sm_90] [--keep DIR]

Static counts: a kernel's code once, not what it executes (Nsight Compute's source page on a GPU,
tools/gpu_check.sh's ncu step, gives that); the dropout path and prologues count too.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tvm  # noqa: E402

from tvm_kernels.schedules import cuda  # noqa: E402

INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--keep", type=Path, help="write the .cu, .cubin and .sass files here")
    args = parser.parse_args()
    for tool in ("nvcc", "cuobjdump", "nvdisasm"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not on PATH (see this script's docstring)")
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch}, host={"kind": "llvm"})
    # (The backward, a PrimFunc of two kernels, without TVM's CSE, as the build does: tests/cuda_on_cpu.py.)
    functions = {
        "attention": (cuda.attention_mma(args.dtype, False), {}),
        "attention_backward": (cuda.attention_backward(args.dtype, False), {"tirx.disable_cse_tir": True}),
    }
    directory = args.keep or Path(tempfile.mkdtemp(prefix="cuda_sass_"))
    directory.mkdir(parents=True, exist_ok=True)
    for name, (function, config) in functions.items():
        with tvm.transform.PassContext(config=config):
            module = tvm.compile(tvm.IRModule({name: function.with_attr("global_symbol", name)}), target=target)
        source = directory / f"{name}.cu"
        source.write_text(module.mod.imports[0].inspect_source())
        cubin = source.with_suffix(".cubin")
        built = subprocess.run(
            ["nvcc", "-cubin", f"-arch={args.arch}", "-O3", "-Xptxas", "-v", "-o", cubin, source],
            capture_output=True,
            text=True,
        )
        if built.returncode:
            print(built.stderr)
            return 1
        for line in built.stderr.splitlines():
            if "Compiling entry" in line or "Used" in line:
                print(line.replace("ptxas info    : ", ""))
        sass = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
        source.with_suffix(".sass").write_text(sass)
        kernel, counts = None, collections.defaultdict(collections.Counter)
        for line in sass.splitlines():
            found = re.search(r"Function : (\S+)", line)
            if found:
                kernel = found.group(1)
            elif kernel and (found := INSTRUCTION.match(line)):
                counts[kernel][found.group(1)] += 1
        for kernel, count in counts.items():
            top = ", ".join(f"{op} {n}" for op, n in count.most_common(10))
            print(f"  {kernel}: {sum(count.values())} instructions ({top})")
    print(f"sources, cubins and SASS in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
