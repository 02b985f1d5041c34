#!/usr/bin/env bash
# One rank trains examples/pipeline_gpt.py on the GPU in DTYPE (bf16, fp16 or fp32), the cluster
# read from the hardware, its layer profiles measured first; the log's tail and the summary are
# printed. Run after bench/gpu/run_on_gpu.sh (whose .gpu-site/ it uses), from the repository root.
#
#   bench/gpu/pipeline_on_gpu.sh DTYPE
set -u
DTYPE="${1:?usage: bench/gpu/pipeline_on_gpu.sh bf16|fp16|fp32}"
case "$DTYPE" in
    bf16 | fp16 | fp32) ;;
    -h | --help)  # this file's opening comment
        sed -n '2,/^set -u/{/^set -u/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
        exit 0
        ;;
    *)  # another word would be a config key DeepSpeed ignores: the run would train fp32 under its name
        echo "pipeline_on_gpu.sh: DTYPE: expected bf16, fp16 or fp32, found '$DTYPE'" >&2
        echo "usage: bench/gpu/pipeline_on_gpu.sh bf16|fp16|fp32" >&2
        exit 2
        ;;
esac
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SITE="${POPLAR_GPU_SITE:-$REPO/.gpu-site}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1
WORK="$(mktemp -d)"
"$PYTHON" - "$REPO" "$WORK" "$DTYPE" <<'PY'
import json, sys
repo, work, dtype = sys.argv[1:]
config = json.load(open(f"{repo}/examples/ds_config_pipeline_gpt.json"))
config["poplar"].pop("cluster", None)  # each rank's GPU read from the hardware
config["poplar"]["profiles"] = f"{work}/profiles"
if dtype != "fp32":
    config[dtype] = {"enabled": True}
json.dump(config, open(f"{work}/ds.json", "w"))
PY
cd "$WORK"
start=$(date +%s)
timeout 150 "$PYTHON" -m torch.distributed.run --nproc_per_node 1 --master_port 29613 \
    "$REPO/examples/pipeline_gpt.py" --deepspeed_config "$WORK/ds.json" --steps 5 --layers 4 \
    --result "$WORK/result.json" > "$WORK/log" 2>&1
rc=$?
echo "pipeline_gpt on one GPU rank, $DTYPE: exit code $rc in $(( $(date +%s) - start )) s; transformers $("$PYTHON" -c "import transformers; print(transformers.__version__)")"
grep -E "poplar|Error|error" "$WORK/log" | tail -12
cat "$WORK/result.json" 2>/dev/null | tr -d ' \n'; echo
exit $rc
