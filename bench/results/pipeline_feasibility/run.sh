#!/bin/bash
# Run one check under the deepspeed launcher and keep its output beside it.
#   bash run.sh OUTPUT_NAME NUM_RANKS SCRIPT [ARGS...]
# DeepSpeed's timestamped INFO/WARNING lines and the shm op build notices are dropped;
# everything the scripts print, and every traceback, is kept.
set -u
cd "$(dirname "$0")"
out=$1; n=$2; shift 2
port=$((29500 + RANDOM % 400))
cmd="deepspeed --num_gpus $n --master_port $port $*"
{
  echo "\$ PYTHONPATH=<repo> $cmd"
  timeout 600 $cmd 2>&1 | grep -v -e '^\[20[0-9][0-9]-' -e 'shm_comm_op built' -e '^\[rank[0-9]*\]:\[W'
  echo "exit status: ${PIPESTATUS[0]}"
} > "$out.txt"
# a rank that crashed leaves DeepSpeed's CPU all-reduce buffers (~69 MB each) in /dev/shm
rm -f /dev/shm/deepspeed_allreduce_buffer_*_"$port"_*
tail -5 "$out.txt"
