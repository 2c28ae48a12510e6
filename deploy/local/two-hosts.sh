#!/usr/bin/env bash
# two-hosts.sh: emulate a draft host and a verify host on one Linux machine, and run
# `sequoia bench` (or `sequoia demo`) across them. `sequoia bench --two-host` and
# `sequoia demo --two-host` run this script for you.
#
#   sudo deploy/local/two-hosts.sh [--mode bench|demo] [--rtt MS] [--bandwidth-mbps MBPS]
#                                  [--draft M] [--target M] [--out DIR]
#                                  [--delay auto|netem|proxy] [--auto-max-nodes N]
#                                  [--draft-cpus CPUS] [--verify-cpus CPUS]
#                                  [--draft-threads N] [--verify-threads N] [--bin DIR]
#                                  [-- BENCH OR DEMO ARGS...]
#
# CPUS is a taskset -c list ("0", "0-1", "0,2"); --draft-cpu/--verify-cpu are accepted too.
# Threads default to the number of CPUs in the host's set. --bandwidth-mbps caps the link rate
# per direction (0 = unlimited): netem's `rate`, or `sequoia net-delay --bandwidth-mbps`.
#
# Layout (two network namespaces joined by a veth pair):
#
#   namespace sqd-PID ("draft host", 10.77.0.2)          namespace sqv-PID ("verify host", 10.77.0.1)
#     draft-service  127.0.0.1:50051  draft CPUs           verify-service 0.0.0.0:50052  verify CPUs
#       └─ verify: via the delay (below) ───────────────▶   baseline draft-service 0.0.0.0:50061
#     sequoia bench / demo (client)                           verify CPUs, verify 127.0.0.1:50052
#
# The round-trip time between the hosts is raised by --rtt MS (0, 2, 10, 50, ...) and the link
# rate capped by --bandwidth-mbps: with `tc netem` where the kernel has it (MS/2 and the rate on
# each end of the veth), else with `sequoia net-delay` running in
# the draft namespace in front of the verify address (these VMs lack netem: "Specified qdisc kind
# is unknown"). The target-only baseline is plain target decoding on the verify host's core: the
# bench sends root-only trees to a draft-service next to verify-service (loopback, no delay, no
# draft forwards), so its numbers come from the same run, engine, core and process as the
# verification. All timings are taken inside the draft-services, so the bench client's own link
# does not enter them.
#
# MODELS: a .gguf path or a default model name (qwen2.5-coder-0.5b, qwen2.5-coder-1.5b,
# smollm2-135m), fetched with scripts/fetch-models.sh into $SEQUOIA_MODELS
# (default ~/.cache/sequoia/models). Binaries: cargo build --release --workspace.
# SERVICES_LOG sets the services' RUST_LOG (default info), e.g.
# SERVICES_LOG=info,draft_service::generation=debug for every step's time in draft-service.log.
# Everything (processes, namespaces, links) is torn down on exit, also on failure or Ctrl-C.
# Needs root (namespaces, veth), iproute2 and taskset.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
MODE_CMD=bench
RTT=0
BW=0
DRAFT=qwen2.5-coder-0.5b
TARGET=qwen2.5-coder-1.5b
OUT=""
DELAY=auto
AUTO_MAX_NODES=""
DRAFT_CPU=0
VERIFY_CPU=1
DRAFT_THREADS=""
VERIFY_THREADS=""
BIN="$ROOT/target/release"
BENCH_ARGS=()

