"""The CUDA kernels' generated source, run on the CPU: so that CI, which has no GPU, checks their
logic (tiles, packed rows, staging, synchronisation) against the references.

TVM lowers ``tvm_kernels/schedules/cuda/`` to CUDA C++; :func:`build` compiles that source with
the host C++ compiler and a small shim: each CUDA thread of a block is a fiber (``ucontext``) on
the calling thread, run until it reaches a barrier, then the next; ``__syncthreads`` switches back
to the shim's scheduler, which starts the next turn when every thread has reached it. The block's
``__shared__`` arrays (dynamic shared memory too) are statics (blocks run one after another), each
block launched with its kernel's ``__launch_bounds__``.
float32 only (the kernels' logic does not depend on the dtype; the half types' conversions are
TVM's): the half types' tensor-core kernels are built with float operands, and the shim emulates
their warp instructions (``mma.sync``, ``ldmatrix``, the quad shuffles) and 16-byte copies from the
layouts the kernels assume (which an H200 confirmed, bench/NOTES.md); ``cp.async`` copies are done
at once, or with ``ASYNC_ENV=deferred`` at the thread's wait (a read before it then sees stale
operands). What it cannot show: speed, races between threads that the barrier happens to order
(``make gpu-check``'s racecheck covers those on a GPU), and, unless built under AddressSanitizer,
accesses past an array that its 64-byte padding absorbs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SHIM = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <utility>
#include <vector>
#include <ucontext.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
static Dim3 threadIdx, blockIdx;
// A block's threads are fibers on the calling thread (ucontext), each run until it reaches a barrier
// (or the kernel's end), then the next: a barrier is a switch back to the scheduler, where a
// std::thread per CUDA thread paid a futex sleep and wake of every thread at every barrier.
// Blocks run one after another.
struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  bool done = false;
  void* fake_stack = nullptr;  // AddressSanitizer's, across the fiber's switches
};
constexpr size_t FIBER_STACK = 1 << 18;
static ucontext_t scheduler;
static std::vector<Fiber> fibers;
static const std::function<void()>* block_kernel;
#if defined(__SANITIZE_ADDRESS__)
// AddressSanitizer is told of every switch between stacks (it would otherwise take a fiber's frames
// for overflows of the scheduler's stack).
static const void* scheduler_stack;
static size_t scheduler_stack_size;
#define SWITCH_TO(save, bottom, size) __sanitizer_start_switch_fiber(save, bottom, size)
#define SWITCHED(save) __sanitizer_finish_switch_fiber(save, nullptr, nullptr)
#else
#define SWITCH_TO(save, bottom, size)
#define SWITCHED(save)
#endif
static void block_barrier_wait() {
  Fiber& me = fibers[threadIdx.x];
  SWITCH_TO(&me.fake_stack, scheduler_stack, scheduler_stack_size);
  swapcontext(&me.context, &scheduler);
  SWITCHED(me.fake_stack);
}
static void fiber_main() {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &scheduler_stack, &scheduler_stack_size);
#endif
  (*block_kernel)();
  fibers[threadIdx.x].done = true;
  SWITCH_TO(nullptr, scheduler_stack, scheduler_stack_size);  // (returns to the scheduler: uc_link)
}
#define __global__
#define __launch_bounds__(x)
#define __restrict__
#define __shared__ static
#define __syncthreads() block_barrier_wait()
#define CUDART_INF_F INFINITY
template <class A, class B> auto max(A a, B b) { return a > b ? a : (decltype(a + b))b; }
template <class A, class B> auto min(A a, B b) { return a < b ? a : (decltype(a + b))b; }
// mma.sync m16n8k16 for a warp (tvm_kernels/schedules/cuda/mma.py's fragment layout, float operands):
// every thread of the block calls it together; each publishes its fragments, then computes its
// accumulator elements from its warp's. An element's owner is the inverse of the kernel's mapping:
// A(row, k) is element k%2 + 2(row/8) + 4(k/8) of lane 4(row%8) + (k%8)/2; B(k, col) element
// k%2 + 2(k/8) of lane 4 col + (k%8)/2; C element i is (g + 8(i/2), 2t + i%2).
static float mma_a[1024][8], mma_b[1024][4];
static void longformer_mma_m16n8k16(float* c, const float* a, const float* b) {
  unsigned me = threadIdx.x, warp = me - me % 32, g = me % 32 / 4, t = me % 4;
  std::copy(a, a + 8, mma_a[me]);
  std::copy(b, b + 4, mma_b[me]);
  block_barrier_wait();
  for (unsigned i = 0; i < 4; ++i) {
    unsigned row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float sum = 0;
    for (unsigned k = 0; k < 16; ++k)
      sum += mma_a[warp + 4 * (row % 8) + k % 8 / 2][k % 2 + 2 * (row / 8) + 4 * (k / 8)]
           * mma_b[warp + 4 * col + k % 8 / 2][k % 2 + 2 * (k / 8)];
    c[i] += sum;
  }
  block_barrier_wait();
}
// A value's maximum and sum over the 4 lanes of a quad (__shfl_xor_sync by 1 and 2), likewise.
static float quad_values[1024];
static float quad_reduce(float x, bool sum) {
  unsigned me = threadIdx.x, quad = me - me % 4;
  quad_values[me] = x;
  block_barrier_wait();
  float result = quad_values[quad];
  for (unsigned lane = 1; lane < 4; ++lane)
    result = sum ? result + quad_values[quad + lane] : std::max(result, quad_values[quad + lane]);
  block_barrier_wait();
  return result;
}
static float longformer_quad_max(float x) { return quad_reduce(x, false); }
static float longformer_quad_sum(float x) { return quad_reduce(x, true); }
// ldmatrix.x4 (and .trans) likewise: each lane publishes the address of its row (row l % 8 of matrix
// l / 8), then takes elements (g, 2t + {0, 1}) of each matrix m into dst[2m], dst[2m + 1] (.trans:
// (2t + {0, 1}, g)), as the PTX ISA lays out the 16-bit case.
static const float* ldmatrix_rows[1024];
static void ldmatrix(float* dst, const float* src, bool transposed) {
  unsigned me = threadIdx.x, warp = me - me % 32, g = me % 32 / 4, t = me % 4;
  ldmatrix_rows[me] = src;
  block_barrier_wait();
  for (unsigned m = 0; m < 4; ++m)
    for (unsigned e = 0; e < 2; ++e)
      dst[2 * m + e] = transposed ? ldmatrix_rows[warp + 8 * m + 2 * t + e][g] : ldmatrix_rows[warp + 8 * m + g][2 * t + e];
  block_barrier_wait();
}
static void longformer_ldmatrix_x4(float* dst, const float* src) { ldmatrix(dst, src, false); }
static void longformer_ldmatrix_x4_trans(float* dst, const float* src) { ldmatrix(dst, src, true); }
// The staging's 16-byte copies: VECTOR (8) elements, here floats, from row `row` of a tensor whose
// row 0 is at row0 (rows row_bytes apart).
static const float* row_at(const float* row0, int row, int row_bytes) {
  return reinterpret_cast<const float*>(reinterpret_cast<const char*>(row0) + static_cast<long long>(row) * row_bytes);
}
static void longformer_copy16(float* dst, const float* row0, int row, int row_bytes) {
  const float* src = row_at(row0, row, row_bytes);
  std::copy(src, src + 8, dst);
}
static void longformer_zero16(float* dst) { std::fill(dst, dst + 8, 0.0f); }
// cp.async and its groups. By default each copy is done at once; built with
// LONGFORMER_ASYNC_DEFERRED (ASYNC_ENV=deferred), each thread's copies wait until its
// longformer_async_wait, the latest moment the instruction allows: a kernel that reads a copy's
// destination before waiting for it, or lets a later copy land on data still being read, then
// computes with the wrong operands in one of the two builds.
#ifdef LONGFORMER_ASYNC_DEFERRED
static std::vector<std::pair<float*, const float*>> async_pending[1024];  // per thread
static void longformer_copy16_async(float* dst, const float* row0, int row, int row_bytes) {
  async_pending[threadIdx.x].emplace_back(dst, row_at(row0, row, row_bytes));
}
static void longformer_async_wait() {
  for (auto& [dst, src] : async_pending[threadIdx.x]) std::copy(src, src + 8, dst);
  async_pending[threadIdx.x].clear();
}
#else
static void longformer_copy16_async(float* dst, const float* row0, int row, int row_bytes) {
  const float* src = row_at(row0, row, row_bytes);
  std::copy(src, src + 8, dst);
}
static void longformer_async_wait() {}
#endif
static void longformer_async_commit() {}
// 2^x: the tensor-core kernels' base-2 softmax (ex2.approx on the GPU).
static float longformer_exp2(float x) { return std::exp2(x); }
// The deltas' dot product of 8 elements (16 bytes of a half type on the GPU).
static float longformer_dot8(const float* a, const float* b) {
  float sum = 0;
  for (int i = 0; i < 8; ++i) sum += a[i] * b[i];
  return sum;
}
// Blocks (x fastest) one after another, each by `threads` fibers run in turns: in each turn every
// thread runs to its next barrier; a turn in which some threads end and others wait is a kernel
// whose threads would not meet at that barrier on a GPU either, and stops the process.
static void launch(int64_t grid_x, int64_t grid_y, unsigned threads, const std::function<void()>& kernel) {
  if (fibers.size() < threads) fibers.resize(threads);
  block_kernel = &kernel;
  for (int64_t y = 0; y < grid_y; ++y)
    for (int64_t x = 0; x < grid_x; ++x) {
      blockIdx.x = x; blockIdx.y = y;
      for (unsigned t = 0; t < threads; ++t) {
        Fiber& fiber = fibers[t];
        if (!fiber.stack) fiber.stack.reset(new char[FIBER_STACK]);
        getcontext(&fiber.context);
        fiber.context.uc_stack.ss_sp = fiber.stack.get();
        fiber.context.uc_stack.ss_size = FIBER_STACK;
        fiber.context.uc_link = &scheduler;
        makecontext(&fiber.context, fiber_main, 0);
        fiber.done = false;
      }
      for (unsigned ended = 0; ended < threads;) {
        ended = 0;
        for (unsigned t = 0; t < threads; ++t) {
          Fiber& fiber = fibers[t];
          if (!fiber.done) {
            threadIdx.x = t;
            void* save = nullptr;
            SWITCH_TO(&save, fiber.stack.get(), FIBER_STACK);
            swapcontext(&scheduler, &fiber.context);
            SWITCHED(save);
          }
          ended += fiber.done;
        }
        if (ended != 0 && ended != threads) {
          std::fprintf(stderr, "cuda_on_cpu: %u of a block's %u threads ended while the others wait at a barrier\n",
                       ended, threads);
          std::abort();
        }
      }
    }
}
"""

