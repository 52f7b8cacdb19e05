set -u
export PYTHONPATH=$PWD/src FUSEDMAXSIM_GIT_SHA=$SHA
nvidia-smi -L
T0=$(date +%s)
timeout 400 python3 benchmarks/probes approx_hits > $OUT/probe_approx_hits.log 2>&1; echo "probe rc $? $(( $(date +%s) - T0 )) s"
grep -v Warn $OUT/probe_approx_hits.log | grep -v "^  block" ; grep -A4 "hits; plan" $OUT/probe_approx_hits.log | grep block
