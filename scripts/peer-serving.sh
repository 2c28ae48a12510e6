#!/usr/bin/env bash
# peer-serving.sh: llama.cpp's own serving tools as same-run peers for two of our benchmarks, on
# the same models, prompts and threads, every number measured in this run.
#
# Usage: scripts/peer-serving.sh spec|capacity [options]
#
#   spec       per prompt, llama.cpp plain decoding of the target (llama-completion) and
#              llama.cpp draft-model speculation (llama-speculative-simple, --spec-type
#              draft-simple), greedy, raw prompt text (no chat template); tokens, decode seconds,
#              tok/s of each, and speculative/plain, per prompt and pooled.
#              Our side: target/release/sequoia bench --raw --methods target,auto \
#                  --max-prompts-per-category 1 --max-tokens 64 --temperatures 0 \
#                  --out-dir bench-out/one-host
#              (`auto`: what the service does where draft and verify share CPUs; `auto+pipe`
#              asks every request to pipeline, which there takes cores from verification)
#   capacity   llama-server -np N (continuous batching, N slots) serving the target; for each N,
#              N concurrent greedy POST /completion requests (chat-templated prompts, as
#              `sequoia bench capacity` sends them); aggregate tokens/s over the whole batch's
#              wall time, p50/p99 of the requests' decode ms per token.
#              Our side: target/release/sequoia bench capacity --threads 2 (its "plain" rows)
#
# Options (both):
#   --target NAME|PATH  target model: a default name (qwen2.5-coder-1.5b, qwen2.5-coder-0.5b,
#                       smollm2-135m), a file name in the models folder, or a path to a .gguf
#                       (default: qwen2.5-coder-1.5b)
#   --threads T         CPU threads of every llama.cpp tool (-t and -tb; the draft's too) (default: 2)
#   --max-tokens N      new tokens per generation, fewer when the model ends its answer
#                       (default: 64 for spec, 48 for capacity, as our benches)
#   --prompts FILE      Spec-Bench JSONL (question_id, category, turns; the first turn is used)
#                       (default: tests/data/spec_bench/question.jsonl)
#   --ctx C             context size: spec, of each tool run (default: 4096; also the batch size, so
#                       a prompt is one batch); capacity, per server slot, -c = N x C (default: 2048)
#   --json OUT          also write all numbers as JSON to OUT
#   --bin-dir DIR       llama.cpp tools (default: the native build of scripts/peer-llamacpp.sh,
#                       $SEQUOIA_PEER_DIR/build/llama.cpp-VERSION-native/bin)
#   --log-dir DIR       keep every tool's log (and the prompt files) in DIR (default: a temp dir,
#                       removed at exit)
#   -h, --help          this text
# spec only:
#   --draft NAME|PATH   draft model, same forms as --target (default: qwen2.5-coder-0.5b); accepted
#                       by capacity too, which serves the target alone
#   --per-category K    the first K prompts of each category (default: 1)
#   --categories LIST   only these categories, comma-separated (default: all 13)
#   --draft-max LIST    llama.cpp's draft length (--spec-draft-n-max), comma-separated: one
#                       speculative run per value and prompt (default: the tool's default, 3 in the
#                       pinned build; the report prints the value used)
#   --draft-min N       --spec-draft-n-min (default: the tool's, 0)
#   --draft-p-min P     --spec-draft-p-min, greedy draft cut-off probability (default: the tool's, 0)
# capacity only:
#   --sessions LIST     concurrent requests per row, comma-separated (default: 1,2,4,8,16)
#   --prompt-count P    distinct prompts: the first prompt of each of the first P categories;
#                       request i takes prompt i mod P (default: 4, as `sequoia bench capacity`)
#
# Environment:
#   SEQUOIA_PEER_DIR    where scripts/peer-llamacpp.sh keeps sources and builds (default:
#                       ~/.cache/sequoia/peer)
#   SEQUOIA_MODELS      models folder (default: ~/.cache/sequoia/models)
#   LLAMA_CPP_PYTHON_VERSION  the llama-cpp-python version whose vendored llama.cpp was built
#                       (default: the one scripts/peer-llamacpp.sh pins); picks the default --bin-dir
#
# How the numbers are taken (from the pinned llama.cpp's source):
#   spec, plain      llama-completion -no-cnv (no chat template, exits after the generation),
#                    --temp 0. Its llama_perf lines: "eval time = X ms / R runs" are the one-token
#                    decode steps (the first generated token comes from the prompt pass, so
#                    R = tokens - 1, EOS included in the tokens). Decode seconds = X / 1000,
#                    tok/s = R / decode seconds (sampling time is outside X). Pooled tok/s =
#                    sum R / sum decode seconds.
#   spec, speculative  llama-speculative-simple -md DRAFT --spec-type draft-simple --temp 0 (without
#                    --spec-type this build does not speculate with a plain GGUF draft). It prints
#                    "decoded G tokens in S seconds": G counts every accepted token (EOS included),
#                    S is the wall time of the whole draft/verify loop after the prompt (drafting,
#                    verification and sampling). tok/s = G / S; pooled = sum G / sum S. Its loop
#                    stops only once it has *more* than -n tokens, and the step after it has
#                    exactly -n drafts without a length bound (draft-simple reads a bound of 0 as
#                    none), so with -n N-1 it generates N to N+D tokens (D = draft length) where the
#                    plain run generates N; the rates use each tool's own counts. Acceptance =
#                    n_accept / n_drafted from its summary.
#   Prompts: the first K of each category, interleaved across categories (the i-th of every
#   category, then the (i+1)-th), as `sequoia bench` selects them; the text is sent as is (the
#   --raw side of our bench; the tools tokenize it with the model's special-token rules, no BOS
#   for Qwen2.5). Generation stops at EOS or N tokens, as ours. Each prompt runs plain first, then
#   each speculative setting; every tool run loads the models itself (load time is not counted)
#   and does llama.cpp's usual warm-up pass before the timed part.
#   capacity         one llama-server per N: -np N -c N*C -t T -tb T --cache-ram 0, continuous
#                    batching on (its default), the model's chat template (jinja). Prompts: the
#                    first prompt of each category in order, the first P of them, rendered with
#                    the server's /apply-template (messages = one user turn, generation prompt on;
#                    `sequoia bench capacity` renders the same GGUF template). One warm-up request
#                    (4 tokens) after /health, not counted; then N requests start together (one
#                    thread each): {prompt, n_predict: N, temperature: 0, cache_prompt: false}.
#                    tokens/s = sum of tokens_predicted / wall seconds from the first request sent
#                    to the last answer (prompt processing included, as in our capacity rows);
#                    ms/token = each request's timings.predicted_per_token_ms (its own decode
#                    time / tokens), p50/p99 over the N requests (our p50/p99 are over steps).
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib/peer-common.sh
source "$SCRIPT_DIR/lib/peer-common.sh"

