#!/bin/bash
# Every check of this folder, each output saved beside it as NAME.txt (about 7 minutes on 2 cores).
#   PYTHONPATH=<repo> bash bench/results/pipeline_feasibility/run_all.sh
set -u
cd "$(dirname "$0")"
run() { echo "== $1"; bash run.sh "$@" >/dev/null; grep -e RESULT -e raised -e refused -e "exit status" "$1.txt"; }
run check_0_baseline 4 check_0_baseline.py
run check_0_baseline_parameters 4 check_0_baseline.py --partition parameters
run check_1_explicit 4 check_1_splits.py --mode explicit
run check_1_uneven_stock 4 check_1_splits.py --mode uneven-stock
run check_1_uneven_plan 4 check_1_splits.py --mode uneven-plan
run check_1_hetero 4 check_1_splits.py --mode hetero
run check_2_share_zero0 4 check_2_micro_batches.py --weighting share
run check_2_none_zero0 4 check_2_micro_batches.py --weighting none
run check_3_zero1 4 check_3_zero.py --zero 1
run check_3_zero2 4 check_3_zero.py --zero 2
run check_4_same_parts 4 check_4_checkpoint.py --load-parts 0,3,6
run check_4_other_parts 4 check_4_checkpoint.py --load-parts 0,2,6
run check_4_other_parts_module_only 4 check_4_checkpoint.py --load-parts 0,2,6 --module-only
run check_4_four_stages 4 check_4_checkpoint.py --load-parts 0,1,2,4,6
run check_4_four_stages_module_only 4 check_4_checkpoint.py --load-parts 0,1,2,4,6 --module-only
run check_4_silent_momentum 3 check_4_checkpoint.py --save-parts 0,1,3,6 --load-parts 0,2,4,6
run check_4_universal_other_parts 4 check_4_universal.py --load-parts 0,2,6
run check_4_universal_four_stages 4 check_4_universal.py --load-parts 0,1,2,4,6
run check_4_hetero_universal 4 check_4_hetero_universal.py
for layout in stock plan hetero; do for zero in 0 1; do
  run check_5_clipping_${layout}_zero$zero 4 check_5_clipping.py --zero $zero --layout $layout
done; done
rm -rf /tmp/pipe_feasibility_*