usage() { sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "two-hosts: ERROR: $*" >&2; exit 1; }
log() { echo "two-hosts: $*" >&2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --mode) MODE_CMD="$2"; shift 2 ;;
        --rtt) RTT="$2"; shift 2 ;;
        --bandwidth-mbps) BW="$2"; shift 2 ;;
        --draft) DRAFT="$2"; shift 2 ;;
        --target) TARGET="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --delay) DELAY="$2"; shift 2 ;;
        --auto-max-nodes) AUTO_MAX_NODES="$2"; shift 2 ;;
        --draft-cpu|--draft-cpus) DRAFT_CPU="$2"; shift 2 ;;
        --verify-cpu|--verify-cpus) VERIFY_CPU="$2"; shift 2 ;;
        --draft-threads) DRAFT_THREADS="$2"; shift 2 ;;
        --verify-threads) VERIFY_THREADS="$2"; shift 2 ;;
        --bin) BIN="$2"; shift 2 ;;
        -h|--help) usage 0 ;;
        --) shift; BENCH_ARGS=("$@"); break ;;
        *) echo "unknown option $1" >&2; usage 2 ;;
    esac
done

[ "$(id -u)" = 0 ] || die "must run as root (network namespaces)"
command -v ip >/dev/null || die "iproute2 (ip) is missing"
command -v taskset >/dev/null || die "taskset (util-linux) is missing"
[[ "$RTT" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--rtt must be a number of milliseconds"
[[ "$BW" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--bandwidth-mbps must be a number (0 = unlimited)"
case "$MODE_CMD" in bench|demo) ;; *) die "--mode must be bench or demo" ;; esac
CPUS_RE='^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$'
[[ "$DRAFT_CPU" =~ $CPUS_RE ]] || die "--draft-cpus must be a CPU list like 0, 0-1 or 0,2"
[[ "$VERIFY_CPU" =~ $CPUS_RE ]] || die "--verify-cpus must be a CPU list like 1, 2-3 or 1,3"
# cpu_count LIST: how many CPUs a taskset -c list names.
cpu_count() {
    local n=0 part a b parts
    IFS=, read -ra parts <<<"$1"
    for part in "${parts[@]}"; do
        if [[ "$part" == *-* ]]; then
            a="${part%-*}"; b="${part#*-}"; n=$((n + b - a + 1))
        else
            n=$((n + 1))
        fi
    done
    echo "$n"
}
DRAFT_THREADS="${DRAFT_THREADS:-$(cpu_count "$DRAFT_CPU")}"
VERIFY_THREADS="${VERIFY_THREADS:-$(cpu_count "$VERIFY_CPU")}"
[[ "$DRAFT_THREADS" =~ ^[1-9][0-9]*$ ]] || die "--draft-threads must be a positive number"
[[ "$VERIFY_THREADS" =~ ^[1-9][0-9]*$ ]] || die "--verify-threads must be a positive number"
case "$DELAY" in auto|netem|proxy) ;; *) die "--delay must be auto, netem or proxy" ;; esac
for b in sequoia draft-service verify-service; do
    [ -x "$BIN/$b" ] || die "$BIN/$b not found; run: cargo build --release --workspace"
done
# bench-out/two-hosts-rtt10ms, two-hosts-demo-rtt10ms, two-hosts-rtt10ms-bw100mbps, ...
SUFFIX="rtt${RTT}ms"
awk -v x="$BW" 'BEGIN { exit !(x == 0) }' || SUFFIX="$SUFFIX-bw${BW}mbps"
[ "$MODE_CMD" = demo ] && SUFFIX="demo-$SUFFIX"
OUT="${OUT:-$ROOT/bench-out/two-hosts-$SUFFIX}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"

# A default model name is fetched (idempotent) and mapped to its file.
resolve_model() {
    local m="$1"
    if [ -e "$m" ]; then (cd "$(dirname "$m")" && echo "$PWD/$(basename "$m")"); return; fi
    local line file
    line="$(grep -E "^ *\"$m\|" "$ROOT/scripts/fetch-models.sh" | head -1)" \
        || die "model $m is neither a file nor a default model name"
    file="$(echo "$line" | cut -d'|' -f2)"
    local dir="${SEQUOIA_MODELS:-$HOME/.cache/sequoia/models}"
    bash "$ROOT/scripts/fetch-models.sh" "$dir" "$m" >&2
    echo "$dir/$file"
}
DRAFT_PATH="$(resolve_model "$DRAFT")"
TARGET_PATH="$(resolve_model "$TARGET")"

