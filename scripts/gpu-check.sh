#!/usr/bin/env bash
# One prepared run on a machine with an NVIDIA GPU (about 6 minutes at most): probe the GPU and
# its CUDA libraries, run the engine's CUDA tests, and measure real-shape costs with random
# weights (no model files, no network): engine-bench for the qwen2.5-1.5b and qwen2.5-7b target
# shapes and the qwen2.5-0.5b draft shape at n = 1…256, and a planner profile (tree profile).
#
# Two steps, because the GPU machine has no network and no Rust toolchain:
#
#   scripts/gpu-check.sh --prepare        # here (no GPU needed): CUDA toolchain from PyPI
#                                         # (scripts/setup-cuda.sh), a --features cuda build,
#                                         # and the gzipped, stripped binaries in gpu-bundle/
#   scripts/gpu-check.sh [BUNDLE]         # there: BUNDLE defaults to gpu-bundle (or
#                                         # $SEQUOIA_GPU_BUNDLE); results go to $OUT
#                                         # (default ./gpu-out), written as each step ends, so
#                                         # a run cut short still leaves what it measured
#
# gpu-bundle/ (ignored by git) holds sequoia.gz (the CLI) and engine_cuda.gz (the CUDA test
# binary), a few tens of MB in all. They link the CUDA 13 libraries dynamically (candle's
# cudarc uses `dynamic-linking`): the GPU machine must have a driver for CUDA 13 (>= 580) and
# libcublas.so.13, libcublasLt.so.13, libcurand.so.10, libnvrtc.so.13 and libcudart.so.13
# (a CUDA 13 toolkit or the PyPI wheels). The libcuda stub of the build is not in the bundle:
# the driver's libcuda.so.1 is used. The probe looks for those libraries in the usual places
# and says which are missing.
#
# Environment: CUDA_COMPUTE_CAP for --prepare (default 90: H100/H200; 80 for A100);
# GPU_CHECK_SHAPES (default "qwen2.5-1.5b qwen2.5-7b qwen2.5-0.5b"), GPU_CHECK_SIZES
# (default 1,2,4,8,16,32,64,128,256), GPU_CHECK_REPEATS (default 3).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
    set -e
    bundle="${2:-gpu-bundle}"
    eval "$(scripts/setup-cuda.sh)"
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/cuda-check}"
    cargo build --release -p sequoia-cli --features cuda
    test_bin=$(cargo test --release -p sequoia-engine --features cuda --test engine_cuda \
        --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "engine_cuda" and m.get("executable"):
        print(m["executable"])')
    mkdir -p "$bundle"
    strip -o "$bundle/sequoia" "$CARGO_TARGET_DIR/release/sequoia"
    strip -o "$bundle/engine_cuda" "$test_bin"
    gzip -9f "$bundle/sequoia" "$bundle/engine_cuda"
    # What the binaries need at run time, for comparison with the device's probe.
    gzip -dc "$bundle/sequoia.gz" >"$bundle/.sequoia.tmp"
    readelf -d "$bundle/.sequoia.tmp" | grep NEEDED >"$bundle/needed.txt"
    rm -f "$bundle/.sequoia.tmp"
    git rev-parse HEAD >"$bundle/commit.txt" 2>/dev/null || true
    echo "CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP" >>"$bundle/commit.txt"
    ls -l "$bundle"
    du -sh "$bundle"
    exit 0
fi

bundle="${1:-${SEQUOIA_GPU_BUNDLE:-gpu-bundle}}"
out="${OUT:-gpu-out}"
mkdir -p "$out"
log="$out/gpu-check.log"
say() { echo "gpu-check: $*" | tee -a "$log" >&2; }
fail() { # message, exit code
    say "FAILED: $1"
    echo "FAILED: $1" >>"$out/summary.txt"
    exit "${2:-1}"
}
t_start=$(date +%s)
: >"$out/summary.txt"

# 1. Probe: the GPU, the driver, and the CUDA libraries the binaries link.
{
    echo "== date"
    date -u
    echo "== nvidia-smi"
    nvidia-smi 2>&1 || true
    echo "== nvidia-smi --query-gpu"
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv 2>&1 || true
    echo "== ldconfig -p (CUDA libraries)"
    ldconfig -p 2>/dev/null | grep -E 'libcuda|cublas|nvrtc|curand|cudart' || echo "(none in the linker cache)"
    echo "== CPU"
    nproc
    free -g 2>/dev/null || true
} >"$out/probe.txt" 2>&1
if ! command -v nvidia-smi >/dev/null; then
    fail "no NVIDIA GPU here: nvidia-smi is not installed (this script measures a GPU; see probe.txt)" 2
fi
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    fail "nvidia-smi finds no GPU (driver not loaded or no device); see probe.txt" 2
fi
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | head -n1)"

