#!/usr/bin/env bash
# peer-llamacpp.sh: build llama.cpp (and optionally ik_llama.cpp) and benchmark it against this
# project's engine (`sequoia engine-bench`) on the same model, threads and machine, in one run.
#
# Usage: scripts/peer-llamacpp.sh [options]
#
#   --model NAME|PATH   model: a default name (qwen2.5-coder-1.5b, qwen2.5-coder-0.5b,
#                       smollm2-135m), a file name in the models folder, or a path to a .gguf
#                       (default: qwen2.5-coder-1.5b)
#   --threads T         CPU threads for every engine (default: 2)
#   --sizes LIST        n for t(n), comma-separated (default: 1,2,4,8,16,32)
#   --reps R            repetitions per test: llama-bench -r R, engine-bench --repeats R (default: 5)
#   --context C         committed context before each t(n) forward (default: 128; see below)
#   --tree sequoia|chain  tree shape for our t(n) (default: sequoia; see below)
#   --json OUT          also write all numbers as JSON to OUT
#   --ik-src DIR        ik_llama.cpp source checkout (same as IK_LLAMA_SRC=DIR)
#   --skip-build        use the existing builds; fail if one is missing
#   --only-build        build (or check the builds) and exit without benchmarking
#   --no-avx2           skip the AVX2-only llama.cpp build and its rows (the native build alone:
#                       half the build time on a small machine)
#   --no-sequoia        benchmark the peers only (no sequoia binary needed)
#   -h, --help          this text
#
# Environment:
#   SEQUOIA_PEER_DIR    cache for sources and builds (default: ~/.cache/sequoia/peer)
#   SEQUOIA_MODELS      models folder (default: ~/.cache/sequoia/models)
#   SEQUOIA_BIN         our binary (default: <repo>/target/release/sequoia)
#   IK_LLAMA_SRC        ik_llama.cpp source checkout; when set it is built (native only) and its
#                       llama-bench runs with -rtr 1 (run-time repacking)
#   LLAMA_CPP_PYTHON_VERSION  the llama-cpp-python sdist whose vendor/llama.cpp is built
#                       (default: pinned in scripts/lib/peer-common.sh)
#   PEER_JOBS           parallel compile jobs (default: 2); builds always run under nice -n 19
#
# Where llama.cpp comes from: only package registries are reachable from the build machines, and
# the llama-cpp-python sdist on PyPI vendors the full llama.cpp source (vendor/llama.cpp, with its
# git metadata, so the build reports its real commit). It is fetched with
#   pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==VERSION
# (`--no-binary llama-cpp-python` rather than `:all:`: the latter also forces the sdist's build
# backend and its own dependencies, cmake included, to be built from source just to read metadata).
#
# Builds (under $SEQUOIA_PEER_DIR/build/, each skipped on a rerun when its marker matches):
#   llama.cpp-VERSION-native  the widest ISA of this CPU: GGML_NATIVE=ON, except when
#                             /proc/cpuinfo lists AMX: a GGML_NATIVE=ON build faulted on an Intel VM
#                             with AMX, so there GGML_NATIVE=OFF with AVX-512 (+VNNI, +VBMI/BF16
#                             where listed) explicitly on and AMX off;
#   llama.cpp-VERSION-avx2    GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C/BMI2 on, AVX-512 and AVX-VNNI off;
#   ik_llama-NAME-native      only with IK_LLAMA_SRC, same ISA rule as "native".
# All: Release, static (BUILD_SHARED_LIBS=OFF), OpenMP at its default, no curl/openssl, no web UI
# download, no tests; only the tools later benchmarks need: llama-bench, llama-speculative-simple
# (llama-speculative in ik), llama-completion (llama-cli where there is no llama-completion) and
# llama-server.
#
# What is measured, and how the two sides line up:
#   decode tok/s   llama.cpp: llama-bench tg64 (64 tokens from an empty context);
#                  sequoia: engine-bench decode (median single-token step after C committed tokens).
#   pp512 tok/s    llama.cpp: llama-bench pp512 (one 512-token prompt, empty context);
#                  sequoia: prefill_tokens_per_second of an engine-bench run with --context 512
#                  (a single timed 512-token prefill).
#   t(n) ms        llama.cpp: n / (tok/s of llama-bench pp n) * 1000, with pp n run at depth C
#                  (llama-bench -d C) where that llama-bench has -d; otherwise at empty context
#                  (the table says which). sequoia: engine-bench t(n).ms_median, one tree-masked
#                  forward over n nodes after C committed tokens, logits for every node.
#   llama.cpp tok/s are taken from the median llama-bench sample (not its mean avg_ts, which is
#   kept in the JSON), to match engine-bench's medians and to resist a descheduled repetition.
#   Tree shape: llama-bench's pp n is a causal chain of n tokens. We keep our default "sequoia"
#   tree because that is the workload the planner prices (t(n) is what a tree step costs us); at
#   these n the cost is dominated by the weight matmuls, which do not depend on the mask, so the
#   shape barely moves t(n). --tree chain gives the strict like-for-like mask.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib/peer-common.sh
source "$SCRIPT_DIR/lib/peer-common.sh"
SEQUOIA_BIN=${SEQUOIA_BIN:-$REPO_ROOT/target/release/sequoia}
JOBS=${PEER_JOBS:-2}

