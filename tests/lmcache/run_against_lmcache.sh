#!/usr/bin/env bash
# Run the LMCache harness against LMCache's OWN MP server (the reference behaviour): the driver
# at TP=1, TP=2, MLA, MLA+TP=2 and TP=2 over two servers; with 0.5.6 also the edge-case probe and
# `lmcache bench server` via run_bench_client.py (both speak 0.5.6's protocol).  Starts its
# servers on free loopback ports with their own shared-memory names and stops them (and removes
# their segments) on exit.
#
#   tests/lmcache/run_against_lmcache.sh            # everything, LMCache 0.5.6
#   SCENARIO=full_hit tests/lmcache/run_against_lmcache.sh
#   LMCACHE=0.5.7rc3 tests/lmcache/run_against_lmcache.sh   # rc3's driver against rc3's server
#                                                           # (.ci/lmcache057-server-env)
#
# Exit status: 0 when every run passed.  Logs and JSON results go to $OUT (default a temp dir).
set -euo pipefail
cd "$(dirname "$0")/../.."

export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1
case "${LMCACHE:-0.5.6}" in
    0.5.6)
        VENV="$(.ci/lmcache-env | tail -n1)"
        SERVER=("$VENV/bin/python")
        ;;
    0.5.7rc3)
        VENV="$(.ci/lmcache057-env | tail -n1)"
        SERVER_VENV="$(.ci/lmcache057-server-env | tail -n1)"
        SERVER=(env PYTHONPATH="$SERVER_VENV/hook"
                LMCACHE056_NATIVE_SO="$SERVER_VENV/lmcache056/lmcache_native.cpython-311-x86_64-linux-gnu.so"
                "$SERVER_VENV/bin/python")
        ;;
    *) echo "LMCACHE must be 0.5.6 or 0.5.7rc3" >&2; exit 2 ;;
esac
PY="$VENV/bin/python"
OUT="${OUT:-$(mktemp -d /tmp/lmcache-harness.XXXXXX)}"
SCENARIO="${SCENARIO:-all,lock_release}"
L1_GB="${L1_GB:-0.25}"
mkdir -p "$OUT"
echo "results in $OUT" >&2

PIDS=()
SHMS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    local name
    for name in "${SHMS[@]}"; do rm -f "/dev/shm/lmcache_l1_pool_$name"; done
}
trap cleanup EXIT

free_port() {
    "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_server VAR: starts one LMCache MP server, stores its URL in VAR.
start_server() {
    local port metrics name log
    port="$(free_port)"
    metrics="$(free_port)"
    name="harness$$_$port"
    log="$OUT/server-$port.log"
    "${SERVER[@]}" -m lmcache.v1.multiprocess.server --host 127.0.0.1 --port "$port" \
        --supported-transfer-mode engine_driven --shm-name "$name" --l1-size-gb "$L1_GB" \
        --no-l1-use-lazy --eviction-policy LRU --max-workers 2 \
        --prometheus-port "$metrics" >"$log" 2>&1 &
    PIDS+=("$!")
    SHMS+=("$name")
    for _ in $(seq 600); do
        grep -q "cache server is running" "$log" && break
        kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "server died, see $log" >&2; exit 2; }
        sleep 0.1
    done
    grep -q "cache server is running" "$log" || { echo "server did not start, see $log" >&2; exit 2; }
    printf -v "$1" '%s' "tcp://127.0.0.1:$port"
}

start_server URL1
start_server URL2
echo "servers: $URL1 $URL2" >&2

failures=0
run() {
    local tag="$1"; shift
    local rc=0
    "$@" >"$OUT/$tag.out" 2>"$OUT/$tag.err" || rc=$?
    local verdict
    verdict="$(tail -n1 "$OUT/$tag.out")"
    if [[ $rc -eq 0 ]]; then
        echo "PASS $tag" >&2
    else
        echo "FAIL $tag (exit $rc): $(printf '%s' "$verdict" | cut -c1-400)" >&2
        failures=$((failures + 1))
    fi
}

D=(benchmarks/harness/driver.py --scenario "$SCENARIO" --l1-size-gb "$L1_GB")
run driver-tp1 "$PY" "${D[@]}" --url "$URL1" --tp 1
run driver-tp2 "$PY" "${D[@]}" --url "$URL1" --tp 2
run driver-mla "$PY" "${D[@]}" --url "$URL1" --mla
run driver-mla-tp2 "$PY" "${D[@]}" --url "$URL1" --mla --tp 2
run driver-tp2-2servers "$PY" "${D[@]}" --url "$URL1" "$URL2" --tp 2
if [[ "${LMCACHE:-0.5.6}" == 0.5.6 ]]; then
    run probe "$PY" tests/lmcache/probe_edges.py --url "$URL2"
    run bench-tp1 python3 tests/lmcache/run_bench_client.py --venv "$VENV" --rpc-url "$URL1" --requests 8
    run bench-tp2 python3 tests/lmcache/run_bench_client.py --venv "$VENV" --rpc-url "$URL1" --requests 8 --tp 2
    run bench-mla python3 tests/lmcache/run_bench_client.py --venv "$VENV" --rpc-url "$URL1" --requests 8 --mla
fi
echo "$failures failed" >&2
[[ $failures -eq 0 ]]
