#!/usr/bin/env bash
# The whole GPU session in one go, run from anywhere inside the repository:
#   peer wheels from .whl/, the GPU test suite, `fusedmaxsim check`, the benchmark suite,
#   cold-start latencies, the op-level memory table, then every record and log copied to $OUT.
#
#   OUT=/some/dir bash benchmarks/run_h200.sh
#   STAGES="tests check ragged e2e" OUT=/some/dir bash benchmarks/run_h200.sh
#
# STAGES picks and orders the stages (default: tests check suite cold memory report); GPU_TESTS
# narrows the tests (pytest arguments). More stages are off by default: `probe`
# (benchmarks/probes/ with the sections named in PROBES), `fp32` (fp32 inputs: the default, TF32 and IEEE),
# `host` (benchmarks/bench_host.py), `ragged` (benchmarks/bench_ragged.py), `plaid` (the PLAID
# and distributed GPU tests, benchmarks/bench_plaid.py and bench_plaid_search.py, with fast-plaid's wheels from
# .whl/fastplaid/ when carried; PLAID_DOCS and PLAID_SCALE size the search corpora), `distributed`
# (benchmarks/bench_distributed.py on one GPU, then on every GPU of the machine)
# and `e2e` (the PyLate fine-tune of benchmarks/train_pylate_e2e.py, which needs its wheels in
# .whl/e2e/ and the fp16 model that `train_pylate_e2e.py --export-model .whl/minilm-fp16` writes).
#
# Each stage has a time cap, writes its own log, and cannot stop the stages after it; the caps
# also respect a budget for the whole session (SESSION_S, default 510 s). The records are
# written incrementally, so a stage cut short still leaves what it measured. Pass
# FUSEDMAXSIM_GIT_SHA=<sha> when the copy being benchmarked has no .git. For a dry run elsewhere:
# BENCH_SHAPES=quick RESULTS=/tmp/results SESSION_S=120 bash benchmarks/run_h200.sh
#
# $OUT receives run.log (stage summary), one log per stage, maxsim_bench.{json,md,png}, and with
# the extra stages ragged_bench.{json,md} and e2e/result.json.

set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || export PYTHONPATH=$PWD/src
# benchmarks/ holds the harness package (`harness`): importable by every stage's scripts, wherever
# they sit under benchmarks/.
export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks"

export PYTHONUNBUFFERED=1
export LIK_SUPPRESS_NORM_WARN=1
OUT="${OUT:-$(mktemp -d -t fusedmaxsim-gpu.XXXXXX)}"
RESULTS="${RESULTS:-benchmarks/results/h200}"
SHAPES="${BENCH_SHAPES:-all}"
SESSION_S="${SESSION_S:-510}"
STAGES="${STAGES:-tests check suite cold memory report}"
START=$SECONDS
mkdir -p "$OUT" "$RESULTS"
RUN_LOG="$OUT/run.log"
BENCH_LOG="$OUT/bench.log"
: > "$RUN_LOG"

note() {
    printf '[%4ds] %s\n' "$((SECONDS - START))" "$*" | tee -a "$RUN_LOG"
}

# stage NAME CAP_S LOG CMD...: runs CMD with output appended to LOG, for at most CAP_S seconds
# and never past the session budget; records how it ended in run.log.
stage() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((SESSION_S - (SECONDS - START)))
    if ((left < 20)); then
        note "$name: skipped, the session budget is spent"
        return 0
    fi
    ((cap > left)) && cap=$left
    note "$name: start (cap ${cap}s)"
    printf '\n===== %s: %s\n' "$name" "$*" >>"$log"
    local began=$SECONDS rc=0
    timeout -k 15 "$cap" "$@" >>"$log" 2>&1 || rc=$?
    local how="ok"
    if ((rc == 124 || rc == 137)); then
        how="TIMED OUT"
    elif ((rc != 0)); then
        how="exit $rc"
    fi
    note "$name: $how after $((SECONDS - began))s"
    return 0
}