# Every argument a kernel may take, in the order of the C entry points ``run_<kernel>`` written below
# (each passes its kernel the ones it takes).
ARGUMENTS = [
    ("dilation", "int*"),
    ("out", "float*"),
    ("t1", "float*"),
    ("t2", "float*"),
    ("q", "float*"),
    ("k", "float*"),
    ("v", "float*"),
    ("key_bias", "float*"),
    ("lse", "float*"),
    ("grad", "float*"),
    ("grad_lse", "float*"),
    ("grad_q", "float*"),
    ("grad_k", "float*"),
    ("grad_v", "float*"),
    ("band", "int64_t"),
    ("batch", "int64_t"),
    ("head_dim", "int64_t"),
    ("heads", "int64_t"),
    ("kv_heads", "int64_t"),
    ("n", "int64_t"),
    ("padding", "double"),
    ("window", "int64_t"),
    ("scale", "double"),
    ("softcap", "double"),
    ("dropout", "double"),
    ("seed", "int64_t"),
]

# A PrimFunc of several kernels (the fused backward) is generated on its own without TVM's common
# subexpression elimination: with it, expressions its kernels share are computed by the host code
# and passed to them as extra parameters, and the host code is not C the harness could run.
_GENERATE = """
import json, sys
import tvm
from tvm_kernels.schedules import cuda
target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"}, host={"kind": "llvm"})
def source(ops, **config):
    functions = {f"{op}_{'causal' if a else 'symmetric'}": cuda.HAND_WRITTEN[op]("float32", a).with_attr(
        "global_symbol", f"{op}_{'causal' if a else 'symmetric'}") for op in ops for a in (False, True)}
    with tvm.transform.PassContext(config=config):
        code = tvm.compile(tvm.IRModule(functions), target=target).mod.imports[0].inspect_source()
    return code[code.index('extern "C" __global__'):]
several = ("attention_backward", "attention_backward_mma")
# The tensor-core kernels (the half types' on a GPU) with float operands and the shim's emulated mma.
cuda.HAND_WRITTEN["attention_mma"] = lambda dtype, a: cuda.attention_mma(dtype, a, operand_dtype=dtype)
cuda.HAND_WRITTEN["attention_backward_mma"] = lambda dtype, a: cuda.attention_backward(dtype, a, operand_dtype=dtype)
bodies = [source([op for op in cuda.HAND_WRITTEN if op not in several]),
          source(several, **{"tirx.disable_cse_tir": True})]
json.dump({"bodies": bodies, "tile_rows": cuda.TILE_ROWS, "dynamic_shared_bytes": cuda.dynamic_shared_bytes("float32")},
          open(sys.argv[1], "w"))
"""