NS_D="sqd-$$"
NS_V="sqv-$$"
VETH_D="sqd$$"
VETH_V="sqv$$"
VERIFY_IP=10.77.0.1
DRAFT_IP=10.77.0.2
PIDS=()

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for pid in "${PIDS[@]:-}"; do
        [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]:-}"; do
        [ -n "$pid" ] || continue
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    ip netns del "$NS_D" 2>/dev/null || true
    ip netns del "$NS_V" 2>/dev/null || true
    ip link del "$VETH_D" 2>/dev/null || true
    ip link del "$VETH_V" 2>/dev/null || true
    [ "$rc" = 0 ] || log "failed (exit $rc); logs in $OUT/logs"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log "namespaces $NS_D (draft, $DRAFT_IP) and $NS_V (verify, $VERIFY_IP)"
ip netns add "$NS_D"
ip netns add "$NS_V"
ip link add "$VETH_D" type veth peer name "$VETH_V"
ip link set "$VETH_D" netns "$NS_D"
ip link set "$VETH_V" netns "$NS_V"
ip -n "$NS_D" addr add "$DRAFT_IP/24" dev "$VETH_D"
ip -n "$NS_V" addr add "$VERIFY_IP/24" dev "$VETH_V"
for ns in "$NS_D" "$NS_V"; do ip -n "$ns" link set lo up; done
ip -n "$NS_D" link set "$VETH_D" up
ip -n "$NS_V" link set "$VETH_V" up

# How the delay is injected.
MODE=none
is_zero() { awk -v x="$1" 'BEGIN { exit !(x == 0) }'; }
if ! is_zero "$RTT" || ! is_zero "$BW"; then
    HALF="$(awk -v r="$RTT" 'BEGIN { printf "%g", r / 2 }')"
    NETEM=(delay "${HALF}ms")
    is_zero "$BW" || NETEM+=(rate "${BW}mbit")
    if [ "$DELAY" != proxy ] \
        && ip netns exec "$NS_D" tc qdisc add dev "$VETH_D" root netem "${NETEM[@]}" 2>/dev/null \
        && ip netns exec "$NS_V" tc qdisc add dev "$VETH_V" root netem "${NETEM[@]}" 2>/dev/null; then
        MODE=netem
    elif [ "$DELAY" = netem ]; then
        die "tc netem is not available on this kernel (use --delay proxy)"
    else
        MODE=proxy
    fi
fi
BW_TEXT="unlimited"
is_zero "$BW" || BW_TEXT="${BW} Mbit/s"
log "added round-trip time: ${RTT} ms, bandwidth: $BW_TEXT (mode: $MODE)"

# start NAME NS CPU ENV... -- COMMAND...: run in a namespace, pinned, logging to $OUT/logs/NAME.log.
start() {
    local name="$1" ns="$2" cpu="$3"; shift 3
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    ip netns exec "$ns" env "${envs[@]}" taskset -c "$cpu" "$@" >"$OUT/logs/$name.log" 2>&1 &
    PIDS+=($!)
    log "started $name (pid $!, cpu $cpu)"
}

# wait_log NAME PATTERN: until the service logs PATTERN (it is then accepting requests).
wait_log() {
    local name="$1" pattern="$2" pid="${PIDS[-1]}"
    for _ in $(seq 1200); do
        grep -q "$pattern" "$OUT/logs/$name.log" 2>/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || { tail -20 "$OUT/logs/$name.log" >&2; die "$name exited"; }
        sleep 0.25
    done
    die "$name not ready after 300 s; see $OUT/logs/$name.log"
}

start verify-service "$NS_V" "$VERIFY_CPU" RUST_LOG="${SERVICES_LOG:-info}" -- \
    "$BIN/verify-service" --model "$TARGET_PATH" --listen 0.0.0.0:50052 --threads "$VERIFY_THREADS"
