#!/usr/bin/env bash
# A real `graphrelay serve --port` under a client, stopped with SIGTERM at the end (it must exit 0).
#   tools/bench_serve_http.sh PYTHON OUT_DIR RATES
#     The HTTP half of `bench serve`: the server on the benchmark's engine size, driven by
#     `bench serve --url` (same workload, same --out, so the report compares it with the
#     in-process run).
#   tools/bench_serve_http.sh --soak PYTHON OUT_DIR [BENCH SOAK ARGS...]
#     Issue 20's soak (`bench soak`: 512 streaming clients, 10% leaving mid-stream, 3 rounds) on
#     the server's default model and engine sizes: the clients queue beyond its slots
#     (GRAPHRELAY_SOAK_SERVER_ARGS adds server flags).
set -uo pipefail
soak=0
if [ "${1:-}" = "--soak" ]; then soak=1; shift; fi
py=$1; out=$2; shift 2; port=${GRAPHRELAY_BENCH_PORT:-8321}
if [ $soak = 1 ]; then
    # GRAPHRELAY_SOAK_SERVER_ARGS: extra server flags, e.g. "--dtype float32": in bf16 a
    # request's greedy or seeded text may change with the batch it shares (per-bucket kernels
    # round differently), which the soak's exact-text check cannot tell from a serving bug.
    read -r -a server_args <<< "${GRAPHRELAY_SOAK_SERVER_ARGS:-}"; log=$out/soak_server.log
else
    rates=$1; shift
    # The in-process run's engine exactly, so the difference is the HTTP layer's: same sizes,
    # and no sampling controls in the graph (the in-process workload uses none; `bench
    # controls` measures what carrying them costs).
    server_args=(--max-reqs 256 --max-batch 256 --max-seq-len 1024 --no-controls); log=$out/http_server.log
    # GRAPHRELAY_HTTP_TOKENIZER=FILE.gguf: SmolLM2's architecture with random weights and that
    # tokenizer (`python -m graphrelay.tools.tokenizer_gguf`), for a GPU machine the real
    # model's file cannot reach; the workload is then the in-process random-weights one.
    bench_args=()
    if [ -n "${GRAPHRELAY_HTTP_TOKENIZER:-}" ]; then
        server_args+=(--model smollm2-135m --weights random --tokenizer "$GRAPHRELAY_HTTP_TOKENIZER")
        bench_args=(--weights random)
    fi
    # GRAPHRELAY_HTTP_SERVER_ARGS: extra server flags, e.g. "--engine-placement thread".
    read -r -a extra_args <<< "${GRAPHRELAY_HTTP_SERVER_ARGS:-}"
    server_args+=("${extra_args[@]}")
fi
mkdir -p "$out"
# Not --quiet: the server's last line is the engine thread's own CPU time per iteration, to set
# beside the in-process run's (a time that grows under HTTP load is the interpreter lock).
"$py" -m graphrelay.tools.cli serve --port "$port" "${server_args[@]}" > "$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server' EXIT  # an early exit leaves no server behind
for _ in $(seq 1 180); do
    "$py" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" 2>/dev/null && break
    kill -0 $server 2>/dev/null || { echo "the server exited; see $log"; tail -5 "$log"; exit 1; }
    sleep 1
done
if [ $soak = 1 ]; then
    "$py" -m graphrelay.tools.cli bench soak --url "http://127.0.0.1:$port" --out "$out" "$@"
else
    "$py" -m graphrelay.tools.cli bench serve --url "http://127.0.0.1:$port" --rates "$rates" "${bench_args[@]}" --out "$out"
fi
rc=$?
trap - EXIT
kill -TERM $server
wait $server
server_rc=$?
grep -h "graphrelay serve: shut down" "$log"
if [ $server_rc -ne 0 ]; then
    echo "the server exited with status $server_rc after SIGTERM, not 0; see $log"; tail -5 "$log"
    rc=1
fi
exit $rc
