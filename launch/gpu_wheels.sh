#!/usr/bin/env bash
# Prepare, on a machine WITH network, what launch/gpu_check.sh installs on the lent GPU machine (which has
# none): the Python packages its image lacks, as wheels, and libaio for DeepSpeed's native NVMe baseline.
#
#   launch/gpu_wheels.sh [DIR]          # default DIR: .whl in the repository root (ignored by .gitignore)
#
# The GPU machine (docs: the device tool's KINDS.md) runs Python 3.12 on x86-64 with torch 2.11+cu130,
# transformers, numpy, safetensors, tqdm, psutil, packaging, einops, msgpack, ninja, py-cpuinfo,
# nvidia-ml-py, typing-extensions, pytest, hypothesis, accelerate; it has no DeepSpeed and no pydantic.
# What DeepSpeed 0.19.8 and aidaptiv_ds (setup.cfg install_requires) need beyond that:
#
#   deepspeed 0.19.8        an sdist: built here as a pure-Python wheel (DS_BUILD_OPS=0: no op is
#                           precompiled; the ones a run needs are JIT-built there, e.g. async_io)
#   hjson 3.1.0             DeepSpeed's config parser (pure Python)
#   pydantic 2.14.4 + pydantic-core 2.50.5 (cp312 manylinux) + annotated-types 0.8.0 +
#   typing-inspection 0.4.5 DeepSpeed's and aidaptiv_ds's config models
#   typing-extensions 4.16.0  pydantic 2.14 needs a recent one; the image's version is not known here,
#                           so a known one is carried (it shadows the image's in /tmp/site)
#   greenlet 3.5.6 (cp312 manylinux)  the layer-major forward's micro-batches (integration/layer_major.py)
#
# The versions are the ones this project's venv is tested with. One version of each: two of one
# package stop the whole `pip install --no-deps` there.
#
# libaio (libaio1 + libaio-dev .deb, Debian bookworm, ABI libaio.so.1) goes to DIR/libaio/: DeepSpeed's
# async_io op links -laio and includes libaio.h; gpu_check.sh unpacks them under /tmp (never into /)
# and points the build at them (aidaptiv_ds.bench.aio.aio_env --libaio-root).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
rm -f "$DIR"/*.whl

echo "[gpu_wheels] DeepSpeed 0.19.8: pure-Python wheel (DS_BUILD_OPS=0)"
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-cache-dir -w "$DIR" deepspeed==0.19.8

echo "[gpu_wheels] cp312 manylinux wheels"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR" \
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 greenlet==3.5.6

echo "[gpu_wheels] libaio (.deb, for DeepSpeed's async_io JIT build there)"
mkdir -p "$DIR/libaio" /tmp/aidaptiv_apt_lists/partial
rm -f "$DIR"/libaio/*.deb
apt_o=(-o Dir::State::Lists=/tmp/aidaptiv_apt_lists -o APT::Architecture=amd64 -o APT::Architectures=amd64)
if apt-get "${apt_o[@]}" -qq update && (cd "$DIR/libaio" && apt-get "${apt_o[@]}" -qq download libaio1 libaio-dev); then
    :
else
    echo "[gpu_wheels] libaio .debs not downloaded: DeepSpeed native NVMe will run on aidaptiv_ds's pure-Python aio there" >&2
fi

ls -la "$DIR" "$DIR/libaio"
du -sh "$DIR"
n=$(ls "$DIR"/*.whl | wc -l)
[ "$n" -eq 8 ] || { echo "[gpu_wheels] expected 8 wheels, got $n" >&2; exit 1; }
echo "[gpu_wheels] done: carry '$DIR' (the device tool's carry list) and run launch/gpu_check.sh OUTDIR there"