log() { echo "peer-serving: $*" >&2; }
die() {
    echo "peer-serving: ERROR: $*" >&2
    exit 1
}
usage() { sed -n '2,/^set -euo pipefail/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

MODE=
case ${1:-} in
spec | capacity) MODE=$1; shift ;;
-h | --help) usage; exit 0 ;;
"") die "give a mode: spec or capacity (see --help)" ;;
*) die "unknown mode '$1': want spec or capacity (see --help)" ;;
esac

TARGET=qwen2.5-coder-1.5b
DRAFT=qwen2.5-coder-0.5b
THREADS=2
MAX_TOKENS=
PROMPTS=$REPO_ROOT/tests/data/spec_bench/question.jsonl
CTX=
JSON_OUT=
BIN_DIR=$PEER_DIR/build/llama.cpp-$LCP_VERSION-native/bin
LOG_DIR=
PER_CATEGORY=1
CATEGORIES=
DRAFT_MAX=
DRAFT_MIN=
DRAFT_P_MIN=
SESSIONS=1,2,4,8,16
PROMPT_COUNT=4

spec_only() { [[ $MODE == spec ]] || die "$1 is a spec option (see --help)"; }
capacity_only() { [[ $MODE == capacity ]] || die "$1 is a capacity option (see --help)"; }
need_arg() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value (see --help)"; }
while [[ $# -gt 0 ]]; do
    case $1 in
    --target) need_arg "$@"; TARGET=$2; shift 2 ;;
    --threads) need_arg "$@"; THREADS=$2; shift 2 ;;
    --max-tokens) need_arg "$@"; MAX_TOKENS=$2; shift 2 ;;
    --prompts) need_arg "$@"; PROMPTS=$2; shift 2 ;;
    --ctx) need_arg "$@"; CTX=$2; shift 2 ;;
    --json) need_arg "$@"; JSON_OUT=$2; shift 2 ;;
    --bin-dir) need_arg "$@"; BIN_DIR=$2; shift 2 ;;
    --log-dir) need_arg "$@"; LOG_DIR=$2; shift 2 ;;
    --draft) need_arg "$@"; DRAFT=$2; shift 2 ;;
    --per-category) spec_only "$1"; need_arg "$@"; PER_CATEGORY=$2; shift 2 ;;
    --categories) spec_only "$1"; need_arg "$@"; CATEGORIES=$2; shift 2 ;;
    --draft-max) spec_only "$1"; need_arg "$@"; DRAFT_MAX=$2; shift 2 ;;
    --draft-min) spec_only "$1"; need_arg "$@"; DRAFT_MIN=$2; shift 2 ;;
    --draft-p-min) spec_only "$1"; need_arg "$@"; DRAFT_P_MIN=$2; shift 2 ;;
    --sessions) capacity_only "$1"; need_arg "$@"; SESSIONS=$2; shift 2 ;;
    --prompt-count) capacity_only "$1"; need_arg "$@"; PROMPT_COUNT=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
    esac
