#!/usr/bin/env bash
# Everything the CUDA libraries need checked, in one go, on a bare GPU machine (issue 24): the CUDA
# tests, every kernel under compute-sanitizer (memcheck, racecheck) and `python -m bench --device
# cuda`, each step's log and exit code in one folder, a summary printed last.
#
#   tools/gpu_check.sh wheels        # here, with network: the wheels the GPU image lacks, into .whl/
#   tools/gpu_check.sh [OUTDIR]      # there, from the repository root (default: $OUT, else ./gpu-check)
#   STEPS="tests bench" tools/gpu_check.sh   # some steps only (a lent machine's call lasts 10 minutes)
#
# The lent GPU machines have a CUDA build of torch and no network (/work/.library/device): nothing
# is pip-installed from an index there. What their image lacks (apache-tvm-ffi, which loads our
# libraries) travels as wheels in .whl/ (git-ignored; name it in the call's carry) and is installed into
# /tmp/site. Elsewhere (a CUDA workstation) have torch with CUDA and `pip install -e ".[test,bench]"`.
# Steps go on after a failure, so that one call shows everything; the exit code is non-zero if any
# step failed.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = "wheels" ]; then
    exec "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "apache-tvm-ffi==0.1.15.post2"  # (the pin of pyproject.toml: the runtime is built against it)
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
STEPS=${STEPS:-gpu info tests memcheck racecheck bench}
step() {  # step NAME COMMAND...: if NAME is in $STEPS, run it, log to $out/NAME.log, record its exit code
    local name=$1; shift
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    local started=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    local rc=$?
    printf "%-12s exit %3d  %5d s  %s\n" "$name" "$rc" "$((SECONDS - started))" "$out/$name.log" | tee -a "$out/summary.txt"
    [ "$rc" -eq 0 ] || failed=1
}

: > "$out/summary.txt"
step gpu nvidia-smi
step info "$PYTHON" -m longformer_ops.info
step tests "$PYTHON" -m pytest -q -p no:cacheprovider tests -k "cuda or layer or model"
step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$PYTHON" tools/sanitize_cuda_kernels.py
step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$PYTHON" tools/sanitize_cuda_kernels.py
step bench "$PYTHON" -m bench --device cuda --out "$out"

[ -f "$out/tests.log" ] && tail -n 5 "$out/tests.log"
[ -f "$out/bench.log" ] && tail -n 30 "$out/bench.log"
echo "== summary"
cat "$out/summary.txt"
exit $failed
