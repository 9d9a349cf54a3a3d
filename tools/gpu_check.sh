#!/usr/bin/env bash
# Everything the CUDA libraries need checked, on a bare GPU machine (issue 24): the CUDA tests, every
# kernel under compute-sanitizer (memcheck, racecheck), `python -m bench --device cuda` and the
# comparison with compiled FlexAttention, each step's log and exit code in one folder, a summary last.
#
#   tools/gpu_check.sh wheels        # here, with network: the wheels the GPU image lacks, into .whl/
#   tools/gpu_check.sh [OUTDIR]      # there, from the repository root (default: $OUT, else ./gpu-check)
#   STEPS="tests bench" tools/gpu_check.sh   # some steps only (a lent machine's call lasts 10 minutes)
#   LIMITS="tests=240 bench=270"             # seconds per step (killed past it; the others still run)
#   PYTEST_ARGS="-n 8" BENCH_ARGS="--seq-lens 4096 ..." FLEX_ARGS=... TESTS_M="gpu or multiprocess"   # replace defaults
#   STEPS=ncu tools/gpu_check.sh         # Nsight Compute on one forward and backward (PROFILE_ARGS: its case)
#   tools/gpu_check.sh baseline COMMIT...  # here: each COMMIT's tree into .baseline/NAME/ (carry .baseline):
#                                        # its kernels benched there too, right after ours (BASELINE_ARGS),
#                                        # so a change is measured against what it changed in one machine;
#                                        # NAME is COMMIT with / as - (results: <gpu>-baseline-NAME.*)
#
# Seen on an H200 (third run, bench/NOTES.md): tests 36 s (8 workers of 2 threads; with all 16
# threads each, over 220 s), memcheck 11 s, racecheck 52 s, the bench 70 s (its default cases,
# memory probes included); the flex step 371 s, nearly all of it compiling FlexAttention (190 s
# for its first compile): hence a step of its own. Fourth run: tests 30-39 s, memcheck 10-13 s,
# racecheck 40-47 s, and with BENCH_ARGS naming local_attention alone (--no-memory) the bench
# 12-18 s: ~2.3 device minutes a call with the start. For this workplace's lent machines (15 device
# minutes, 10 per call, at most 8 files back), two calls, ~10 device minutes with the start:
#   call 1 (timeout_s 590): LIMITS="tests=240 memcheck=60 racecheck=90 bench=200" tools/gpu_check.sh /tmp/gc;
#                           tar czf $OUT/gc.tgz -C /tmp gc
#   call 2, at once (a machine goes back 30 s idle): STEPS=flex LIMITS="flex=420" tools/gpu_check.sh /tmp/gc2; tar czf $OUT/gc2.tgz -C /tmp gc2
#
# The lent GPU machines have a CUDA build of torch and no network (/work/.library/device): nothing
# is pip-installed from an index there. What their image lacks (apache-tvm-ffi, which loads our
# libraries; pytest-reportlog, which writes each test's result as it finishes, so a step cut off by
# its limit still says which tests failed and why) travels as wheels in .whl/ (git-ignored; name it
# in the call's carry) and is installed into /tmp/site. Elsewhere (a CUDA workstation) have torch
# with CUDA and `pip install -e ".[test,bench]"`. Steps go on after a failure, so that one call
# shows everything; the exit code is non-zero if any step failed.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = "wheels" ]; then
    exec "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "apache-tvm-ffi==0.1.15.post2" "pytest-reportlog==1.0.0"  # tvm-ffi: pyproject.toml's pin
fi

