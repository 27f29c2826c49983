#!/usr/bin/env bash
# The GPU check in one call: install what the GPU machine lacks from carried files, then run
# launch/gpu_check.py (oracle on CUDA, copy-hazard and pinned-memory tests, the step-time comparison),
# writing JSON results into OUTDIR as it goes and a log of everything to OUTDIR/gpu_check.log.
#
#   launch/gpu_check.sh OUTDIR [--smoke] [gpu_check.py options...]
#
# Prepared elsewhere with launch/gpu_wheels.sh (wheels + libaio .debs in .whl/, ignored by git); on the
# device tool: carry [".whl"], command `launch/gpu_check.sh $OUT`, timeout_s 540 (the script's own
# budget is 450 s from its start, installs included: gpu_check.py --budget-s). Without CUDA it runs the
# same sections at a tiny size on CPU (--smoke), which is how it is tested here (tests/test_gpu_check.py).
#
# Installs go to /tmp only: wheels into /tmp/aidaptiv_site (pip --target, --no-index --no-deps), the
# libaio .debs unpacked into /tmp/aidaptiv_libaio (dpkg-deb -x; never into /). The package itself is the
# working tree (PYTHONPATH), not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: launch/gpu_check.sh OUTDIR [--smoke] [gpu_check.py options]}
shift
mkdir -p "$OUT"
T0=$(date +%s)
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
: > "$LOG"
log() { echo "[gpu_check $(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

SITE=/tmp/aidaptiv_site
if "$PY" -c "import deepspeed, pydantic, hjson" >/dev/null 2>&1; then
    log "DeepSpeed and pydantic importable already: nothing to install"
elif ls .whl/*.whl >/dev/null 2>&1; then
    log "installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl >>"$LOG" 2>&1; then
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        export PATH="$SITE/bin:$PATH"
    else
        log "wheel install FAILED (see $LOG); going on with what is importable"
    fi
else
    log "DeepSpeed is not importable and no .whl/ was carried: run launch/gpu_wheels.sh where there is network"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

LIBAIO=()
if ls .whl/libaio/*.deb >/dev/null 2>&1; then
    root=/tmp/aidaptiv_libaio
    mkdir -p "$root"
    ok=1
    for f in .whl/libaio/*.deb; do
        if command -v dpkg-deb >/dev/null; then
            dpkg-deb -x "$f" "$root" || ok=0
        else  # a .deb is an ar archive holding data.tar.*
            (d=$(mktemp -d) && cd "$d" && ar x "$OLDPWD/$f" && tar -xf data.tar.* -C "$root") || ok=0
        fi
    done
    if [ "$ok" = 1 ] && [ -f "$root/usr/include/libaio.h" ]; then
        LIBAIO=(--libaio-root "$root")
        log "libaio unpacked into $root (for DeepSpeed's async_io JIT build)"
    else
        log "libaio .debs did not unpack: DeepSpeed native NVMe will use the pure-Python aio handle"
    fi
fi

log "running launch/gpu_check.py $OUT $*"
PYTHONUNBUFFERED=1 "$PY" launch/gpu_check.py "$OUT" --t0 "$T0" ${LIBAIO[@]+"${LIBAIO[@]}"} "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
log "done: exit code $rc; results: $(ls "$OUT" | tr '\n' ' ')"
exit "$rc"
