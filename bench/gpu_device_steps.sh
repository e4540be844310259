#!/usr/bin/env bash
# The GPU lane's steps on a CUDA machine without network that keeps files between calls (the
# H200 of docs/GPU.md): one step per call, each well inside a 10-minute call.
#   send N    (here) put piece N of `gpu_wheelhouse.py build` (.gpulane/chunk-NN) alone into
#             .gpulane/send, the folder a call carries; then `recv` there; repeat for each N
#   recv [DIR] copy the wheelhouse pieces carried in DIR (default .gpulane/send) into ~/wh
#   stage     (here) each piece N alone in .gpulane/sN, so that the N calls of `recv
#             .gpulane/sN` need no step here between them
#   pack      (here) .gpulane/repo.tar (the code `snap` unpacks there: src, bench without
#             results, profiles, healthcheck, plugin, templates, pyproject.toml, build/wheels)
#             and .gpulane/tools.tar (this machine's nginx and ssh-keygen with the libraries
#             `ldd` lists for them, which `tools` installs there)
#   install   join and install them into ~/site, vfleet's probe and plugin wheels from
#             build/wheels (`make wheels` here; carried), check the imports, then
#             flashinfer-cubin alone into ~/site-cubin if it was built (`build --with`)
#   tiny      plugin-off (a fresh host's cold start) then plugin-on-covered, tiny model
#   caches    carried-same and warm restarts, then a cold start with flashinfer-cubin
#   cold      a cold start without flashinfer-cubin (the side-by-side of the cubin one)
#   mid       build the mid-size model, then plugin-off and plugin-on-covered on it
#   real MODEL [CONFIGS] [SECONDS]
#             a preset of a real checkpoint (qwen3.6-27b-fp8, ...) at its own size with
#             random weights (lane --dummy-weights: a config-only folder in ~/models/MODEL),
#             configurations CONFIGS (default real), stopped after SECONDS (default 560)
#   awq [SECONDS]
#             real for both AWQ presets, one after the other, within SECONDS (default 570)
#   scale [SECONDS]
#             issue 31's real-scale sequence within SECONDS (default 1300), each lane run
#             skipped when the time left is under what it needs: qwen3.6-27b-fp8 real +
#             real-restart (cold, then warm), qwen3.8-27b-awq-mtp real + real-restart,
#             qwen3.6-27b-fp8 real-no-mtp (single-stream decode), qwen3.6-27b-awq-int4 real +
#             real-restart, then the plugin off/on interleaved on qwen3.8-27b-awq-mtp
#   bg STEP [ARGS]
#             run STEP detached (setsid: it outlasts the call; ~/bg/out is its $OUT), so that
#             one step can run longer than a 10-minute call; then `wait` in each later call
#   wait [SECONDS]
#             until the detached step ends or SECONDS pass (default 540); its log, its state
#             and a tar of what it wrote so far (results.tar.gz) into $OUT
#   tools [TAR] unpack a carried tar of binaries from the control machine (default
#             .gpulane/tools.tar: nginx and ssh-keygen with their libraries, which the GPU image
#             lacks) into ~/tools; a wrapper sets LD_LIBRARY_PATH only where the image's own
#             libraries do not satisfy a binary; then each binary's version as a check; and
#             bench/device_ansible's stand-ins for the two Ansible calls vfleet makes, beside
#             python3 (the image has no Ansible)
#   vswitch [SECONDS [UP ARGS]]
#             issue 32 with `vfleet switch` itself (bench/gpu_vswitch.py): up (tiny a + mid b,
#             nginx front, b the standby; UP ARGS go to `up`, e.g. --plugin-b off, or --pair
#             27b-awq --start-timeout 600 for the two AWQ 27B presets at their own size with
#             random weights), the switch sequence under load (SWITCH_ARGS=--wake-first in the
#             environment: `vfleet switch to --wake-first`), down; stopped by `timeout` after
#             SECONDS (default 800; the 27B pair on a fresh host needs about 1,100)
#   graphs MODEL [SECONDS]
#             issue 31 item 5 on a preset at its own size (dummy weights): single-stream decode
#             with PIECEWISE graphs (the render's default then) against FULL_AND_PIECEWISE, MTP off
#             (nomtp-piecewise, nomtp-full: greedy replies compared), then MTP 3 with TRITON_ATTN
#             and full decode graphs (mtp-triton-full) against its FlashInfer PIECEWISE default
#             (plugin-off); each skipped when the time left is under what it needs (default 700)
#   depths MODEL [SECONDS]
#             issue 31 item 5 on a preset at its own size (dummy weights): single-stream decode
#             at MTP 0, 1 and 3 with TRITON_ATTN and full decode graphs, then MTP 3 with the
#             plugin's pruned head (nomtp-triton-full, mtp1-triton-full, mtp-triton-full,
#             mtp-triton-full-pruned), each skipped when the time left is under what it needs
#             (default 900); then, on the control machine, `bench/decode_cost_check.py --lane`
#             on the lane.json files that come back
#   prune MODEL [SECONDS]
#             issue 31 item 6 on a preset at its own size (dummy weights): MTP 3 with full
#             decode graphs, vLLM's head against draft-prune's pruned head, interleaved (off,
#             on, off, on), each skipped when the time left is under what it needs (default 900)
#   variants MODEL [SECONDS]
#             issue 31 item 1 on a preset at its own size (dummy weights, DEBUG): the other
#             configurations per preset (real-32k, real-seqs-8, real-mtp1) and the a100-32g
#             profile's render with its planned KV pool (a100-emulated; qwen3.8-27b-awq-mtp and
#             qwen3.6-27b-awq-int4 fit an A100 32 GB, fp8 does not), one lane run each, each
#             skipped when the time left is under what it needs (default 700)
#   switchgraphs SECONDS [UP ARGS]
#             vswitch (UP ARGS to `up`: the tenth run's `--plugin-b off` is the hook-off control
#             inside `vfleet switch`), at most 720 s, then graphs qwen3.6-27b-awq-int4 with what
#             is left
#   seed [SECONDS]
#             issue 31 item 4 on qwen3.6-27b-awq-int4 (dummy weights): a cold start (lane
#             `real` on empty instance caches), then `caches --variants seeded,warm`: the caches
#             packed as a cache seed, all taken away, the seed unpacked, a start; then a warm
#             restart on the original caches; within SECONDS (default 700)
#   both SECONDS
#             vswitch, then seed with what is left of SECONDS (vswitch gets at most 800)
#   snap      unpack .gpulane/repo.tar (a tar of a worktree's src, bench, profiles, ...;
#             carried) into ~/lanerepo, so a detached step runs one fixed copy of the code
#             while later calls re-sync the checkout
# Results go to $OUT (the device tool's return folder) or ./out.
set -euo pipefail
SELF=$(readlink -f "$0")
cd "$(dirname "$SELF")/.."
OUT=${OUT:-out}
SITE=~/site
export PYTHONUNBUFFERED=1
lane() { PYTHONPATH=$SITE python3 bench/gpu_lane.py "$@"; }
# lane_each STEP MODEL SECONDS CONFIG:NEED...: one lane run per configuration on MODEL (dummy
# weights), each skipped when fewer than NEED of SECONDS are left, each ended by `timeout` at the
# deadline (the lane keeps what it measured and stops its server)
lane_each() {
    local step=$1 model=$2 secs=$3 end pair cfg need left out n
    shift 3
    end=$(($(date +%s) + secs))
    for pair in "$@"; do
        cfg=${pair%%:*} need=${pair##*:}
        left=$((end - $(date +%s)))
        if [ "$left" -lt "$need" ]; then
            echo "== $step $cfg: skipped, $left s left of $secs, it needs $need"
            continue
        fi
        echo "== $step $cfg: $model ($left s left) $(date -u +%H:%M:%S)"
        # a configuration named again (interleaved runs) gets a folder of its own
        out="$OUT/$step-$cfg" n=2
        while [ -e "$out" ]; do out="$OUT/$step-$cfg.$n" n=$((n + 1)); done
        timeout -k 30 -s TERM "$left" env PYTHONPATH=$SITE python3 bench/gpu_lane.py run \
            --out "$out" --model "$model" --dummy-weights \
            --model-dir ~/models/"$model" --only "$cfg" --repeats 3 --pythonpath $SITE \
            --start-timeout "$((left < 900 ? left : 900))" || echo "lane run $step $cfg: exit $?"
    done
    echo "== $step done $(date -u +%H:%M:%S)"
}
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
    # recv [DIR]: DIR is the carried folder (default .gpulane/send; `stage` makes .gpulane/sN)
    mkdir -p ~/wh
    cp "${2:-.gpulane/send}"/chunk-* ~/wh/
    ls ~/wh | wc -l
    ;;
stage)
    # (here) piece N alone in .gpulane/sN for every N, hard links: the device calls can then
    # follow each other without a step here between them (`recv .gpulane/sN`, carrying it)
    for piece in .gpulane/chunk-*; do
        n=$((10#${piece##*-}))
        rm -rf ".gpulane/s$n"
        mkdir -p ".gpulane/s$n"
        ln "$piece" ".gpulane/s$n/"
    done
    ls -d .gpulane/s[0-9]*
    ;;
pack)
    if ! ls build/wheels/*.whl >/dev/null 2>&1; then
        echo "build/wheels: no wheels; run make wheels first" >&2
        exit 2
    fi
    mkdir -p .gpulane
    tar -cf .gpulane/repo.tar --exclude=bench/results --exclude=__pycache__ \
        src profiles bench healthcheck plugin templates pyproject.toml build/wheels
    tdir=$(mktemp -d)
    mkdir -p "$tdir/bin" "$tdir/lib"
    for tool in nginx ssh-keygen; do
        path=$(command -v "$tool" || true)
        [ -n "$path" ] || path=/usr/sbin/$tool
        [ -x "$path" ] || { echo "$tool: not installed here (make deps installs it)" >&2; exit 2; }
        cp "$path" "$tdir/bin/"
        # the libraries it links, except the C library's own, which the image has
        ldd "$path" | awk '$3 ~ /^\// {print $3}' | grep -Ev '/(libc|libm|ld-linux[^/]*)\.so' \
            | while read -r lib; do cp -L "$lib" "$tdir/lib/" || exit 1; done
    done
    tar -cf .gpulane/tools.tar -C "$tdir" bin lib
    rm -rf "$tdir"
    ls -l .gpulane/repo.tar .gpulane/tools.tar
    tar -tf .gpulane/tools.tar | tr '\n' ' '; echo
    ;;
install)
    t0=$(date +%s)
    python3 bench/gpu_wheelhouse.py install --wheelhouse ~/wh --target $SITE --leave flashinfer-cubin
    if ! ls build/wheels/*.whl >/dev/null 2>&1; then
        echo "build/wheels: no wheels; run make wheels here and carry build/wheels" >&2
        exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --target $SITE build/wheels/*.whl
    PYTHONPATH=$SITE python3 -c 'import vllm, flashinfer, vfleet_healthcheck, vfleet_sm75; print("vllm", vllm.__version__, "flashinfer", flashinfer.__version__, "+ vfleet_healthcheck, vfleet_sm75")'
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
real)
    model=${2:?real MODEL [CONFIGS] [SECONDS]}
    only=${3:-real}
    secs=${4:-560}
    # `timeout` sends SIGTERM: the lane keeps what it measured, stops its server, writes lane.json
    timeout -k 30 -s TERM "$secs" env PYTHONPATH=$SITE python3 bench/gpu_lane.py run \
        --out "$OUT/$model-${only//,/_}" --model "$model" --dummy-weights \
        --model-dir ~/models/"$model" --only "$only" --repeats 3 --pythonpath $SITE \
        --start-timeout "$secs" || echo "lane run $model $only: exit $?"
    ;;
awq)
    t0=$(date +%s)
    secs=${2:-570}
    bash "$SELF" real qwen3.6-27b-awq-int4 real $((secs - 180))
    bash "$SELF" real qwen3.8-27b-awq-mtp real $((secs - ($(date +%s) - t0)))
    ;;
scale)
    secs=${2:-1300}
    end=$(($(date +%s) + secs))
    # real_run NAME MODEL CONFIGS NEED [LANE ARGS]: one lane run if NEED seconds are left, ended
    # by `timeout` at the deadline (the lane keeps what it measured and stops its server)
    real_run() {
        local name=$1 model=$2 only=$3 need=$4 left
        shift 4
        left=$((end - $(date +%s)))
        if [ "$left" -lt "$need" ]; then
            echo "== $name: skipped, $left s left of $secs, it needs $need"
            return 0
        fi
        echo "== $name: $model --only $only ($left s left) $(date -u +%H:%M:%S)"
        timeout -k 30 -s TERM "$left" env PYTHONPATH=$SITE python3 bench/gpu_lane.py run \
            --out "$OUT/$name" --model "$model" --dummy-weights --model-dir ~/models/"$model" \
            --only "$only" --pythonpath $SITE --start-timeout "$((left < 900 ? left : 900))" \
            --budget-s "$((left > 150 ? left - 150 : 1))" "$@" || echo "lane run $name: exit $?"
    }
    # vLLM 0.24.0's DeepGEMM warmup ("relax": every fp8 GEMM shape JIT-compiled at start) did
    # not fit a cold start in issue 31's first look; the fp8 runs skip it (the one setting
    # added to the render), DeepGEMM then compiles a shape at its first use
    fp8_env=extra_env.VLLM_DEEP_GEMM_WARMUP=skip
    real_run fp8 qwen3.6-27b-fp8 real,real-restart 0 --set "$fp8_env"
    real_run awq-mtp qwen3.8-27b-awq-mtp real,real-restart 300
    real_run fp8-no-mtp qwen3.6-27b-fp8 real-no-mtp 180 --set "$fp8_env" --repeats 3
    real_run awq-int4 qwen3.6-27b-awq-int4 real,real-restart 330
    real_run plugin qwen3.8-27b-awq-mtp plugin-off,plugin-on,plugin-off,plugin-on 300 --repeats 3
    echo "== scale done $(date -u +%H:%M:%S)"
    ;;
tools)
    tar_in=${2:-.gpulane/tools.tar}
    rm -rf ~/tools
    mkdir -p ~/tools/bin ~/tools/lib ~/tools/real
    tar -xf "$tar_in" -C ~/tools/real
    cp ~/tools/real/lib/* ~/tools/lib/
    for b in ~/tools/real/bin/*; do
        name=$(basename "$b")
        if ldd "$b" | grep -q 'not found'; then
            printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
                ~/tools/lib "$b" > ~/tools/bin/"$name"
            echo "$name: the image lacks some of its libraries, wrapped with LD_LIBRARY_PATH=~/tools/lib"
        else
            printf '#!/bin/sh\nexec %s "$@"\n' "$b" > ~/tools/bin/"$name"
            echo "$name: the image's own libraries suffice"
        fi
        chmod 755 ~/tools/bin/"$name"
    done
    ~/tools/bin/nginx -V 2>&1 | head -1
    ~/tools/bin/ssh-keygen -Y 2>&1 | head -2 || true
    # vfleet reads the inventory through Ansible (`ansible-inventory --host`, `ansible PATTERN
    # --list-hosts`) and looks for both beside its Python; the GPU image has no Ansible, so two
    # stand-ins for those two calls on a YAML inventory go there (bench/device_ansible)
    pydir=$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))')
    cp bench/device_ansible/ansible bench/device_ansible/ansible-inventory "$pydir/"
    chmod 755 "$pydir/ansible" "$pydir/ansible-inventory"
    echo "ansible stand-ins in $pydir"
    ;;
vswitch)
    secs=${2:-800}
    shift $(($# < 2 ? $# : 2))
    export PATH=~/tools/bin:$PATH PYTHONPATH=$SITE
    t0=$(date +%s)
    rc=0
    timeout -k 30 -s TERM "$secs" python3 bench/gpu_vswitch.py up --out "$OUT/vswitch" \
        --pythonpath $SITE --shared-cache "$@" || rc=$?
    echo "== vswitch up: exit $rc after $(($(date +%s) - t0)) s"
    left=$((secs - ($(date +%s) - t0)))
    if [ "$rc" = 0 ] && [ "$left" -gt 60 ]; then
        # shellcheck disable=SC2086  # SWITCH_ARGS: words for `gpu_vswitch.py switch`
        timeout -k 30 -s TERM "$left" python3 bench/gpu_vswitch.py switch --out "$OUT/vswitch" \
            --pythonpath $SITE --budget-s "$((left - 60))" ${SWITCH_ARGS:-} \
            || echo "== vswitch switch: exit $?"
    fi
    python3 bench/gpu_vswitch.py down --pythonpath $SITE || true
    # the engines' logs and nginx's
    tar -czf "$OUT/vswitch/logs.tar.gz" -C ~/vfleet-vswitch logs lb/logs inv.yml \
        instances/a/current/ instances/b/current/ 2>/dev/null || true
    echo "== vswitch done after $(($(date +%s) - t0)) s"
    ;;
seed)
    secs=${2:-700}
    export PATH=~/tools/bin:$PATH
    end=$(($(date +%s) + secs))
    m=qwen3.6-27b-awq-int4
    left=$((end - $(date +%s)))
    echo "== seed: cold start of $m ($left s left) $(date -u +%H:%M:%S)"
    timeout -k 30 -s TERM "$left" env PYTHONPATH=$SITE python3 bench/gpu_lane.py run \
        --out "$OUT/seed-cold" --model $m --dummy-weights --model-dir ~/models/$m \
        --only real --repeats 1 --pythonpath $SITE --start-timeout "$left" \
        || echo "lane run seed-cold: exit $?"
    left=$((end - $(date +%s)))
    if [ "$left" -lt 150 ]; then
        echo "== seed: seeded and warm skipped, $left s left"
        exit 0
    fi
    echo "== seed: seeded, then warm ($left s left) $(date -u +%H:%M:%S)"
    timeout -k 30 -s TERM "$left" env PYTHONPATH=$SITE python3 bench/gpu_lane.py caches \
        --out "$OUT/seed" --config real --variants seeded,warm --model $m --dummy-weights \
        --model-dir ~/models/$m --pythonpath $SITE --start-timeout 400 \
        || echo "lane caches seed: exit $?"
    echo "== seed done $(date -u +%H:%M:%S)"
    ;;
graphs)
    # one lane run per configuration (each its own start: the graph mode and the backend are
    # part of vLLM's compile key), the first a cold start where the host has no 27B caches
    lane_each graphs "${2:?graphs MODEL [SECONDS]}" "${3:-700}" \
        nomtp-piecewise:330 nomtp-full:160 mtp-triton-full:200 plugin-off:170
    ;;
depths)
    # the decode cost model's depths on one backend with full decode graphs (issue 31 item 5):
    # MTP off, 1 and 3, then 3 with the pruned head (their lane.json go to decode_cost_check
    # --lane on the control machine)
    lane_each depths "${2:?depths MODEL [SECONDS]}" "${3:-900}" \
        nomtp-triton-full:330 mtp1-triton-full:200 mtp-triton-full:200 mtp-triton-full-pruned:220
    ;;
prune)
    # the plugin's truth (issue 31 item 6): draft-prune's pruned head against vLLM's full head
    # with full decode graphs, interleaved off, on, off, on, so that neither side always starts
    # second from the other's compile artefacts (in GPU.md sections 7 and 9 the plugin-on side
    # always started second)
    lane_each prune "${2:?prune MODEL [SECONDS]}" "${3:-900}" \
        mtp-triton-full:330 mtp-triton-full-pruned:200 mtp-triton-full:180 \
        mtp-triton-full-pruned:180
    ;;
variants)
    # one lane run per configuration (a window, a batch or a depth is part of the compile key)
    lane_each variants "${2:?variants MODEL [SECONDS]}" "${3:-700}" \
        real-32k:330 real-seqs-8:170 real-mtp1:170 a100-emulated:200
    ;;
switchgraphs)
    secs=${2:?switchgraphs SECONDS [UP ARGS]}
    shift 2
    end=$(($(date +%s) + secs))
    v=$((secs - 480))
    [ "$v" -gt 720 ] && v=720
    bash "$SELF" vswitch "$v" "$@"
    bash "$SELF" graphs qwen3.6-27b-awq-int4 "$((end - $(date +%s)))"
    ;;
both)
    secs=${2:?both SECONDS}
    end=$(($(date +%s) + secs))
    v=$((secs - 450))
    [ "$v" -gt 800 ] && v=800
    bash "$SELF" vswitch "$v"
    bash "$SELF" seed "$((end - $(date +%s)))"
    ;;
bg)
    shift
    mkdir -p ~/bg
    if [ -f ~/bg/pid ] && kill -0 "$(cat ~/bg/pid)" 2>/dev/null; then
        echo "a detached step is running (pid $(cat ~/bg/pid)); wait for it" >&2
        exit 2
    fi
    rm -rf ~/bg/out ~/bg/rc
    mkdir -p ~/bg/out
    OUT=~/bg/out setsid nohup bash -c 'bash "$0" "$@"; echo $? > ~/bg/rc' "$SELF" "$@" \
        > ~/bg/log 2>&1 < /dev/null &
    echo $! > ~/bg/pid
    echo "detached: $* (pid $(cat ~/bg/pid)), log ~/bg/log, results ~/bg/out"
    ;;
wait)
    secs=${2:-540}
    t0=$(date +%s)
    pid=$(cat ~/bg/pid)
    while kill -0 "$pid" 2>/dev/null && [ $(($(date +%s) - t0)) -lt "$secs" ]; do
        sleep 5
    done
    mkdir -p "$OUT"
    cp ~/bg/log "$OUT/bg.log"
    if [ -f ~/bg/rc ]; then state="done, exit $(cat ~/bg/rc)"; else state=running; fi
    # results so far (lane.json, lane.md, logs.tar.gz of each run), in pieces of < 16 MiB
    tar -czf ~/bg/results.tar.gz -C ~/bg out
    rm -f "$OUT"/results.tar.gz*
    if [ "$(stat -c %s ~/bg/results.tar.gz)" -gt 15000000 ]; then
        split -b 15000000 -d ~/bg/results.tar.gz "$OUT/results.tar.gz."
    else
        cp ~/bg/results.tar.gz "$OUT/"
    fi
    echo "detached step: $state after $(($(date +%s) - t0)) s of waiting" | tee "$OUT/state"
    tail -n 25 ~/bg/log
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader || true
    ;;
snap)
    rm -rf ~/lanerepo
    mkdir -p ~/lanerepo
    tar -xf .gpulane/repo.tar -C ~/lanerepo
    sha256sum .gpulane/repo.tar
    ;;
*)
    echo "unknown step $1" >&2
    exit 2
    ;;
esac
