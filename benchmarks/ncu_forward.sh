#!/usr/bin/env bash
# Nsight Compute over benchmarks/ncu_forward.py (NOTES section 29), from the repository root:
#   OUT=/some/dir bash benchmarks/ncu_forward.sh
# NCU_ROWS picks the rows of the sections' pass (default: all), NCU_SRC_ROWS those of the stall
# samples per SASS line.
# Writes ncu_forward.txt (sections per kernel), ncu_src.log and src_sass.csv.gz (stall samples
# per SASS line of three rows), ncu_version.txt, ncu_metrics_all.txt.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src LIK_SUPPRESS_NORM_WARN=1
ncu --version > $OUT/ncu_version.txt 2>&1
ncu --query-metrics --chip gh100 > $OUT/ncu_metrics_all.txt 2>&1
MET=$(awk '{print $1}' $OUT/ncu_metrics_all.txt | grep -E '^(sm__pipe_tensor_op_gmma_cycles_active|sm__pipe_shared_cycles_active|sm__inst_executed_pipe_tensor_op_gmma)$' | sed 's/$/.avg.pct_of_peak_sustained_active/' | paste -sd, -)
echo "metrics: $MET" > $OUT/ncu_forward.txt
timeout 300 ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section InstructionStats ${MET:+--metrics $MET} python3 benchmarks/ncu_forward.py ${NCU_ROWS:-} >> $OUT/ncu_forward.txt 2>&1
echo "rc $?" >> $OUT/ncu_forward.txt
timeout 150 ncu --clock-control none --nvtx --nvtx-include "profile/" --section SourceCounters --section WarpStateStats --import-source no -o $OUT/src python3 benchmarks/ncu_forward.py ${NCU_SRC_ROWS:-batch_colbert train_colpali_fwd rerank_colpali_norm} > $OUT/ncu_src.log 2>&1
echo "rc $?" >> $OUT/ncu_src.log
timeout 60 ncu -i $OUT/src.ncu-rep --page source --print-source sass --csv > $OUT/src_sass.csv 2>>$OUT/ncu_src.log
gzip -f $OUT/src_sass.csv; rm -f $OUT/src.ncu-rep
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >> $OUT/ncu_version.txt
