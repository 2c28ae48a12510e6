# Sourced by the peer scripts: resolve a model name to a GGUF path.
# Needs: MODELS_DIR, REPO_ROOT and a `die MESSAGE` function in the sourcing script.

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