wait_log verify-service "verify-service listening"

start baseline-draft-service "$NS_V" "$VERIFY_CPU" RUST_LOG="${SERVICES_LOG:-info}" SEQUOIA_TREE__MODE=fixed -- \
    "$BIN/draft-service" --model "$DRAFT_PATH" --verify http://127.0.0.1:50052 \
    --listen 0.0.0.0:50061 --threads "$VERIFY_THREADS"
wait_log baseline-draft-service "draft-service listening"

VERIFY_URL="http://$VERIFY_IP:50052"
if [ "$MODE" = proxy ]; then
    start net-delay "$NS_D" "$DRAFT_CPU" RUST_LOG="${SERVICES_LOG:-info}" -- \
        "$BIN/sequoia" net-delay --listen 127.0.0.1:50099 --upstream "$VERIFY_IP:50052" \
        --delay-ms "$RTT" --bandwidth-mbps "$BW"
    wait_log net-delay "net-delay: 127.0.0.1:50099"
    VERIFY_URL="http://127.0.0.1:50099"
fi

DRAFT_ENV=(RUST_LOG="${SERVICES_LOG:-info}" SEQUOIA_TREE__MODE=auto)
[ -n "$AUTO_MAX_NODES" ] && DRAFT_ENV+=("SEQUOIA_TREE__NODES=$AUTO_MAX_NODES")
start draft-service "$NS_D" "$DRAFT_CPU" "${DRAFT_ENV[@]}" -- \
    "$BIN/draft-service" --model "$DRAFT_PATH" --verify "$VERIFY_URL" \
    --listen 127.0.0.1:50051 --threads "$DRAFT_THREADS"
wait_log draft-service "draft-service listening"

SETUP=(--draft-addr http://127.0.0.1:50051 --target-addr "http://$VERIFY_IP:50061"
    --draft "$DRAFT" --target "$TARGET" --rtt-ms "$RTT" --bandwidth-mbps "$BW"
    --draft-cpus "$DRAFT_CPU" --verify-cpus "$VERIFY_CPU"
    --draft-threads "$DRAFT_THREADS" --verify-threads "$VERIFY_THREADS")
LABEL="two hosts (network namespaces; draft CPUs $DRAFT_CPU, $DRAFT_THREADS threads; verify CPUs $VERIFY_CPU, $VERIFY_THREADS threads), RTT +${RTT} ms, bandwidth $BW_TEXT ($MODE)"
# A --label given to the bench describes the run; the setup above is appended to it, so the
# bench gets one --label (it refuses two).
REST=()
for ((i = 0; i < ${#BENCH_ARGS[@]}; i++)); do
    if [ "${BENCH_ARGS[$i]}" = --label ] && [ $((i + 1)) -lt ${#BENCH_ARGS[@]} ]; then
        LABEL="${BENCH_ARGS[$((i + 1))]}; $LABEL"
        i=$((i + 1))
    else
        REST+=("${BENCH_ARGS[$i]}")
    fi
done
BENCH_ARGS=("${REST[@]}")
cd "$ROOT" # relative paths in BENCH ARGS (e.g. --prompts) are relative to the repository
if [ "$MODE_CMD" = demo ]; then
    log "running the demo"
    # The client runs on the draft host's CPUs, next to the draft-service it talks to.
    ip netns exec "$NS_D" taskset -c "$DRAFT_CPU" "$BIN/sequoia" demo "${SETUP[@]}" \
        "${BENCH_ARGS[@]}"
    log "done; service logs in $OUT/logs"
else
    log "running the bench; results in $OUT"
    ip netns exec "$NS_D" "$BIN/sequoia" bench "${SETUP[@]}" \
        --label "$LABEL" \
        --out-dir "$OUT" \
        "${BENCH_ARGS[@]}"
    log "done; report: $OUT/report.md"
fi