note "output: $OUT; PYTHONPATH=$PYTHONPATH"
python3 - >>"$RUN_LOG" 2>&1 <<'EOF' || note "environment probe failed"
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for name in ("triton", "late_interaction_kernels", "flash_maxsim", "matplotlib", "pytest"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "unavailable:", type(exc).__name__, exc)
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >>"$RUN_LOG" 2>&1 || true

# pytest is not guaranteed on the GPU machine: fall back to the wheels carried in .whl/pytest/.
if ! python3 -c "import pytest" 2>/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-test .whl/pytest/*.whl >>"$RUN_LOG" 2>&1; then
        export PYTHONPATH="$PYTHONPATH:/tmp/site-test"
        note "pytest installed from .whl/pytest/"
    else
        note "pytest is missing and no wheels were carried in .whl/pytest/"
    fi
fi

# pytest-xdist spreads the GPU tests over processes (most of their time is compiling kernels).
XDIST=()
if ! python3 -c "import xdist" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-xdist .whl/pytest/pytest_xdist-*.whl .whl/pytest/execnet-*.whl >>"$RUN_LOG" 2>&1 &&
        export PYTHONPATH="$PYTHONPATH:/tmp/site-xdist"
fi
python3 -c "import xdist" 2>/dev/null && XDIST=(-n "${TEST_WORKERS:-8}")

BENCH=(python3 benchmarks/bench_maxsim.py --out "$RESULTS" --peers --warmup-ms 25 --rep-ms 100)

# The end-to-end fine-tune needs PyLate and the versions of its dependencies it was written
# against; datasets 5.x needs pyarrow >= 24, so an older pyarrow there gets datasets 4.4.
e2e() {
    local wheels=(.whl/e2e/new/*.whl)
    if ! python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)"; then
        wheels=($(ls .whl/e2e/new/*.whl | grep -v -E '/(datasets|dill|multiprocess)-') .whl/e2e/old/*.whl)
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-e2e "${wheels[@]}" &&
        PYTHONPATH="/tmp/site-e2e:$PYTHONPATH" python3 benchmarks/train_pylate_e2e.py \
            --model .whl/minilm-fp16 --device cuda --steps 50 --out "$OUT/e2e"
}
export -f e2e
export OUT

for name in $STAGES; do
    case $name in
    tests)
        # GPU_TESTS: pytest arguments (default: every test marked gpu).
        stage "gpu tests" "${TESTS_CAP:-240}" "$OUT/gpu_tests.log" python3 -m pytest -q -rf -p no:cacheprovider \
            "${XDIST[@]}" ${GPU_TESTS:--m gpu}
        ;;
    probe) stage "probe" "${PROBE_CAP:-240}" "$OUT/probe.log" python3 benchmarks/probes ${PROBES:-memory} ;;
    check) stage "check" "${CHECK_CAP:-150}" "$OUT/check.log" python3 -m fusedmaxsim check ;;
    suite)
        # The suite gets what the later stages leave (SUITE_RESERVE, default 225 s: cold start
        # 90, memory table 120, report 15), up to SUITE_MAX (default 300 s); it stops starting
        # new items 40 s before its cap.
        SUITE_CAP=$((SESSION_S - (SECONDS - START) - ${SUITE_RESERVE:-225}))
        ((SUITE_CAP > ${SUITE_MAX:-300})) && SUITE_CAP=${SUITE_MAX:-300}
        ((SUITE_CAP < 60)) && SUITE_CAP=60
        stage "benchmark suite" "$SUITE_CAP" "$BENCH_LOG" "${BENCH[@]}" --shapes "$SHAPES" \
            --budget-s $((SUITE_CAP - 40)) --compile-budget-s 45
        ;;
    cold) stage "cold start" 90 "$BENCH_LOG" "${BENCH[@]}" --shapes none --append --cold-start --cold-timeout-s 40 ;;
    # The memory table's peers tune themselves again at each batch size: 45 s held 7-12 of its 20 rows.
    memory) stage "memory table" "${MEMORY_CAP:-120}" "$BENCH_LOG" "${BENCH[@]}" --shapes none --append --memory-table ;;
    report) stage "report" 15 "$BENCH_LOG" "${BENCH[@]}" --shapes none --append --plot ;;
    ragged)
        stage "ragged" 150 "$OUT/ragged.log" python3 benchmarks/bench_ragged.py --out "$OUT" --rep-ms 100
        ;;
    e2e) stage "e2e" 200 "$OUT/e2e.log" bash -c e2e ;;
    host)
        # Off by default: benchmarks/bench_host.py, host_bench.{json,md} in $OUT/host/. Its budget
        # leaves 30 s of the cap (HOST_CAP, default 200 s) to what rounds do not bound (compiles).
        stage "host bench" "${HOST_CAP:-200}" "$OUT/host.log" python3 benchmarks/bench_host.py \
            --device cuda --out "$OUT/host" --budget-s $((${HOST_CAP:-200} - 30))
        ;;
    fp32)
        # Off by default: fp32 inputs on a few suite shapes, fusedmaxsim's default (tf32x3 under
        # PyTorch's default precision) beside TF32 (precision "high"), explicit IEEE and the peers;
        # in $OUT/fp32/.
        stage "fp32" "${FP32_CAP:-150}" "$OUT/fp32.log" python3 benchmarks/bench_maxsim.py \
            --out "$OUT/fp32" --dtype float32 --providers fusedmaxsim,fusedmaxsim_tf32,fusedmaxsim_ieee,lik,flash,naive \
            --shapes "${FP32_SHAPES:-rerank_colbert,rerank_colpali,batch_colbert,small_batch,train_colbert,train_colpali,train_small_batch,train_kd}" \
            --warmup-ms 25 --rep-ms 100 --budget-s $((${FP32_CAP:-150} - 30))
        ;;
    plaid)
        # fast-plaid's wheels are built per torch version: without them the search bench times
        # fusedmaxsim alone and the fast-plaid GPU test skips.
        if ls .whl/fastplaid/*.whl >/dev/null 2>&1; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --target /tmp/site-plaid .whl/fastplaid/*.whl >>"$RUN_LOG" 2>&1 &&
                export PYTHONPATH="$PYTHONPATH:/tmp/site-plaid"
        fi
        stage "plaid tests" "${PLAID_TESTS_CAP:-150}" "$OUT/gpu_plaid_tests.log" python3 -m pytest \
            -q -rf -s -p no:cacheprovider -m gpu tests/test_gpu_plaid.py \
            tests/test_gpu_plaid_approx.py tests/test_distributed.py
        stage "plaid kernels" "${PLAID_BENCH_CAP:-240}" "$OUT/plaid_bench.log" python3 \
            benchmarks/bench_plaid.py --out "$OUT"
        stage "plaid search" "${PLAID_SEARCH_CAP:-200}" "$OUT/plaid_search_bench.log" python3 \
            benchmarks/bench_plaid_search.py --out "$OUT" --docs "${PLAID_DOCS:-10000,100000}" \
            --scale "${PLAID_SCALE:-1000000}" --profile
        ;;
    distributed)
        # Sharded retrieval on 1 GPU, then on every GPU of the machine (a kind with several
        # H200s), into one record: $OUT/distributed_bench.{json,md}.
        GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
        COUNTS=1
        ((GPUS > 1)) && COUNTS="1 $GPUS"
        for n in $COUNTS; do
            stage "distributed x$n" "${DIST_CAP:-150}" "$OUT/distributed.log" env NCCL_NVLS_ENABLE=0 \
                python3 -m torch.distributed.run --nproc-per-node "$n" benchmarks/bench_distributed.py \
                --out "$OUT" ${DIST_ARGS:-}
        done
        ;;
    *) note "unknown stage: $name" ;;
    esac
done

for f in "$RESULTS"/maxsim_bench.json "$RESULTS"/maxsim_bench.md "$RESULTS"/maxsim_bench.png; do
    if [[ -f $f ]]; then cp -f "$f" "$OUT/"; else note "missing: $f"; fi
done
tail -n 3 "$OUT/gpu_tests.log" 2>/dev/null | sed 's/^/gpu tests | /'
[[ -f $OUT/maxsim_bench.md ]] && cat "$OUT/maxsim_bench.md"
note "done; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
