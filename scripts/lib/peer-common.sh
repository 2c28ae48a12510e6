# Sourced by the peer scripts (peer-llamacpp.sh, peer-serving.sh): the llama.cpp version they
# build and run, the folders they share, and model names. resolve_model needs a `die MESSAGE`
# function in the sourcing script.

PINNED_LLAMA_CPP_PYTHON=0.3.36
LCP_VERSION=${LLAMA_CPP_PYTHON_VERSION:-$PINNED_LLAMA_CPP_PYTHON}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEER_DIR=${SEQUOIA_PEER_DIR:-$HOME/.cache/sequoia/peer}
MODELS_DIR=${SEQUOIA_MODELS:-$HOME/.cache/sequoia/models}

# resolve_model NAME|PATH: a .gguf path as given (made absolute), or a default model name
# (the names the sequoia CLI knows) or a file name in $MODELS_DIR, as a path there.
resolve_model() {
    local m=$1 file
    if [[ -f $m ]]; then
        (cd "$(dirname "$m")" && echo "$(pwd)/$(basename "$m")")
        return
    fi
    case $m in
    qwen2.5-coder-1.5b) file=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf ;;
    qwen2.5-coder-0.5b) file=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ;;
    smollm2-135m) file=SmolLM2-135M-Instruct.Q4_1.gguf ;;
    */* | *.gguf) file=$m ;;
    *) die "unknown model '$m': give a .gguf path or one of qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m" ;;
    esac
    [[ $file == */* ]] && die "model file $file does not exist"
    [[ -f $MODELS_DIR/$file ]] ||
        die "model $m is not in $MODELS_DIR ($file missing): run $REPO_ROOT/scripts/fetch-models.sh $m"
    echo "$MODELS_DIR/$file"
}
