#!/usr/bin/env bash
# The GPU lane's steps on a CUDA machine without network that keeps files between calls (the
# H200 of docs/GPU.md): one step per call, each well inside a 10-minute call.
#   send N    (here) put piece N of `gpu_wheelhouse.py build` (.gpulane/chunk-NN) alone into
#             .gpulane/send, the folder a call carries; then `recv` there; repeat for each N
#   recv      copy the wheelhouse pieces carried in .gpulane/send into ~/wh (once per piece)
#   install   join and install them into ~/site, vfleet's probe and plugin wheels from
#             build/wheels (`make wheels` here; carried), check the imports, then
#             flashinfer-cubin alone into ~/site-cubin if it was built (`build --with`)
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
send)
    n=${2:-}
    if ! [[ $n =~ ^[0-9]{1,2}$ ]]; then
        echo "send N: N is a piece number (1, 2, ...), got '$n'" >&2
        exit 2
    fi
    piece=.gpulane/chunk-$(printf %02d "$((10#$n))")
    if [ ! -f "$piece" ]; then
        echo "$piece: no such piece; make them with bench/gpu_wheelhouse.py build" >&2
        exit 2
    fi
    rm -rf .gpulane/send
    mkdir -p .gpulane/send
    cp "$piece" .gpulane/send/
    echo "$piece in .gpulane/send (of $(ls .gpulane/chunk-* | wc -l) pieces): carry .gpulane/send, run recv"
    ;;
recv)
    mkdir -p ~/wh
    cp .gpulane/send/chunk-* ~/wh/
    ls ~/wh | wc -l
    ;;
install)
    t0=$(date +%s)
    python3 bench/gpu_wheelhouse.py install --wheelhouse ~/wh --target $SITE --leave flashinfer-cubin
    if ! ls build/wheels/*.whl >/dev/null 2>&1; then
        echo "build/wheels: no wheels; run make wheels here and carry build/wheels" >&2
        exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --target $SITE build/wheels/*.whl
    PYTHONPATH=$SITE python3 -c 'import vllm, flashinfer; print("vllm", vllm.__version__, "flashinfer", flashinfer.__version__)'
    # nothing to install (exit 0) when flashinfer-cubin was not built
    python3 bench/gpu_wheelhouse.py install --wheelhouse ~/wh --target ~/site-cubin --only flashinfer-cubin
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
