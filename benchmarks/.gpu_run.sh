set -u
W=/tmp/s$RANDOM
python3 -m pip install -q --no-index --no-deps --no-compile --target $W .whl/*.whl .whl/fastplaid/*.whl 2>&1 | tail -2
export PYTHONPATH=$W:$PWD/src FUSEDMAXSIM_GIT_SHA=$SHA LIK_SUPPRESS_NORM_WARN=1
nvidia-smi -L
T0=$(date +%s)
timeout 200 python3 benchmarks/bench_plaid_search.py --out $OUT --docs 10000,100000 --scale 1000000 --profile > $OUT/plaid_search_bench.log 2>&1; echo "search rc $? $(( $(date +%s) - T0 )) s"
grep -v Warning $OUT/plaid_search_bench.log | grep -v "profile batch" | tail -12
timeout 60 python3 benchmarks/probes search_steps > $OUT/search_steps.log 2>&1; echo "probe rc $? $(( $(date +%s) - T0 )) s"
timeout 270 python3 benchmarks/bench_plaid.py --out $OUT --providers "fusedmaxsim,fusedmaxsim varlen,lik,lik varlen" > $OUT/plaid_bench.log 2>&1; echo "bench rc $? $(( $(date +%s) - T0 )) s"
grep -v Warning $OUT/plaid_bench.log | tail -40
