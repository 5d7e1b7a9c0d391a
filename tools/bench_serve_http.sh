#!/usr/bin/env bash
# The HTTP half of `bench serve`: start `graphrelay serve --port` on the benchmark's engine size,
# wait for /health, drive it with `bench serve --url` (same workload, same --out, so the report
# compares it with the in-process run), then stop the server with SIGTERM.
#   tools/bench_serve_http.sh PYTHON OUT_DIR RATES
set -uo pipefail
py=$1; out=$2; rates=$3; port=${GRAPHRELAY_BENCH_PORT:-8321}
"$py" -m graphrelay.tools.cli serve --port "$port" --max-reqs 256 --max-batch 256 --max-seq-len 1024 --quiet \
    > "$out/http_server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server' EXIT
for _ in $(seq 1 180); do
    "$py" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" 2>/dev/null && break
    kill -0 $server 2>/dev/null || { echo "the server exited; see $out/http_server.log"; tail -5 "$out/http_server.log"; exit 1; }
    sleep 1
done
"$py" -m graphrelay.tools.cli bench serve --url "http://127.0.0.1:$port" --rates "$rates" --out "$out"
