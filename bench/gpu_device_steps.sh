#!/usr/bin/env bash
# The GPU lane's steps on a CUDA machine without network that keeps files between calls (the
# H200 of docs/GPU.md): one step per call, each well inside a 10-minute call.
#   recv      copy the wheelhouse pieces carried in .gpulane/send into ~/wh (once per piece)
#   install   join and install them into ~/site (flashinfer-cubin alone into ~/site-cubin),
#             plus vfleet's probe and plugin wheels from build/wheels (carried)
#   tiny      plugin-off (a fresh host's cold start) then plugin-on-covered, tiny model
#   caches    carried-same and warm restarts, then a cold start with flashinfer-cubin
#   cold      a cold start without flashinfer-cubin (the side-by-side of the cubin one)
#   mid       build the mid-size model, then plugin-off and plugin-on-covered on it
# Results go to $OUT (the device tool's return folder) or ./out.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
SITE=~/site
export PYTHONUNBUFFERED=1
lane() { PYTHONPATH=$SITE python3 bench/gpu_lane.py "$@"; }
case "${1:?step}" in
recv)
    mkdir -p ~/wh
    cp .gpulane/send/chunk-* ~/wh/
    ls ~/wh | wc -l
    ;;
install)
    t0=$(date +%s)
    python3 bench/gpu_wheelhouse.py install --wheelhouse ~/wh --target $SITE --leave flashinfer-cubin
    python3 bench/gpu_wheelhouse.py install --wheelhouse ~/wh --target ~/site-cubin --only flashinfer-cubin
    python3 -m pip install -q --no-index --no-deps --target $SITE build/wheels/*.whl
    PYTHONPATH=$SITE python3 -c 'import vllm, flashinfer; print("vllm", vllm.__version__, "flashinfer", flashinfer.__version__)'
    echo "install took $(($(date +%s) - t0)) s"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
tiny)
    lane run --out "$OUT/tiny" --only plugin-off,plugin-on-covered --repeats 3 \
        --pythonpath $SITE --budget-s 480
    ;;
caches)
    lane caches --out "$OUT/caches" --variants carried-same,warm --pythonpath $SITE --budget-s 200
    lane caches --out "$OUT/cubin" --variants cold --pythonpath ~/site-cubin:$SITE
    ;;
cold)
    lane caches --out "$OUT/cold" --variants cold --pythonpath $SITE
    ;;
mid)
    # the lane builds the model from its preset first (it says how long that took)
    lane run --out "$OUT/mid" --model mid-hybrid-mtp --model-dir ~/models/mid-hybrid-mtp \
        --only plugin-off,plugin-on-covered --repeats 3 \
        --pythonpath $SITE --budget-s 420
    ;;
*)
    echo "unknown step $1" >&2
    exit 2
    ;;
esac