MODEL=qwen2.5-coder-1.5b
THREADS=2
SIZES=1,2,4,8,16,32
REPS=5
CONTEXT=128
TREE=sequoia
JSON_OUT=
IK_SRC=${IK_LLAMA_SRC:-}
SKIP_BUILD=0
ONLY_BUILD=0
NO_AVX2=0
RUN_SEQUOIA=1

log() { echo "peer-llamacpp: $*" >&2; }
die() {
    echo "peer-llamacpp: ERROR: $*" >&2
    exit 1
}
usage() { sed -n '2,/^set -euo pipefail/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

need_arg() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value (see --help)"; }
while [[ $# -gt 0 ]]; do
    case $1 in
    --model) need_arg "$@"; MODEL=$2; shift 2 ;;
    --threads) need_arg "$@"; THREADS=$2; shift 2 ;;
    --sizes) need_arg "$@"; SIZES=$2; shift 2 ;;
    --reps) need_arg "$@"; REPS=$2; shift 2 ;;
    --context) need_arg "$@"; CONTEXT=$2; shift 2 ;;
    --tree) need_arg "$@"; TREE=$2; shift 2 ;;
    --json) need_arg "$@"; JSON_OUT=$2; shift 2 ;;
    --ik-src) need_arg "$@"; IK_SRC=$2; shift 2 ;;
    --skip-build) SKIP_BUILD=1; shift ;;
    --only-build) ONLY_BUILD=1; shift ;;
    --no-avx2) NO_AVX2=1; shift ;;
    --no-sequoia) RUN_SEQUOIA=0; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
    esac
done