if [ "${1:-}" = "baseline" ]; then  # trees of other commits, their CUDA libraries included (not their results,
    # tests or CPU libraries: a call carries 64 MiB at most, this checkout included)
    shift
    [ $# -gt 0 ] || { echo "usage: tools/gpu_check.sh baseline COMMIT..."; exit 2; }
    rm -rf .baseline && mkdir .baseline
    for commit in "$@"; do
        tree=".baseline/${commit//\//-}"
        mkdir "$tree" && git archive "$commit" -- . ":(exclude)bench/results" ":(exclude)tests" \
            ":(exclude)prebuilt/cpu-*" | tar -x -C "$tree" || exit 1
        git rev-parse --short "$commit" > "$tree/.source-commit"  # for its results' headers (bench/machine.py)
        echo "$tree: $(git rev-parse --short "$commit"), $(du -sh "$tree" | cut -f1)"
    done
    echo "carry .baseline with .whl ($(du -sh .baseline | cut -f1) in all)"
    exit 0
fi

out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
if ls .whl/*.whl > /dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/ failed"; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA GPU visible to $PYTHON's torch: nothing to check here"
    exit 1
fi

failed=0
STEPS=${STEPS:-gpu info tests memcheck racecheck bench overhead baseline}  # and flex (a second call), ncu
limit() {  # limit NAME: its seconds from $LIMITS (baseline-X: baseline's), 0 (none) if not named
    local kv
    for kv in ${LIMITS:-}; do [ "${kv%%=*}" = "${1%%-*}" ] && { echo "${kv#*=}"; return; }; done
    echo 0
}
step() {  # step NAME COMMAND...: if NAME is in $STEPS, run it, log to $out/NAME.log, record its exit code
    local name=$1; shift
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    local started=$SECONDS
    timeout "$(limit "$name")" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    printf "%-12s exit %3d  %5d s  %s\n" "$name" "$rc" "$((SECONDS - started))" "$out/$name.log" | tee -a "$out/summary.txt"
    [ "$rc" -eq 0 ] || failed=1
}

: > "$out/summary.txt"
step gpu nvidia-smi
step info "$PYTHON" -m longformer_ops.info
# The tests: in 8 processes of 2 threads where pytest-xdist is there (the lent machines: 16 cores;
# a process per core, each with torch's default of all cores, oversubscribes them), each result
# written to tests.jsonl as it finishes where pytest-reportlog is there.
if [ -z "${PYTEST_ARGS+set}" ]; then
    "$PYTHON" -c "import xdist" 2> /dev/null && PYTEST_ARGS="-n 8" && export OMP_NUM_THREADS=2
fi
"$PYTHON" -c "import pytest_reportlog" 2> /dev/null && PYTEST_ARGS="${PYTEST_ARGS:-} --report-log=$out/tests.jsonl"
# Those that use the GPU: marked `gpu` (as `make gpu-check` selects them).
step tests "$PYTHON" -m pytest -q -rfE -p no:cacheprovider tests -m "${TESTS_M:-gpu}" ${PYTEST_ARGS:-}
[ -f "$out/tests.jsonl" ] && "$PYTHON" tools/pytest_report_summary.py "$out/tests.jsonl" > "$out/tests-summary.txt"
unset OMP_NUM_THREADS
step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$PYTHON" tools/sanitize_cuda_kernels.py
step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$PYTHON" tools/sanitize_cuda_kernels.py
# Ours (fused; and as the three steps: the band products and torch's softmax) against transformers'
# sliding chunks, the band products too, both dtypes, undilated and dilated, both passes: 70 s on
# an H200. Full attention and SDPA with a mask: name them in BENCH_ARGS (results for them are in
# bench/results/nvidia-h200/nvidia-h200-attention.*). Then flex, whose compiles are slow, in bfloat16 (the
# dtype of issue 24's anchors; each case compiles anew).
step bench "$PYTHON" -m bench --device cuda --out "$out" ${BENCH_ARGS:---dtype float32,bfloat16 --seq-lens 16384 \
    --ops local_attention,qk_band,pv_band,transposed_band --methods tvm,tvm_steps_torch_softmax,sliding_chunks \
    --passes forward,forward+backward --dilated-passes forward,forward+backward --repeats 5}
# The per-call floor: each op's host time per call (kernel alone, custom op, public function,
# compiled) at a size whose kernels take microseconds (bench/overhead.py).
step overhead "$PYTHON" -m bench.overhead --device cuda --out "$out"
gpu_name=""
case " $STEPS " in  # (the results' name: only where the step runs, each import of torch costs device time)
    *" flex "* | *" baseline "*) gpu_name=$("$PYTHON" -c "from bench.machine import device_name; print(device_name('cuda'))") ;;
esac
# Other commits' kernels (.baseline/NAME/, if carried) on the cases of BASELINE_ARGS, one step each
# (baseline-NAME, run where STEPS names baseline): each its own tree, sources and bench, in a process
# of its own (the loader refuses libraries built from other sources).
for tree in .baseline/*/; do
    [ -d "$tree" ] || continue
    name=$(basename "$tree")
    case " $STEPS " in *" baseline "*) STEPS="$STEPS baseline-$name" ;; esac
    # (git must not find this checkout around the tree: its commit is not the tree's; older trees' bench
    # then says "commit ?", newer ones read .source-commit)
    step "baseline-$name" env -C "$tree" PYTHONPATH="/tmp/site:$PWD/$tree" GIT_CEILING_DIRECTORIES="$PWD/.baseline" \
        "$PYTHON" -m bench --device cuda \
        --out "$(realpath "$out")" --name "$gpu_name-baseline-$name" ${BASELINE_ARGS:---dtype bfloat16 \
        --seq-lens 16384 --ops local_attention --methods tvm --passes forward,forward+backward \
        --dilated-passes forward,forward+backward --repeats 5 --no-memory}
done
step flex "$PYTHON" -m bench --device cuda --out "$out" --name "$gpu_name-flex" ${FLEX_ARGS:---dtype bfloat16 \
    --seq-lens 16384 --ops local_attention --methods tvm,tvm_steps_torch_softmax,flex --passes forward,forward+backward \
    --dilated-passes forward,forward+backward --repeats 5 --no-memory}

# Nsight Compute on one steady-state forward and backward (tools/profile_cuda_attention.py; PROFILE_ARGS
# for another case), every section (`--set full`: each kernel replayed ~40 times, seconds in all),
# then the report as text: each kernel's details, and its SASS with the warp-stall samples per
# instruction (where the time goes inside it). An ncu step of its own: STEPS=ncu.
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | tail -n 1)
step ncu "${ncu_bin:-ncu}" --profile-from-start off --clock-control none --set full --import-source no -f \
    -o "$out/attention" "$PYTHON" tools/profile_cuda_attention.py ${PROFILE_ARGS:-}
if [ -f "$out/attention.ncu-rep" ]; then
    "$ncu_bin" -i "$out/attention.ncu-rep" --page details > "$out/ncu-details.txt" 2>&1
    "$ncu_bin" -i "$out/attention.ncu-rep" --page source --print-source sass --csv > "$out/ncu-sass.csv" 2>&1
fi

[ -f "$out/tests-summary.txt" ] && cat "$out/tests-summary.txt"
[ -f "$out/tests.log" ] && tail -n 5 "$out/tests.log"
[ -f "$out/bench.log" ] && tail -n 30 "$out/bench.log"
echo "== summary"
cat "$out/summary.txt"
exit $failed