SANITIZE_ENV = "CUDA_ON_CPU_SANITIZE"
ASYNC_ENV = "CUDA_ON_CPU_ASYNC"  # "deferred": cp.async copies done at the wait (the shim's note)
GENERATED_ENV = "CUDA_ON_CPU_GENERATED"  # a generate() output to reuse


def cxx_compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def asan_preload() -> str | None:
    """LD_PRELOAD for a process that loads a harness built under AddressSanitizer: the compiler's
    runtime, and the C++ library after it (without it, the runtime's exception interceptor finds
    no ``__cxa_throw`` and aborts); None if the compiler has no such runtime."""
    compiler = cxx_compiler()
    if compiler is None:
        return None
    found = [
        subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        for name in ("libasan.so", "libstdc++.so")
    ]
    return " ".join(found) if all(os.path.isabs(path) and os.path.exists(path) for path in found) else None


def generate(directory: Path) -> Path:
    """The kernels' CUDA source and launch geometry as ``directory/generated.json``, generated in a
    fresh process (the TVM compiler must stay out of the test process; about a minute), or the file
    ``GENERATED_ENV`` names (a test's own process under the sanitizer or with deferred copies reuses
    its parent's)."""
    if os.environ.get(GENERATED_ENV):
        return Path(os.environ[GENERATED_ENV])
    generated = directory / "generated.json"
    environment = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}  # (the sanitizer's)
    subprocess.run([sys.executable, "-c", _GENERATE, str(generated)], cwd=REPO, check=True, env=environment)
    return generated