[[ $THREADS =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer, got '$THREADS'"
[[ $REPS =~ ^[1-9][0-9]*$ ]] || die "--reps must be a positive integer, got '$REPS'"
[[ $CONTEXT =~ ^[0-9]+$ ]] || die "--context must be a non-negative integer, got '$CONTEXT'"
[[ $SIZES =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "--sizes must look like 1,2,4,8, got '$SIZES'"
[[ $TREE == sequoia || $TREE == chain ]] || die "--tree must be sequoia or chain, got '$TREE'"
[[ $SKIP_BUILD == 1 && $ONLY_BUILD == 1 ]] && die "--skip-build and --only-build exclude each other"
[[ $JOBS =~ ^[1-9][0-9]*$ ]] || die "PEER_JOBS must be a positive integer, got '$JOBS'"
if [[ -n $JSON_OUT ]]; then
    mkdir -p "$(dirname "$JSON_OUT")"
    JSON_OUT=$(cd "$(dirname "$JSON_OUT")" && pwd)/$(basename "$JSON_OUT")
fi
if [[ -n $IK_SRC ]]; then
    [[ -f $IK_SRC/CMakeLists.txt ]] || die "IK_LLAMA_SRC=$IK_SRC has no CMakeLists.txt (want an ik_llama.cpp source tree)"
    IK_SRC=$(cd "$IK_SRC" && pwd)
fi

command -v python3 >/dev/null || die "python3 is needed (to fetch the source with pip and to parse results)"

# ---------------------------------------------------------------- CPU
CPU_FLAGS=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2- || true)
has_flag() { [[ " $CPU_FLAGS " == *" $1 "* ]]; }
HAS_AMX=0
[[ $CPU_FLAGS =~ (^|\ )amx ]] && HAS_AMX=1
CPU_MODEL=$( (lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1) || true)
[[ -n $CPU_MODEL ]] || CPU_MODEL=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//' || echo unknown)
flag_summary() {
    local f out=""
    for f in avx2 avx512f avx512_vnni avx512vbmi avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16; do
        if has_flag "$f"; then out+="$f=yes "; else out+="$f=no "; fi
    done
    echo "${out% }"
}

# ---------------------------------------------------------------- tools for building
CMAKE=cmake
ensure_cmake() {
    if command -v cmake >/dev/null; then
        CMAKE=$(command -v cmake)
        return
    fi
    if [[ -x $PEER_DIR/venv/bin/cmake ]]; then
        CMAKE=$PEER_DIR/venv/bin/cmake
        return
    fi
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        log "cmake not found: apt-get install -y cmake"
        if apt-get install -y cmake >&2 || { apt-get update >&2 && apt-get install -y cmake >&2; }; then
            CMAKE=$(command -v cmake)
            return
        fi
    fi
    log "cmake not found: installing it from PyPI into $PEER_DIR/venv"
    python3 -m venv "$PEER_DIR/venv" >&2 && "$PEER_DIR/venv/bin/pip" install -q cmake >&2 ||
        die "could not install cmake: install it (apt-get install cmake, or pip install cmake) and rerun"
    CMAKE=$PEER_DIR/venv/bin/cmake
}
ensure_build_tools() {
    local t
    for t in g++ gcc make tar; do
        command -v "$t" >/dev/null || die "'$t' is needed to build llama.cpp (Debian: apt-get install build-essential)"
    done
    ensure_cmake
    log "using $("$CMAKE" --version | head -1), $(g++ --version | head -1)"
}

# ---------------------------------------------------------------- llama.cpp source
LCP_SRC_ROOT=$PEER_DIR/src/llama_cpp_python-$LCP_VERSION
LLAMA_SRC=$LCP_SRC_ROOT/vendor/llama.cpp
fetch_llama_src() {
    if [[ -f $LCP_SRC_ROOT/.sequoia-unpacked && -f $LLAMA_SRC/CMakeLists.txt ]]; then
        return
    fi
    local dl=$PEER_DIR/download sdist
    mkdir -p "$dl" "$PEER_DIR/src"
    sdist=$dl/llama_cpp_python-$LCP_VERSION.tar.gz
    if [[ ! -s $sdist ]]; then
        log "downloading the llama-cpp-python $LCP_VERSION sdist from PyPI (vendors llama.cpp)"
        python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$LCP_VERSION" -d "$dl" >&2 ||
            die "pip download llama-cpp-python==$LCP_VERSION failed (is PyPI reachable? is the version right?)"
        [[ -s $sdist ]] || die "pip did not leave $sdist (got: $(ls "$dl"))"
    fi
    log "unpacking $(basename "$sdist")"
    rm -rf "$LCP_SRC_ROOT"
    tar -xzf "$sdist" --no-same-owner -C "$PEER_DIR/src" || die "could not unpack $sdist"
    [[ -f $LLAMA_SRC/CMakeLists.txt ]] || die "$sdist has no vendor/llama.cpp/CMakeLists.txt"
    touch "$LCP_SRC_ROOT/.sequoia-unpacked"
}

# ---------------------------------------------------------------- builds
# Whether a source tree knows a CMake option (so options a fork lacks are not passed).
has_opt() { grep -qs "$2" "$1/CMakeLists.txt" "$1/ggml/CMakeLists.txt"; }

# isa_args SRC native|avx2: the -D options for the CPU backend.
isa_args() {
    local src=$1 kind=$2 vnni_opt=GGML_AVX_VNNI
    has_opt "$src" 'GGML_AVX_VNNI' || vnni_opt=GGML_AVXVNNI # ik_llama.cpp's spelling
    local on=() off=() f
    if [[ $kind == native && $HAS_AMX == 0 ]]; then
        echo "-DGGML_NATIVE=ON"
        return
    fi
    if [[ $kind == native ]]; then
        # AMX machine: explicit AVX-512 (+VNNI), AMX off (GGML_NATIVE=ON faulted there).
        on=(GGML_AVX GGML_AVX2 GGML_FMA GGML_F16C GGML_BMI2 GGML_AVX512 GGML_AVX512_VNNI)
        has_flag avx512vbmi && on+=(GGML_AVX512_VBMI) || off+=(GGML_AVX512_VBMI)
        has_flag avx512_bf16 && on+=(GGML_AVX512_BF16) || off+=(GGML_AVX512_BF16)
        has_flag avx_vnni && on+=("$vnni_opt") || off+=("$vnni_opt")
        off+=(GGML_AMX_TILE GGML_AMX_INT8 GGML_AMX_BF16)
    else
        on=(GGML_AVX GGML_AVX2 GGML_FMA GGML_F16C GGML_BMI2)
        off=(GGML_AVX512 GGML_AVX512_VNNI GGML_AVX512_VBMI GGML_AVX512_BF16 "$vnni_opt"
            GGML_AMX_TILE GGML_AMX_INT8 GGML_AMX_BF16)
    fi
    echo "-DGGML_NATIVE=OFF"
    for f in "${on[@]}"; do has_opt "$src" "$f" && echo "-D$f=ON"; done
    for f in "${off[@]}"; do has_opt "$src" "$f" && echo "-D$f=OFF"; done
    # ik_llama.cpp's GGML_AVX512 turns on only AVX-512 F and BW, but its AVX-512 kernels need DQ
    # and VL as well (without them it compiles a half-AVX-512 path that does not build);
    # llama.cpp's own option adds them. Give them where the CPU has them and the tree does not.
    if [[ $kind == native ]] && has_flag avx512dq && has_flag avx512vl &&
        ! grep -rqs --include=CMakeLists.txt -- -mavx512dq "$src/ggml"; then
        echo "-DCMAKE_C_FLAGS=-mavx512dq -mavx512vl -mavx512cd"
        echo "-DCMAKE_CXX_FLAGS=-mavx512dq -mavx512vl -mavx512cd"
    fi
    return 0
}

common_args() {
    local src=$1 o
    printf '%s\n' -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
    # Only what the tree knows: LLAMA_CURL (deprecated upstream, an option in ik), no OpenSSL,
    # no web UI build or download from a hub (unreachable here), no ccache.
    for o in LLAMA_BUILD_TOOLS=ON LLAMA_CURL=OFF LLAMA_OPENSSL=OFF LLAMA_BUILD_UI=OFF \
        LLAMA_USE_PREBUILT_UI=OFF GGML_CCACHE=OFF; do
        has_opt "$src" "${o%%=*}" && echo "-D$o"
    done
    # ik_llama.cpp compiles its FlashAttention CPU kernels for every KV-cache type by default,
    # which is most of its build time on two cores; f16 KV (the benchmark default) stays in.
    has_opt "$src" GGML_IQK_FA_ALL_QUANTS && echo "-DGGML_IQK_FA_ALL_QUANTS=OFF"
    return 0
}

# Targets: llama-bench is required; the others are built when the tree has them.
WANT_TARGETS=("llama-bench" "llama-speculative-simple|llama-speculative"
    "llama-completion|llama-cli" "llama-server")

# build NAME SRC KIND: configure and build into $PEER_DIR/build/NAME; sets BUILT_BIN.
BUILT_BIN=
build() {
    local name=$1 src=$2 kind=$3 dir=$PEER_DIR/build/$1
    local marker=$dir/.sequoia-peer-built
    BUILT_BIN=$dir/bin
    local args
    mapfile -t args < <(common_args "$src"; isa_args "$src" "$kind")
    local config="src=$src"$'\n'"${args[*]}"
    if [[ -f $marker && -x $dir/bin/llama-bench ]] && [[ $(sed -n '1,2p' "$marker") == "$config" ]]; then
        log "$name: already built ($dir/bin: $(sed -n '3p' "$marker"))"
        return
    fi
    if [[ $SKIP_BUILD == 1 ]]; then
        die "$name is not built in $dir (or was built with other options); rerun without --skip-build"
    fi
    ensure_build_tools
    log "$name: configuring ($kind): ${args[*]}"
    mkdir -p "$dir"
    rm -f "$marker"
    nice -n 19 "$CMAKE" -S "$src" -B "$dir" -G "Unix Makefiles" "${args[@]}" >"$dir/configure.log" 2>&1 || {
        tail -n 40 "$dir/configure.log" >&2
        die "$name: cmake configure failed (full log: $dir/configure.log)"
    }
    local have want alt targets=()
    have=$("$CMAKE" --build "$dir" --target help 2>/dev/null | sed -n 's/^\.\.\. \([^ ]*\).*/\1/p')
    for want in "${WANT_TARGETS[@]}"; do
        local found=
        IFS='|' read -r -a alt <<<"$want"
        local a
        for a in "${alt[@]}"; do
            if grep -qx "$a" <<<"$have"; then found=$a; break; fi
        done
        if [[ -n $found ]]; then
            targets+=("$found")
        elif [[ $want == llama-bench ]]; then
            die "$name: this source has no llama-bench target"
        else
            log "$name: WARNING: no target among '${want//|/ or }' in this source; skipping it"
        fi
    done
    # llama-bench first (required, and it builds the libraries), then each other tool on its own:
    # one that fails to build (e.g. a fork's server missing an asset) is reported, not fatal.
    log "$name: building ${targets[*]} with nice -n 19, -j$JOBS (log: $dir/build.log; this takes a while)"
    local t0=$SECONDS t built=()
    : >"$dir/build.log"
    for t in "${targets[@]}"; do
        log "$name: building $t ($(((SECONDS - t0) / 60)) min so far)"
        if nice -n 19 "$CMAKE" --build "$dir" --config Release -j"$JOBS" --target "$t" >>"$dir/build.log" 2>&1 &&
            [[ -x $dir/bin/$t ]]; then
            built+=("$t")
        elif [[ $t == llama-bench ]]; then
            tail -n 40 "$dir/build.log" >&2
            die "$name: building llama-bench failed (full log: $dir/build.log)"
        else
            tail -n 15 "$dir/build.log" >&2
            log "$name: WARNING: $t failed to build (see $dir/build.log); going on without it"
        fi
    done
    printf '%s\n%s\n' "$config" "${built[*]}" >"$marker"
    log "$name: built ${built[*]} in $(((SECONDS - t0) / 60)) min $(((SECONDS - t0) % 60)) s"
}

mkdir -p "$PEER_DIR"
exec 9>"$PEER_DIR/.lock"
if command -v flock >/dev/null; then
    flock -n 9 || { log "waiting for another peer-llamacpp.sh run (lock $PEER_DIR/.lock)"; flock 9; }
fi

if [[ $SKIP_BUILD == 0 ]]; then
    fetch_llama_src
elif [[ ! -f $LLAMA_SRC/CMakeLists.txt ]]; then
    die "--skip-build, but the llama.cpp source is not in $LLAMA_SRC; rerun without --skip-build"
fi

PEERS=()     # label|bin dir|extra llama-bench args
build "llama.cpp-$LCP_VERSION-native" "$LLAMA_SRC" native
PEERS+=("llama.cpp native|$BUILT_BIN|")
if [[ $NO_AVX2 == 0 ]]; then
    build "llama.cpp-$LCP_VERSION-avx2" "$LLAMA_SRC" avx2
    PEERS+=("llama.cpp avx2|$BUILT_BIN|")
fi
if [[ -n $IK_SRC ]]; then
    ik_tag=$(basename "$IK_SRC")-$(printf '%s' "$IK_SRC" | sha1sum | cut -c1-8)
    build "ik_llama-$ik_tag-native" "$IK_SRC" native
    PEERS+=("ik_llama native|$BUILT_BIN|-rtr 1")
fi

if [[ $ONLY_BUILD == 1 ]]; then
    log "builds ready under $PEER_DIR/build"
    for p in "${PEERS[@]}"; do
        IFS='|' read -r label bindir _ <<<"$p"
        echo "$label: $bindir ($(cd "$bindir" && ls | paste -sd' ' -))"
    done
    exit 0
fi

# ---------------------------------------------------------------- model and our binary
MODEL_PATH=$(resolve_model "$MODEL")
log "model: $MODEL_PATH"
if [[ $RUN_SEQUOIA == 1 ]]; then
    [[ -x $SEQUOIA_BIN ]] ||
        die "our binary $SEQUOIA_BIN is missing: build it (cargo build --release -p sequoia-cli, or set SEQUOIA_BIN), or pass --no-sequoia"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/peer-llamacpp.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# ---------------------------------------------------------------- runs
# run_llama_bench LABEL BINDIR EXTRA: two llama-bench runs (results as JSON files in $WORK).
#   curve: -p SIZES -n 0 at depth CONTEXT (if -d exists) -> t(n)
#   std:   -p 512 -n 64 at depth 0 -> pp512, tg64 (the usual llama-bench numbers)
run_llama_bench() {
    local label=$1 bindir=$2 extra=$3 key=${1// /_}
    local bench=$bindir/llama-bench depth=()
    # shellcheck disable=SC2206
    local xargs=($extra)
    local help
    help=$("$bench" --help 2>&1 || true) # not piped into grep -q: SIGPIPE + pipefail would lie
    if grep -q -- '--n-depth' <<<"$help"; then
        depth=(-d "$CONTEXT")
        echo "$CONTEXT" >"$WORK/$key.depth"
    else
        echo 0 >"$WORK/$key.depth"
    fi
    local cmd=("$bench" -m "$MODEL_PATH" -t "$THREADS" -r "$REPS" -p "$SIZES" -n 0 "${depth[@]}" "${xargs[@]}" -o json)
    log "$label: ${cmd[*]}"
    "${cmd[@]}" >"$WORK/$key.curve.json" 2>"$WORK/$key.curve.log" || {
        tail -n 30 "$WORK/$key.curve.log" >&2
        die "$label: llama-bench failed"
    }
    cmd=("$bench" -m "$MODEL_PATH" -t "$THREADS" -r "$REPS" -p 512 -n 64 "${xargs[@]}" -o json)
    log "$label: ${cmd[*]}"
    "${cmd[@]}" >"$WORK/$key.std.json" 2>"$WORK/$key.std.log" || {
        tail -n 30 "$WORK/$key.std.log" >&2
        die "$label: llama-bench failed"
    }
}

for p in "${PEERS[@]}"; do
    IFS='|' read -r label bindir extra <<<"$p"
    run_llama_bench "$label" "$bindir" "$extra"
done

if [[ $RUN_SEQUOIA == 1 ]]; then
    cmd=("$SEQUOIA_BIN" engine-bench --model "$MODEL_PATH" --threads "$THREADS" --sizes "$SIZES"
        --repeats "$REPS" --context "$CONTEXT" --tree "$TREE" --json)
    log "sequoia: ${cmd[*]}"
    "${cmd[@]}" >"$WORK/sequoia.json" 2>"$WORK/sequoia.log" || {
        tail -n 30 "$WORK/sequoia.log" >&2
        die "sequoia engine-bench failed"
    }
    # pp512 for us: the prefill of a 512-token context (one timed forward).
    cmd=("$SEQUOIA_BIN" engine-bench --model "$MODEL_PATH" --threads "$THREADS" --sizes 1
        --repeats 1 --decode-tokens 1 --context 512 --json)
    log "sequoia: ${cmd[*]}"
    "${cmd[@]}" >"$WORK/sequoia.pp512.json" 2>"$WORK/sequoia.pp512.log" || {
        tail -n 30 "$WORK/sequoia.pp512.log" >&2
        die "sequoia engine-bench (pp512) failed"
    }
fi

# ---------------------------------------------------------------- report
peer_labels=()
for p in "${PEERS[@]}"; do peer_labels+=("${p%%|*}"); done

WORK="$WORK" CPU_MODEL="$CPU_MODEL" CPU_FLAGS_SUMMARY="$(flag_summary)" HAS_AMX="$HAS_AMX" \
    THREADS="$THREADS" SIZES="$SIZES" REPS="$REPS" CONTEXT="$CONTEXT" TREE="$TREE" \
    MODEL_PATH="$MODEL_PATH" LCP_VERSION="$LCP_VERSION" IK_SRC="$IK_SRC" JSON_OUT="$JSON_OUT" \
    RUN_SEQUOIA="$RUN_SEQUOIA" PEER_LABELS="$(printf '%s\n' "${peer_labels[@]}")" \
    LOADAVG="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')" \
    python3 - <<'PY'
import json, os, statistics, sys

env = os.environ
work = env["WORK"]
sizes = [int(x) for x in env["SIZES"].split(",")]
labels = [l for l in env["PEER_LABELS"].split("\n") if l]


def load(path):
    with open(path) as f:
        text = f.read()
    # llama-bench may print non-JSON lines before the array on some versions.
    start = min([i for i in (text.find("["), text.find("{")) if i >= 0], default=0)
    return json.loads(text[start:])


def tps(r, n):
    """Tokens/s of one llama-bench test from its median sample, like engine-bench's medians
    (llama-bench's own avg_ts, the mean of per-sample rates, is kept in the JSON as avg_ts)."""
    samples = r.get("samples_ns") or []
    if samples:
        return n / (statistics.median(samples) / 1e9)
    return r["avg_ts"]


engines = {}  # label -> dict
versions = {}
for label in labels:
    key = label.replace(" ", "_")
    curve = load(f"{work}/{key}.curve.json")
    std = load(f"{work}/{key}.std.json")
    depth = int(open(f"{work}/{key}.depth").read().strip())
    e = {"kind": "llama-bench", "t_depth": depth, "t": {}, "decode_tps": None, "pp512_tps": None,
         "avg_ts": {}}
    for r in curve:
        if r.get("n_gen", 0) == 0 and r.get("n_prompt", 0) in sizes:
            n = r["n_prompt"]
            # t(n) = n / (tokens per second of pp n) * 1000
            e["t"][n] = n / tps(r, n) * 1000.0
            e["avg_ts"][f"pp{n}"] = r.get("avg_ts")
    for r in std:
        if r.get("n_prompt") == 512 and r.get("n_gen", 0) == 0:
            e["pp512_tps"] = tps(r, 512)
            e["avg_ts"]["pp512"] = r.get("avg_ts")
        if r.get("n_gen") == 64 and r.get("n_prompt", 0) == 0:
            e["decode_tps"] = tps(r, 64)
            e["avg_ts"]["tg64"] = r.get("avg_ts")
    first = (curve or std or [{}])[0]
    e["build"] = f"{first.get('build_commit', '?')} (build {first.get('build_number', '?')})"
    e["cpu_info"] = first.get("cpu_info")
    e["threads"] = first.get("n_threads")
    engines[label] = e

if env["RUN_SEQUOIA"] == "1":
    s = load(f"{work}/sequoia.json")
    p = load(f"{work}/sequoia.pp512.json")
    e = {
        "kind": "engine-bench",
        "t_depth": s["context"],
        "t": {row["n"]: row["ms_median"] for row in s["t"]},
        "decode_tps": s["decode_tokens_per_second"],
        "pp512_tps": p["prefill_tokens_per_second"],
        "weights": s.get("weights"),
        "model_name": s.get("model"),
        "threads": s.get("threads"),
        "tree": s.get("tree"),
        "levels": {row["n"]: row["levels"] for row in s["t"]},
    }
    engines = {"sequoia": e, **engines}

names = list(engines)


def f(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def ratio(a, b):
    return None if (a is None or b is None or b == 0) else a / b


out = []
w = out.append
w("## sequoia vs llama.cpp (CPU)")
w("")
w(f"- CPU: {env['CPU_MODEL']}; flags: {env['CPU_FLAGS_SUMMARY']}")
w(f"- threads: {env['THREADS']} (every engine); repetitions: {env['REPS']}; load average at start: {env['LOADAVG']}")
w(f"- model: {os.path.basename(env['MODEL_PATH'])}")
w(f"- llama.cpp: vendored in llama-cpp-python {env['LCP_VERSION']}; "
  + "; ".join(f"{l}: {engines[l]['build']}" for l in labels))
if "sequoia" in engines:
    w(f"- sequoia: engine-bench, tree `{engines['sequoia']['tree']}`, t(n) after {engines['sequoia']['t_depth']} committed tokens (tree attention over n nodes)")
for l in labels:
    d = engines[l]["t_depth"]
    where = f"at depth {d} (llama-bench -d {d})" if d else "at empty context (this llama-bench has no -d)"
    w(f"- {l}: t(n) = n / (pp n tok/s) * 1000, pp n {where}; pp512 and tg64 at empty context" + ("; -rtr 1" if l.startswith("ik_") else ""))
w("- llama.cpp tok/s and t(n) are from the median of the llama-bench samples (sequoia reports medians too)")
w("- decode: llama.cpp tg64 from an empty context; sequoia: median decode step after the committed context. pp512: sequoia = one timed 512-token prefill")
w("")
w("| metric | " + " | ".join(names) + " |")
w("|---|" + "---:|" * len(names))
w("| decode tok/s | " + " | ".join(f(engines[n]["decode_tps"]) for n in names) + " |")
w("| pp512 tok/s | " + " | ".join(f(engines[n]["pp512_tps"]) for n in names) + " |")
for n in sizes:
    w(f"| t({n}) ms | " + " | ".join(f(engines[e]["t"].get(n)) for e in names) + " |")
for n in sizes:
    w(f"| t({n})/t(1) | " + " | ".join(f(ratio(engines[e]["t"].get(n), engines[e]["t"].get(1)))
                                        for e in names) + " |")
ratios = {}
if "sequoia" in engines:
    s = engines["sequoia"]
    w("")
    w("| ratio | decode | pp512 | " + " | ".join(f"t({n})" for n in sizes) + " |")
    w("|---|---:|---:|" + "---:|" * len(sizes))
    for l in labels:
        e = engines[l]
        r = {
            "decode": ratio(s["decode_tps"], e["decode_tps"]),
            "pp512": ratio(s["pp512_tps"], e["pp512_tps"]),
            # time ratio: > 1 means sequoia is slower
            "t": {n: ratio(s["t"].get(n), e["t"].get(n)) for n in sizes},
        }
        ratios[f"sequoia / {l}"] = r
        w(f"| sequoia / {l} | {f(r['decode'])} | {f(r['pp512'])} | "
          + " | ".join(f(r["t"][n]) for n in sizes) + " |")
    w("")
    w("decode and pp512 ratios are throughput (>1: sequoia faster); t(n) ratios are time (>1: sequoia slower).")
print("\n".join(out))

if env["JSON_OUT"]:
    doc = {
        "cpu": env["CPU_MODEL"],
        "cpu_flags": env["CPU_FLAGS_SUMMARY"],
        "amx": env["HAS_AMX"] == "1",
        "threads": int(env["THREADS"]),
        "reps": int(env["REPS"]),
        "context": int(env["CONTEXT"]),
        "tree": env["TREE"],
        "sizes": sizes,
        "model": env["MODEL_PATH"],
        "llama_cpp_python_version": env["LCP_VERSION"],
        "ik_llama_src": env["IK_SRC"] or None,
        "load_average": env["LOADAVG"],
        "engines": {
            k: {**v, "t": {str(n): ms for n, ms in v["t"].items()},
                **({"levels": {str(n): l for n, l in v["levels"].items()}} if "levels" in v else {})}
            for k, v in engines.items()
        },
        "ratios": {k: {**v, "t": {str(n): x for n, x in v["t"].items()}} for k, v in ratios.items()},
    }
    with open(env["JSON_OUT"], "w") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    print(f"peer-llamacpp: wrote {env['JSON_OUT']}", file=sys.stderr)
PY