[ -f "$bundle/sequoia.gz" ] && [ -f "$bundle/engine_cuda.gz" ] ||
    fail "no bundle in $bundle (build it with scripts/gpu-check.sh --prepare)" 3
bin="$(mktemp -d)"
gzip -dc "$bundle/sequoia.gz" >"$bin/sequoia" && gzip -dc "$bundle/engine_cuda.gz" >"$bin/engine_cuda" ||
    fail "cannot unpack the bundle" 3
chmod +x "$bin/sequoia" "$bin/engine_cuda"

missing() { ldd "$bin/sequoia" 2>/dev/null | awk '/not found/ {print $1}'; }
if [ -n "$(missing)" ]; then
    # Not in the linker cache: look where CUDA toolkits and the PyPI wheels put them.
    roots="/usr/local /opt /usr/lib /usr/lib64 $HOME/.local"
    roots="$roots $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)"
    for lib in $(missing); do
        # shellcheck disable=SC2086
        dir=$(find $roots -maxdepth 6 -name "$lib" -not -path '*/stubs/*' 2>/dev/null | head -n1)
        [ -n "$dir" ] && export LD_LIBRARY_PATH="$(dirname "$dir")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
fi
{
    echo "== ldd sequoia (LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-})"
    ldd "$bin/sequoia"
} >>"$out/probe.txt" 2>&1
if [ -n "$(missing)" ]; then
    fail "CUDA libraries missing for the bundle: $(missing | tr '\n' ' ')(it needs the CUDA 13 runtime libraries; see probe.txt)" 4
fi
say "CUDA libraries found; LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

status=0
step() { # name, timeout seconds, command...
    local name="$1" limit="$2"
    shift 2
    local t0
    t0=$(date +%s)
    timeout "$limit" "$@" >"$out/$name.out" 2>"$out/$name.err"
    local rc=$?
    local line="$name: rc=$rc in $(($(date +%s) - t0)) s"
    [ $rc -eq 124 ] && line="$line (timed out after $limit s)"
    say "$line"
    echo "$line" >>"$out/summary.txt"
    [ $rc -eq 0 ] || status=1
    return 0
}

# 2. The CUDA tests (GPU vs CPU logits, tree vs sequential, compaction, sessions, near-ties).
step cuda-tests 100 "$bin/engine_cuda" --test-threads=1 --nocapture

# 3. t_v(n) / t_d(w) for real shapes with random weights (Q4_K_M-like).
sizes="${GPU_CHECK_SIZES:-1,2,4,8,16,32,64,128,256}"
repeats="${GPU_CHECK_REPEATS:-3}"
for shape in ${GPU_CHECK_SHAPES:-qwen2.5-1.5b qwen2.5-7b qwen2.5-0.5b}; do
    step "bench-$shape" 60 "$bin/sequoia" engine-bench --cuda --random-weights "$shape" \
        --sizes "$sizes" --repeats "$repeats" --decode-tokens 16 --context 128 --json
done

# 4. A planner profile: 7B-shaped target, 0.5B-shaped draft, trees up to 256 nodes.
step profile-7b-0.5b 60 "$bin/sequoia" tree profile --cuda --random-weights \
    --target qwen2.5-7b --draft qwen2.5-0.5b --max-nodes 256 --repeats "$repeats" \
    --context 128 --out "$out/profile-7b-0.5b.json"

say "done in $(($(date +%s) - t_start)) s; summary in $out/summary.txt"
rm -rf "$bin"
exit $status