def build(directory: Path, generated: Path) -> tuple[Path, dict]:
    """Compiles :func:`generate`'s source for the CPU in ``directory``; returns the library and the
    launch geometry."""
    info = json.loads(generated.read_text())
    body = "\n".join(info["bodies"])
    body = body.replace("__shared__ alignas(64)", "alignas(64) __shared__")  # attribute order C++ accepts
    # A kernel's dynamic shared memory (TVM merges its ``shared.dyn`` buffers into one array that the
    # launch sizes): a static array of the size the kernels' buffers add up to, so that
    # AddressSanitizer sees an access past them.
    body = re.sub(
        r"extern __shared__ __align__\((\d+)\) uchar (\w+)\[\];",
        rf"alignas(\1) static unsigned char \2[{info['dynamic_shared_bytes']}];",
        body,
    )
    launches: dict[str, list[str]] = {}  # a function's kernels in launch order (TVM: name_kernel, name_kernel_1, ...)
    for threads, name, suffix, parameters in re.findall(
        r"__global__ void __launch_bounds__\((\d+)\) (\w+?)_kernel(_\d+)?\(([^)]*)\) \{", body
    ):
        call = ", ".join(p.split()[-1].removesuffix("_ptr") for p in parameters.split(","))
        launches.setdefault(name, []).append(
            f"  launch((n + {info['tile_rows']} - 1) / {info['tile_rows']}, batch * heads, {threads},\n"
            f"         [&] {{ {name}_kernel{suffix}({call}); }});\n"
        )
    signature = ", ".join(f"{ctype} {arg}" for arg, ctype in ARGUMENTS)
    wrappers = [f'extern "C" void run_{name}({signature}) {{\n{"".join(calls)}}}\n' for name, calls in launches.items()]
    (directory / "kernels.cpp").write_text(SHIM + body + "\n".join(wrappers))
    library = directory / "kernels.so"
    # With SANITIZE_ENV=address, under AddressSanitizer: a kernel that reads or writes past one of its
    # arrays (a device function's pointer into a buffer TVM sized for less) fails however the
    # compiler laid the arrays out (the process must preload its runtime: :func:`asan_preload`).
    sanitize = ["-fsanitize=address", "-fno-omit-frame-pointer"] if os.environ.get(SANITIZE_ENV) == "address" else []
    deferred = ["-DLONGFORMER_ASYNC_DEFERRED"] if os.environ.get(ASYNC_ENV) == "deferred" else []
    subprocess.run(
        [
            cxx_compiler(),
            "-std=c++20",
            "-O1",
            "-fPIC",
            "-shared",
            "-pthread",
            *sanitize,
            *deferred,
            str(directory / "kernels.cpp"),
            "-o",
            str(library),
        ],
        check=True,
    )
    return library, info
