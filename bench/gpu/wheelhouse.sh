#!/usr/bin/env bash
# Fill a git-ignored folder with every wheel `poplar-bench gpu` needs on a GPU machine without
# network (Python 3.12, manylinux x86_64, torch already installed): DeepSpeed built as a pure
# wheel (no CUDA ops compiled), its dependencies the image lacks, pytest for the GPU test tier,
# and poplar-ext's own wheel from this checkout. Run it here, where the registries answer;
# bench/gpu/run_on_gpu.sh installs the folder on the GPU machine.
#
#   bench/gpu/wheelhouse.sh [FOLDER]      (default: .gpu-wheelhouse in the repository root)
#
# Filled again, this run's wheels take the place of every version of their packages there.
set -euo pipefail

case "${1:-}" in
    -h | --help)  # this file's opening comment
        sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
        exit 0
        ;;
    -*)
        echo "wheelhouse.sh: FOLDER: expected the folder to fill, found the option $1" >&2
        echo "usage: bench/gpu/wheelhouse.sh [FOLDER]" >&2
        exit 2
        ;;
esac
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:-$REPO/.gpu-wheelhouse}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
DEEPSPEED_VERSION=0.19.8
mkdir -p "$OUT"
# This run's wheels are made in a folder of their own, then replace every version of theirs in $OUT: a package
# released since the last fill would otherwise sit beside its older wheel, and pip, given two versions of one
# package, installs nothing on the GPU machine.
NEW="$(mktemp -d)"
COPY="$(mktemp -d)"
trap 'rm -rf "$NEW" "$COPY"' EXIT

# DeepSpeed from its source distribution: DS_BUILD_OPS=0 compiles nothing at build time, so the
# wheel is pure Python and installs under any CPython; its ops would be JIT-built on first use,
# which the GPU run avoids (torch's Adam, no fused kernels).
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --no-deps --no-build-isolation -w "$NEW" "deepspeed==$DEEPSPEED_VERSION"

# What the GPU image lacks (it has torch, numpy, scipy, matplotlib, ninja, py-cpuinfo, psutil,
# msgpack, transformers): binary wheels for the target interpreter, whatever Python runs here.
"$PYTHON" -m pip download --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$NEW" \
    hjson "pydantic>=2,<3" pydantic-core annotated-types typing-inspection typing-extensions einops tqdm \
    packaging pytest pluggy iniconfig pygments

# pydantic pins one pydantic-core: the one downloaded above must be it.
"$PYTHON" - "$NEW" <<'PY'
import re, sys, zipfile
from pathlib import Path

out = Path(sys.argv[1])
pydantic = next(out.glob("pydantic-2*.whl"))
with zipfile.ZipFile(pydantic) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    pin = re.search(r"^Requires-Dist: pydantic-core==([\w.]+)", wheel.read(meta).decode(), re.M).group(1)
cores = sorted(p.name for p in out.glob("pydantic_core-*.whl"))
if not any(name.startswith(f"pydantic_core-{pin}-") for name in cores):
    sys.exit(f"wheelhouse: {pydantic.name} needs pydantic-core=={pin}, found {cores}")
PY

# poplar-ext itself, from this checkout's files (tracked and not ignored), built in a copy so that the
# build leaves no build/ or egg-info in the checkout; no dependencies (the image and the folder have them).
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar --ignore-failed-read -cf - 2>/dev/null) \
    | tar -xf - -C "$COPY"
"$PYTHON" -m pip wheel --no-deps --no-build-isolation -w "$NEW" "$COPY"

# Into $OUT, each in place of every version of its package there (wheels added by hand for other packages stay);
# then one version of each package, or the folder's name and the packages whose versions it holds twice.
"$PYTHON" - "$NEW" "$OUT" <<'PY'
import re, shutil, sys
from collections import defaultdict
from pathlib import Path

new, out = (Path(a) for a in sys.argv[1:])


def package(wheel: Path) -> str:
    return re.sub(r"[-_.]+", "_", wheel.name.split("-")[0]).lower()


made = {package(w) for w in new.glob("*.whl")}
for old in out.glob("*.whl"):
    if package(old) in made:
        old.unlink()
for wheel in new.glob("*.whl"):
    shutil.move(str(wheel), str(out / wheel.name))
versions = defaultdict(list)
for wheel in sorted(out.glob("*.whl")):
    versions[package(wheel)].append(wheel.name)
twice = {name: found for name, found in versions.items() if len(found) > 1}
if twice:
    sys.exit(
        f"wheelhouse: {out}: expected one wheel per package (pip installs none of them given two versions of one), "
        f"found {'; '.join(', '.join(found) for found in twice.values())}: remove all but one of each"
    )
PY
ls -l "$OUT"
