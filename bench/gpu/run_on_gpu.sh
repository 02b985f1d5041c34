#!/usr/bin/env bash
# `poplar-bench gpu` on the GPU machine, wheels installed first (no network there).
#
#   bench/gpu/run_on_gpu.sh OUTPUT_DIR [poplar-bench gpu's options: --budget-s S, --steps A,B, --dry-run]
#
# Run from the repository root of a copy of the working tree that carries .gpu-wheelhouse/ (filled
# here by bench/gpu/wheelhouse.sh). The wheels go into .gpu-site/ with --no-deps (the image's torch,
# numpy, scipy and matplotlib are used as they are); the working tree's own packages come first on
# PYTHONPATH, so that the code run is the tree's even when the wheelhouse's poplar-ext wheel is older.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WHEELS="${POPLAR_WHEELHOUSE:-$REPO/.gpu-wheelhouse}"
SITE="${POPLAR_GPU_SITE:-$REPO/.gpu-site}"
# The GPU image has python3 and may have no `python`.
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
if [ $# -lt 1 ]; then
    echo "usage: bench/gpu/run_on_gpu.sh OUTPUT_DIR [--budget-s S] [--steps A,B] [--dry-run]" >&2
    exit 2
fi
case "$1" in
    -h | --help)  # this file's opening comment; the run's options: poplar-bench gpu --help, docs/gpu.md
        sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
        echo "The options after OUTPUT_DIR are poplar-bench gpu's (poplar-bench gpu --help); see docs/gpu.md."
        exit 0
        ;;
    -*)
        echo "run_on_gpu.sh: OUTPUT_DIR: expected the output folder first, found the option $1" >&2
        echo "usage: bench/gpu/run_on_gpu.sh OUTPUT_DIR [--budget-s S] [--steps A,B] [--dry-run]" >&2
        exit 2
        ;;
esac
OUTPUT_DIR="$1"
shift

mkdir -p "$OUTPUT_DIR"
OUTPUT_DIR="$(cd "$OUTPUT_DIR" && pwd)"  # named from here: the run starts in the checkout
# An install that fails still returns what it said and which GPU it was (poplar-bench gpu never started).
trap 'status=$?; if [ $status -ne 0 ]; then { echo "run_on_gpu.sh: the wheel install failed (exit $status)";
    nvidia-smi 2>&1 || true; } >> "$OUTPUT_DIR/install_failed.txt"; fi' EXIT
# Fails with the folder's name when the wheelhouse was not carried (it is git-ignored), in install_failed.txt too.
if ! missing="$(ls "$WHEELS"/*.whl 2>&1 >/dev/null)"; then
    printf '%s\n' "$missing" "run_on_gpu.sh: $WHEELS: expected the wheels of bench/gpu/wheelhouse.sh, found none:" \
        "fill it where the package registries answer and carry it to this machine (.gpu-wheelhouse is git-ignored)" |
        tee -a "$OUTPUT_DIR/install_failed.txt" >&2
    exit 2
fi
if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" "$WHEELS"/*.whl \
        2> >(tee -a "$OUTPUT_DIR/install_failed.txt" >&2)
else
    # No pip in the image: a wheel is a zip of what goes into site-packages (the deepspeed launcher
    # script is then missing, and the tier's launcher test is skipped, saying so).
    "$PYTHON" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
        "$SITE" "$WHEELS"/*.whl
fi

# The checkout's packages, ahead of the wheelhouse's (older) poplar-ext wheel.
LINKS="$SITE/.tree"
mkdir -p "$LINKS"
rm -rf "$LINKS"/*
ln -sfn "$REPO/poplar_ext" "$LINKS/poplar_ext"
ln -sfn "$REPO/poplar_bench" "$LINKS/poplar_bench"

trap - EXIT
rm -f "$OUTPUT_DIR/install_failed.txt"  # pip's warnings of an install that went through
export PYTHONPATH="$LINKS:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"  # the deepspeed launcher, for the tier's launcher test
export DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 PYTORCH_NVML_BASED_CUDA_CHECK=1
cd "$REPO"
exec "$PYTHON" -m poplar_bench.cli gpu --output-dir "$OUTPUT_DIR" "$@"
