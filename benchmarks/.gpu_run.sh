set -u
W=/tmp/s$RANDOM
python3 -m pip install -q --no-index --no-deps --no-compile --target $W .whl/*.whl .whl/fastplaid/*.whl 2>&1 | tail -2
export PYTHONPATH=$W:$PWD/src FUSEDMAXSIM_GIT_SHA=$SHA LIK_SUPPRESS_NORM_WARN=1
nvidia-smi -L
T0=$(date +%s)
timeout 200 python3 benchmarks/bench_plaid_search.py --out $OUT --docs 10000,100000 --scale 1000000 --profile > $OUT/plaid_search_bench.log 2>&1; echo "search rc $? $(( $(date +%s) - T0 )) s"
grep -v Warning $OUT/plaid_search_bench.log | grep "profile batch\|latency\|agreement\|scale:" | cut -c1-300
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_plaid.py tests/test_gpu_plaid_approx.py > $OUT/gpu_tests.log 2>&1; echo "tests rc $? $(( $(date +%s) - T0 )) s"
tail -4 $OUT/gpu_tests.log
