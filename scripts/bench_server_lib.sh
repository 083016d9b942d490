# Shell functions of the serving benchmark scripts (sourced, not run). They expect PYTHON,
# MODEL, PORT, MAX_LEN, URL and OUT to be set.

start_server() {  # NAME [serve flags...]: start `muse serve` and wait for /health
    local name=$1; shift
    "$PYTHON" -m muse.cli serve "$MODEL" --port "$PORT" --max-model-len "$MAX_LEN" "$@" \
        > "$OUT/server-$name.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 240); do
        if "$PYTHON" -c "import urllib.request; urllib.request.urlopen('$URL/health')" \
            2>/dev/null; then return 0; fi
        kill -0 "$SERVER" 2>/dev/null || break
        sleep 1
    done
    echo "server $name did not start"; tail -20 "$OUT/server-$name.log"; return 1
}

stop_server() {
    kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null
}
