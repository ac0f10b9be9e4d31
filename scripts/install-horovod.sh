#!/usr/bin/env bash
# Build and install Horovod for the torch installed here, for `--strategy horovod`.
#
# Horovod ships as source only and compiles against the installed torch. Its newest
# release (0.28.1) asks CMake for C++14, which the headers of torch >= 2.1 refuse, so this
# script sets C++17 in its two CMakeLists.txt; nothing else in its source is changed.
# CPU collectives go over Gloo (no MPI needed); on a GPU machine with NCCL, run it with
# HOROVOD_GPU_OPERATIONS=NCCL. The built wheel is kept in ~/.cache/gpufleet/ (one per
# Horovod, torch and Python version), so a second run installs it in seconds.
#
#   bash scripts/install-horovod.sh        # then: horovodrun -np 2 gpufleet train --strategy horovod
set -euo pipefail

version=0.28.1
python=${PYTHON:-python}
if "$python" -c "import horovod.torch" 2>/dev/null; then
    echo "Horovod is already importable here."
    exit 0
fi
for tool in cmake g++; do
    if ! command -v "$tool" >/dev/null; then
        echo "Horovod needs $tool to build: installing it with apt-get."
        apt-get update -qq && apt-get install -y -qq cmake g++ >/dev/null
    fi
done
tag=$("$python" -c "import sys, torch; print(f'torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}')")
cache="${XDG_CACHE_HOME:-$HOME/.cache}/gpufleet/horovod-$version-$tag-${HOROVOD_GPU_OPERATIONS:-cpu}"
if ! ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$python" -m pip download --quiet --no-deps --no-binary :all: "horovod==$version" -d "$work"
    tar xzf "$work/horovod-$version.tar.gz" -C "$work"
    src="$work/horovod-$version"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    echo "Building Horovod $version against $tag (about 4 minutes on 2 cores)..."
    mkdir -p "$cache"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI="${HOROVOD_WITHOUT_MPI:-1}" \
        MAKEFLAGS="-j$(nproc)" \
        "$python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$cache" "$src"
fi
"$python" -m pip install --quiet "$cache"/horovod-*.whl
"$python" -c "import horovod, horovod.torch as hvd; hvd.init(); print('Horovod', horovod.__version__, 'works: rank', hvd.rank(), 'of', hvd.size())"
