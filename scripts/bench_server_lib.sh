# shellcheck shell=bash
# Shell functions of the serving benchmark scripts (sourced, not run). They expect PYTHON,
# MODEL, PORT, MAX_LEN, URL and OUT to be set; SERVE_FLAGS (words) is added to every
# `muse serve` that start_server runs, START_TIMEOUT (seconds, default 600) bounds a start.
#
# Every process started here runs in a session of its own (setsid) and is listed in PIDS, so
# that one which ignores SIGTERM is killed together with its engine and rank processes, and
# `stop_all_at_exit` leaves nothing behind when a script fails half-way or is cut by a
# timeout.

PIDS=""

launch() {  # NAME COMMAND...: COMMAND in the background, output in OUT/server-NAME.log
    local name=$1; shift
    setsid "$@" > "$OUT/server-$name.log" 2>&1 &
    LAST=$!
    PIDS="$PIDS $LAST"
}

wait_healthy() {  # NAME URL PID: wait for URL/health; give up when PID exits
    local name=$1 url=$2 pid=$3
    for _ in $(seq 1 "${START_TIMEOUT:-600}"); do
        if "$PYTHON" -c "import urllib.request; urllib.request.urlopen('$url/health')" \
            2>/dev/null; then return 0; fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    echo "$name did not start"; tail -20 "$OUT/server-$name.log"; return 1
}

stop_pids() {  # PID...: SIGTERM (each shuts its children down), SIGKILL their groups after 60 s
    local pid alive
    [ $# -eq 0 ] && return 0
    kill "$@" 2>/dev/null
    for _ in $(seq 1 120); do
        alive=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.5
    done
    for pid in "$@"; do kill -9 -- "-$pid" 2>/dev/null; done
    wait "$@" 2>/dev/null
    return 0
}

stop_all() {
    # shellcheck disable=SC2086  # PIDS is a list of numbers
    stop_pids $PIDS
    PIDS=""
}

stop_all_at_exit() {  # every server started here is stopped when the script ends, however
    trap stop_all EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM  # `timeout` sends TERM: exit, so that the EXIT trap runs
}

start_server() {  # NAME [serve flags...]: start `muse serve` on PORT and wait for /health
    local name=$1 extra; shift
    read -r -a extra <<< "${SERVE_FLAGS:-}"
    launch "$name" "$PYTHON" -m muse.cli serve "$MODEL" --port "$PORT" --max-model-len "$MAX_LEN" \
        "${extra[@]}" "$@"
    SERVER=$LAST
    wait_healthy "$name" "$URL" "$SERVER"
}

stop_server() {
    stop_pids "$SERVER"
    PIDS=${PIDS/ $SERVER/}
}