done

if [[ $MODE == spec ]]; then
    MAX_TOKENS=${MAX_TOKENS:-64}
    CTX=${CTX:-4096}
else
    MAX_TOKENS=${MAX_TOKENS:-48}
    CTX=${CTX:-2048}
fi
posint='^[1-9][0-9]*$'
[[ $THREADS =~ $posint ]] || die "--threads must be a positive integer, got '$THREADS'"
[[ $MAX_TOKENS =~ $posint ]] || die "--max-tokens must be a positive integer, got '$MAX_TOKENS'"
[[ $CTX =~ $posint ]] || die "--ctx must be a positive integer, got '$CTX'"
((CTX > MAX_TOKENS + 1)) || die "--ctx $CTX leaves no room for a prompt and $MAX_TOKENS new tokens"
[[ $PER_CATEGORY =~ $posint ]] || die "--per-category must be a positive integer, got '$PER_CATEGORY'"
[[ $PROMPT_COUNT =~ $posint ]] || die "--prompt-count must be a positive integer, got '$PROMPT_COUNT'"
[[ $SESSIONS =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "--sessions must look like 1,2,4,8, got '$SESSIONS'"
[[ -z $DRAFT_MAX || $DRAFT_MAX =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
    die "--draft-max must look like 3 or 3,8,16, got '$DRAFT_MAX'"
[[ -z $DRAFT_MAX || $(tr , '\n' <<<"$DRAFT_MAX" | sort | uniq -d) == "" ]] || die "--draft-max has a value twice: '$DRAFT_MAX'"
[[ -z $DRAFT_MIN || $DRAFT_MIN =~ ^[0-9]+$ ]] || die "--draft-min must be a non-negative integer, got '$DRAFT_MIN'"
[[ -z $DRAFT_P_MIN || $DRAFT_P_MIN =~ ^(0(\.[0-9]*)?|1(\.0*)?|\.[0-9]+)$ ]] ||
    die "--draft-p-min must be a probability in [0, 1], got '$DRAFT_P_MIN'"
[[ -z $CATEGORIES || $CATEGORIES =~ ^[^,]+(,[^,]+)*$ ]] || die "--categories must look like writing,coding, got '$CATEGORIES'"
[[ -f $PROMPTS ]] || die "prompt file $PROMPTS does not exist (--prompts)"
PROMPTS=$(cd "$(dirname "$PROMPTS")" && pwd)/$(basename "$PROMPTS")
if [[ -n $JSON_OUT ]]; then
    mkdir -p "$(dirname "$JSON_OUT")"
    JSON_OUT=$(cd "$(dirname "$JSON_OUT")" && pwd)/$(basename "$JSON_OUT")
fi

command -v python3 >/dev/null || die "python3 is needed (prompt selection, HTTP requests and the report)"
if [[ $MODE == capacity ]]; then
    command -v curl >/dev/null || die "curl is needed (to wait for llama-server's /health)"
fi

# ---------------------------------------------------------------- tools and models
if [[ $MODE == spec ]]; then TOOLS=(llama-completion llama-speculative-simple); else TOOLS=(llama-server); fi
for t in "${TOOLS[@]}"; do
    [[ -x $BIN_DIR/$t ]] ||
        die "$BIN_DIR/$t is missing: build llama.cpp with $REPO_ROOT/scripts/peer-llamacpp.sh --only-build --no-avx2 (or pass --bin-dir DIR)"
done
BIN_DIR=$(cd "$BIN_DIR" && pwd)
LLAMA_VERSION=$("$BIN_DIR/${TOOLS[0]}" --version 2>&1 | sed -n 's/^version: *//p' | head -1 || true)
[[ -n $LLAMA_VERSION ]] || LLAMA_VERSION=unknown

TARGET_PATH=$(resolve_model "$TARGET")
log "target: $TARGET_PATH"
DRAFT_PATH=
if [[ $MODE == spec ]]; then
    DRAFT_PATH=$(resolve_model "$DRAFT")
    log "draft:  $DRAFT_PATH"
elif [[ $DRAFT != qwen2.5-coder-0.5b ]]; then
    log "capacity serves the target alone (as the plain rows of sequoia bench capacity): --draft is not used"
fi

CPU_MODEL=$( (lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1) || true)
[[ -n $CPU_MODEL ]] || CPU_MODEL=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//' || echo unknown)
LOADAVG=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')

SERVER_PID=
if [[ -n $LOG_DIR ]]; then
    mkdir -p "$LOG_DIR"
    WORK=$(cd "$LOG_DIR" && pwd)
    cleanup() { stop_server; }
else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/peer-serving.XXXXXX")
    cleanup() {
        stop_server
        rm -rf "$WORK"
    }
fi
stop_server() {
    if [[ -n $SERVER_PID ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# fail LOG MESSAGE: show the end of a tool's log, then stop.
fail() {
    tail -n 30 "$1" >&2 || true
    die "$2 (log above; keep all logs with --log-dir DIR)"
}

export PEER_MODE=$MODE PEER_WORK=$WORK PEER_PROMPTS=$PROMPTS PEER_MAX_TOKENS=$MAX_TOKENS \
    PEER_THREADS=$THREADS PEER_CTX=$CTX PEER_TARGET=$TARGET_PATH PEER_DRAFT=$DRAFT_PATH \
    PEER_JSON=$JSON_OUT PEER_CPU=$CPU_MODEL PEER_LOADAVG=$LOADAVG PEER_LLAMA_VERSION=$LLAMA_VERSION \
    PEER_BIN_DIR=$BIN_DIR PEER_LCP_VERSION=$LCP_VERSION PEER_PER_CATEGORY=$PER_CATEGORY \
    PEER_CATEGORIES=$CATEGORIES PEER_DRAFT_MAX=$DRAFT_MAX PEER_DRAFT_MIN=$DRAFT_MIN \
    PEER_DRAFT_P_MIN=$DRAFT_P_MIN PEER_SESSIONS=$SESSIONS PEER_PROMPT_COUNT=$PROMPT_COUNT

# ---------------------------------------------------------------- prompt selection
# Writes $WORK/prompts/NNN.txt (the first turn, exactly) and $WORK/prompts.tsv (index, id,
# category). spec: the first K per category, interleaved across categories, optionally only
# --categories (as `sequoia bench`); capacity: the first prompt of each category, the first P of
# them, wrapping around when P exceeds the categories (as `sequoia bench capacity`).
python3 - <<'PY' || exit 1
import json, os, sys

env = os.environ
path = env["PEER_PROMPTS"]
order, by_cat = [], {}
with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f):
        if not line.strip():
            continue
        try:
            v = json.loads(line)
            text = v["turns"][0]
            assert isinstance(text, str)
        except Exception:
            sys.exit(f'peer-serving: ERROR: {path}:{i + 1}: not a JSON object with a "turns" list of strings')
        qid = v.get("question_id", i + 1)
        cat = v.get("category") or "all"
        if cat not in by_cat:
            order.append(cat)
            by_cat[cat] = []
        by_cat[cat].append((qid, cat, text))
if not order:
    sys.exit(f"peer-serving: ERROR: {path} has no prompts")

picked = []
if env["PEER_MODE"] == "spec":
    wanted = [c for c in env["PEER_CATEGORIES"].split(",") if c]
    missing = [c for c in wanted if c not in by_cat]
    if missing:
        sys.exit(f"peer-serving: ERROR: no prompts of categories {missing} in {path}; "
                 f"it has: {','.join(order)}")
    cats = [c for c in order if not wanted or c in wanted]
    for i in range(int(env["PEER_PER_CATEGORY"])):
        for c in cats:
            if i < len(by_cat[c]):
                picked.append(by_cat[c][i])
else:
    firsts = [by_cat[c][0] for c in order]
    picked = [firsts[i % len(firsts)] for i in range(int(env["PEER_PROMPT_COUNT"]))]

d = os.path.join(env["PEER_WORK"], "prompts")
os.makedirs(d, exist_ok=True)
with open(os.path.join(env["PEER_WORK"], "prompts.tsv"), "w") as tsv:
    for n, (qid, cat, text) in enumerate(picked):
        # llama.cpp's -f drops one trailing newline of the file: add one so the text stays exact.
        with open(os.path.join(d, f"{n:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(text + ("\n" if text.endswith("\n") else ""))
        tsv.write(f"{n:03d}\t{qid}\t{cat}\n")
print(f"peer-serving: {len(picked)} prompts from {len(order)} categories of {path}", file=sys.stderr)
PY

# ---------------------------------------------------------------- spec
run_spec() {
    local common=(-t "$THREADS" -tb "$THREADS" -c "$CTX" -b "$CTX" --temp 0 --seed 0 --no-escape --perf
        --log-colors off)
    local spec_common=(-md "$DRAFT_PATH" --spec-type draft-simple -td "$THREADS" -tbd "$THREADS")
    [[ -n $DRAFT_MIN ]] && spec_common+=(--spec-draft-n-min "$DRAFT_MIN")
    [[ -n $DRAFT_P_MIN ]] && spec_common+=(--spec-draft-p-min "$DRAFT_P_MIN")
    local settings=(default)
    [[ -n $DRAFT_MAX ]] && IFS=, read -r -a settings <<<"$DRAFT_MAX"
    local total n idx qid cat file cmd d
    total=$(wc -l <"$WORK/prompts.tsv")
    n=0
    while IFS=$'\t' read -r idx qid cat; do
        n=$((n + 1))
        file=$WORK/prompts/$idx.txt
        log "[$n/$total] $cat #$qid: plain"
        cmd=("$BIN_DIR/llama-completion" -m "$TARGET_PATH" -f "$file" "${common[@]}" -n "$MAX_TOKENS" -no-cnv)
        echo "${cmd[*]}" >"$WORK/cmd-plain-$idx.txt"
        "${cmd[@]}" </dev/null >"$WORK/plain-$idx.log" 2>&1 ||
            fail "$WORK/plain-$idx.log" "llama-completion failed on prompt $qid"
        for d in "${settings[@]}"; do
            log "[$n/$total] $cat #$qid: speculative (draft-max $d)"
            # -n N-1: speculative-simple stops once it has more than -n tokens (see the header:
            # N to N+D tokens).
            cmd=("$BIN_DIR/llama-speculative-simple" -m "$TARGET_PATH" -f "$file" "${common[@]}"
                -n "$((MAX_TOKENS - 1))" "${spec_common[@]}")
            [[ $d != default ]] && cmd+=(--spec-draft-n-max "$d")
            echo "${cmd[*]}" >"$WORK/cmd-spec-$d-$idx.txt"
            "${cmd[@]}" </dev/null >"$WORK/spec-$d-$idx.log" 2>&1 ||
                fail "$WORK/spec-$d-$idx.log" "llama-speculative-simple failed on prompt $qid"
        done
    done <"$WORK/prompts.tsv"
    PEER_SETTINGS=$(
        IFS=,
        echo "${settings[*]}"
    )
    export PEER_SETTINGS
}

# ---------------------------------------------------------------- capacity
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
run_capacity() {
    local n port slog cmd i
    for n in ${SESSIONS//,/ }; do
        port=$(free_port)
        slog=$WORK/server-np$n.log
        cmd=("$BIN_DIR/llama-server" -m "$TARGET_PATH" -np "$n" -c "$((n * CTX))" -t "$THREADS"
            -tb "$THREADS" --host 127.0.0.1 --port "$port" --cache-ram 0 --jinja --no-webui
            --log-colors off)
        log "$n sessions: ${cmd[*]}"
        echo "${cmd[*]}" >"$WORK/cmd-server-np$n.txt"
        "${cmd[@]}" </dev/null >"$slog" 2>&1 &
        SERVER_PID=$!
        for ((i = 0; ; i++)); do
            kill -0 "$SERVER_PID" 2>/dev/null || {
                wait "$SERVER_PID" 2>/dev/null || true
                SERVER_PID=
                fail "$slog" "llama-server -np $n exited during start-up"
            }
            curl -sf -o /dev/null "http://127.0.0.1:$port/health" && break
            ((i < 600)) || fail "$slog" "llama-server -np $n not healthy after 300 s"
            sleep 0.5
        done
        PEER_URL=http://127.0.0.1:$port PEER_N=$n python3 - <<'PY' || fail "$slog" "requests to llama-server -np $n failed"
import json, os, sys, threading, time, urllib.error, urllib.request

env = os.environ
url, n, work = env["PEER_URL"], int(env["PEER_N"]), env["PEER_WORK"]
max_tokens = int(env["PEER_MAX_TOKENS"])


def post(path, body, timeout=3600):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {path}: HTTP {e.code}: {e.read()[:500]!r}") from None


prompts = []
with open(os.path.join(work, "prompts.tsv")) as tsv:
    for line in tsv:
        idx, qid, cat = line.rstrip("\n").split("\t")
        with open(os.path.join(work, "prompts", idx + ".txt"), encoding="utf-8") as f:
            text = f.read()
        if text.endswith("\n"):
            text = text[:-1]  # a text ending in a newline got one more for llama.cpp's -f
        rendered = post("/apply-template", {"messages": [{"role": "user", "content": text}]})["prompt"]
        prompts.append({"question_id": qid, "category": cat, "prompt": rendered})
with open(os.path.join(work, f"rendered-np{n}.json"), "w") as f:
    json.dump(prompts, f, indent=1)


def body(p, tokens):
    return {"prompt": p["prompt"], "n_predict": tokens, "temperature": 0, "cache_prompt": False,
            "stream": False}


post("/completion", body(prompts[0], 4))  # warm-up, not counted

results, errors = [None] * n, []


def one(i):
    try:
        t = time.perf_counter()
        r = post("/completion", body(prompts[i % len(prompts)], max_tokens))
        results[i] = {"prompt": i % len(prompts), "tokens": r["tokens_predicted"],
                      "latency_s": time.perf_counter() - t, "timings": r["timings"],
                      "stop_type": r.get("stop_type")}
    except Exception as e:  # reported below
        errors.append(f"request {i}: {e}")


threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
t0 = time.perf_counter()
for t in threads:
    t.start()
for t in threads:
    t.join()
wall = time.perf_counter() - t0
if errors:
    sys.exit("peer-serving: ERROR: " + "; ".join(errors))
with open(os.path.join(work, f"capacity-np{n}.json"), "w") as f:
    json.dump({"sessions": n, "wall_s": wall, "requests": results}, f, indent=1)
tokens = sum(r["tokens"] for r in results)
print(f"peer-serving: {n} sessions: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s",
      file=sys.stderr)
PY
        stop_server
    done
}

if [[ $MODE == spec ]]; then run_spec; else run_capacity; fi

# ---------------------------------------------------------------- report
python3 - <<'PY'
import json, os, re, sys

env = os.environ
work, mode = env["PEER_WORK"], env["PEER_MODE"]
out = []
w = out.append


def f(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def num(pattern, text, what, log, cast=float):
    m = re.search(pattern, text)
    if not m:
        sys.exit(f"peer-serving: ERROR: no '{what}' line in {log} (keep logs with --log-dir)")
    return tuple(cast(g) for g in m.groups()) if len(m.groups()) > 1 else cast(m.group(1))


def pct(xs, q):
    s = sorted(xs)
    return s[round((len(s) - 1) * q)] if s else None


prompts = []
with open(os.path.join(work, "prompts.tsv")) as tsv:
    for line in tsv:
        idx, qid, cat = line.rstrip("\n").split("\t")
        prompts.append({"index": idx, "question_id": qid, "category": cat})

w(f"## llama.cpp peers: {'plain vs draft-model speculation' if mode == 'spec' else 'llama-server capacity'} (CPU)")
w("")
w(f"- CPU: {env['PEER_CPU']}; threads: {env['PEER_THREADS']}; load average at start: {env['PEER_LOADAVG']}")
w(f"- llama.cpp {env['PEER_LLAMA_VERSION']} (vendored in llama-cpp-python {env['PEER_LCP_VERSION']}), tools from {env['PEER_BIN_DIR']}")
w(f"- target: {os.path.basename(env['PEER_TARGET'])}" + (f"; draft: {os.path.basename(env['PEER_DRAFT'])}" if mode == "spec" else ""))
doc = {"mode": mode, "cpu": env["PEER_CPU"], "threads": int(env["PEER_THREADS"]),
       "load_average": env["PEER_LOADAVG"], "llama_cpp": env["PEER_LLAMA_VERSION"],
       "llama_cpp_python_version": env["PEER_LCP_VERSION"], "bin_dir": env["PEER_BIN_DIR"],
       "target": env["PEER_TARGET"], "prompts_file": env["PEER_PROMPTS"],
       "max_tokens": int(env["PEER_MAX_TOKENS"]), "ctx": int(env["PEER_CTX"])}

if mode == "spec":
    settings = env["PEER_SETTINGS"].split(",")
    rows = []
    for p in prompts:
        idx = p["index"]
        log = os.path.join(work, f"plain-{idx}.log")
        text = open(log, errors="replace").read()
        eval_ms, runs = num(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs", text, "eval time", log)
        ptok = num(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", text, "prompt eval time", log, int)
        # Every sampled token but the last is decoded as a one-token step (the first comes from
        # the prompt pass; the last, the N-th or EOS, is never fed back).
        plain = {"tokens": int(runs) + 1, "decode_steps": int(runs), "decode_s": eval_ms / 1000,
                 "tok_s": runs / (eval_ms / 1000) if eval_ms > 0 else None}
        spec = {}
        for s in settings:
            log = os.path.join(work, f"spec-{s}-{idx}.log")
            text = open(log, errors="replace").read()
            enc = num(r"encoded\s+(\d+) tokens in", text, "encoded", log, int)
            g, secs = num(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text, "decoded", log)
            n_draft = num(r"n_draft\s*=\s*(\d+)", text, "n_draft", log, int)
            drafted = num(r"n_drafted\s*=\s*(\d+)", text, "n_drafted", log, int)
            accepted = num(r"n_accept\s*=\s*(\d+)", text, "n_accept", log, int)
            spec[s] = {"tokens": int(g), "decode_s": secs, "tok_s": g / secs if secs > 0 else None,
                       "draft_max": n_draft, "drafted": drafted, "accepted": accepted,
                       "acceptance": accepted / drafted if drafted else None,
                       "prompt_tokens": enc}
        rows.append({**p, "prompt_tokens": ptok, "plain": plain, "speculative": spec})

    label = {s: f"spec d{rows[0]['speculative'][s]['draft_max']}" if rows else s for s in settings}
    per_cat = env["PEER_PER_CATEGORY"]
    cats = env["PEER_CATEGORIES"] or "all"
    w(f"- prompts: {len(rows)} (first {per_cat} per category, categories: {cats}), raw text, greedy, at most {env['PEER_MAX_TOKENS']} new tokens, -c {env['PEER_CTX']}")
    w("- plain: llama-completion, tok/s = decode steps / eval time (llama_perf; the first token comes from the prompt pass)")
    w("- spec dD: llama-speculative-simple --spec-type draft-simple, draft length D; tok/s = decoded tokens / its decode seconds (drafting, verification and sampling); it stops after N to N+D tokens (see the script's header)")
    w("")
    head = "| # | category | id | prompt tok | plain tok | plain s | plain tok/s |"
    line = "|---:|---|---:|---:|---:|---:|---:|"
    for s in settings:
        head += f" {label[s]} tok | s | tok/s | accept | × plain |"
        line += "---:|---:|---:|---:|---:|"
    w(head)
    w(line)
    for i, r in enumerate(rows):
        pl = r["plain"]
        cells = [str(i + 1), r["category"], str(r["question_id"]), str(r["prompt_tokens"]),
                 str(pl["tokens"]), f(pl["decode_s"]), f(pl["tok_s"])]
        for s in settings:
            sp = r["speculative"][s]
            ratio = sp["tok_s"] / pl["tok_s"] if sp["tok_s"] and pl["tok_s"] else None
            sp["vs_plain"] = ratio
            acc = "—" if sp["acceptance"] is None else f"{100 * sp['acceptance']:.0f}%"
            cells += [str(sp["tokens"]), f(sp["decode_s"]), f(sp["tok_s"]), acc, f(ratio)]
        w("| " + " | ".join(cells) + " |")
    # Pooled: total tokens / total decode seconds.
    p_steps = sum(r["plain"]["decode_steps"] for r in rows)
    p_secs = sum(r["plain"]["decode_s"] for r in rows)
    p_tok = sum(r["plain"]["tokens"] for r in rows)
    pooled = {"plain": {"tokens": p_tok, "decode_steps": p_steps, "decode_s": p_secs,
                        "tok_s": p_steps / p_secs if p_secs > 0 else None}}
    w("")
    w("| pooled | tokens | decode s | tok/s | × plain | accept |")
    w("|---|---:|---:|---:|---:|---:|")
    w(f"| plain | {p_tok} | {f(p_secs)} | {f(pooled['plain']['tok_s'])} | — | — |")
    for s in settings:
        t = sum(r["speculative"][s]["tokens"] for r in rows)
        secs = sum(r["speculative"][s]["decode_s"] for r in rows)
        dr = sum(r["speculative"][s]["drafted"] for r in rows)
        ac = sum(r["speculative"][s]["accepted"] for r in rows)
        tps = t / secs if secs > 0 else None
        ratio = tps / pooled["plain"]["tok_s"] if tps and pooled["plain"]["tok_s"] else None
        pooled[label[s]] = {"tokens": t, "decode_s": secs, "tok_s": tps, "vs_plain": ratio,
                            "drafted": dr, "accepted": ac, "acceptance": ac / dr if dr else None}
        acc = "—" if not dr else f"{100 * ac / dr:.0f}%"
        w(f"| {label[s]} | {t} | {f(secs)} | {f(tps)} | {f(ratio)} | {acc} |")
    w("")
    w("Pooled tok/s = total tokens / total decode seconds (plain: decode steps, i.e. tokens − 1 per prompt). "
      "× plain > 1: speculation is faster.")
    doc.update({"draft": env["PEER_DRAFT"], "per_category": int(per_cat),
                "categories": env["PEER_CATEGORIES"] or None,
                "draft_min": env["PEER_DRAFT_MIN"] or None, "draft_p_min": env["PEER_DRAFT_P_MIN"] or None,
                "settings": {s: label[s] for s in settings}, "prompts": rows, "pooled": pooled})
else:
    runs = []
    rendered = None
    for n in env["PEER_SESSIONS"].split(","):
        with open(os.path.join(work, f"capacity-np{n}.json")) as fh:
            runs.append(json.load(fh))
        if rendered is None:
            with open(os.path.join(work, f"rendered-np{n}.json")) as fh:
                rendered = json.load(fh)
    cats = ", ".join(f"{p['category']} #{p['question_id']}" for p in rendered)
    w(f"- prompts: {len(rendered)} (first of each category: {cats}), chat template via /apply-template, greedy, at most {env['PEER_MAX_TOKENS']} new tokens per request")
    w(f"- llama-server -np N -c N×{env['PEER_CTX']}, continuous batching, --cache-ram 0, cache_prompt false; one server per N, one warm-up request each")
    w("- tokens/s = Σ tokens_predicted / wall seconds of the N concurrent requests (prompt processing included); ms/token = per request timings.predicted_per_token_ms, p50/p99 over the requests")
    w("")
    w("| sessions | tokens | wall s | tokens/s | × 1 session | p50 ms/token | p99 ms/token | mean prompt ms |")
    w("|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    rows = []
    for r in runs:
        reqs = r["requests"]
        tokens = sum(q["tokens"] for q in reqs)
        tps = tokens / r["wall_s"]
        if base is None and r["sessions"] == 1:
            base = tps
        per_tok = [q["timings"]["predicted_per_token_ms"] for q in reqs if q["tokens"] > 0]
        prompt_ms = sum(q["timings"]["prompt_ms"] for q in reqs) / len(reqs)
        row = {"sessions": r["sessions"], "tokens": tokens, "wall_s": r["wall_s"],
               "aggregate_tokens_per_second": tps, "vs_one_session": tps / base if base else None,
               "p50_ms_per_token": pct(per_tok, 0.5), "p99_ms_per_token": pct(per_tok, 0.99),
               "mean_prompt_ms": prompt_ms, "requests": reqs}
        rows.append(row)
        w(f"| {r['sessions']} | {tokens} | {f(r['wall_s'])} | {f(tps, 1)} | {f(row['vs_one_session'])} | "
          f"{f(row['p50_ms_per_token'], 1)} | {f(row['p99_ms_per_token'], 1)} | {f(prompt_ms, 0)} |")
    doc.update({"prompt_count": int(env["PEER_PROMPT_COUNT"]), "ctx_per_slot": int(env["PEER_CTX"]),
                "prompts": rendered, "rows": rows})

print("\n".join(out))
if env["PEER_JSON"]:
    with open(env["PEER_JSON"], "w") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    print(f"peer-serving: wrote {env['PEER_JSON']}", file=sys.stderr)
PY
