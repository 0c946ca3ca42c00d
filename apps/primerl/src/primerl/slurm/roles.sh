# --- primerl's role runner (shared by the rl, sft and eval templates) -------------------------
# Each role is one `srun` step in the background; its output goes to $LOGS/<role>.log.
# watch_roles: the first role that fails (or a server that stops) stops every role and ends the
# job with that role's exit status, its log path and its last lines in the job's output. When
# every finisher role has exited 0, the other roles (servers) are stopped and the job ends 0.
# Roles are stopped with SIGTERM (srun passes it to the tasks), then SIGKILL after GRACE_S; when
# this script exits, Slurm ends any step still running, on every node.
PIDS=()
NAMES=()
ROLE_LOGS=()
FINISHERS=" "
GRACE_S=${GRACE_S:-30}

say() { echo "primerl: $*"; }

# node_addr NODE: the address other nodes reach NODE at (its NodeAddr; usually its host name)
node_addr() { scontrol show node -o "$1" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2; }

# start_role NAME FINISHER(0|1) SRUN_ARGS... -- COMMAND...
start_role() {
    local name=$1 finisher=$2; shift 2
    local srun_args=()
    while [ "$1" != "--" ]; do srun_args+=("$1"); shift; done
    shift
    local log="$LOGS/$name.log"
    say "starting $name on ${NODES_OF_ROLE:-?} (log: $log)"
    srun --overlap --kill-on-bad-exit=1 "${srun_args[@]}" \
        bash -c 'source "$0"; exec "$@"' "$SETUP_FILE" "$@" >>"$log" 2>&1 &
    PIDS+=("$!")
    NAMES+=("$name")
    ROLE_LOGS+=("$log")
    [ "$finisher" = 1 ] && FINISHERS="$FINISHERS$name "
    return 0
}

stop_roles() {
    local pid alive i
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for ((i = 0; i < GRACE_S; i++)); do
        alive=0
        for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && return 0
        sleep 1
    done
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
    return 0
}

# one pass over the roles: exits the job when one failed; sets ALL_FINISHED=1 when every
# finisher has exited 0
DONE=" "
check_roles() {
    local i pid name code
    ALL_FINISHED=1
    for i in "${!PIDS[@]}"; do
        pid=${PIDS[$i]}
        name=${NAMES[$i]}
        case "$DONE" in *" $name "*) continue ;; esac
        if kill -0 "$pid" 2>/dev/null; then
            case "$FINISHERS" in *" $name "*) ALL_FINISHED=0 ;; esac
            continue
        fi
        wait "$pid"
        code=$?
        DONE="$DONE$name "
        case "$FINISHERS" in
            *" $name "*) [ "$code" = 0 ] && continue ;;
        esac
        if [ "$code" = 0 ]; then
            say "role $name stopped (exit code 0) while the run needed it; log: ${ROLE_LOGS[$i]}"
            code=1
        else
            say "role $name failed with exit code $code; log: ${ROLE_LOGS[$i]}"
        fi
        # the command's own error line (the primerl commands print one), then the log's end
        grep -h -m 5 -E '^primerl[a-z -]*: ' "${ROLE_LOGS[$i]}" | sed 's/^/    /'
        say "last lines of ${ROLE_LOGS[$i]}:"
        tail -n 25 "${ROLE_LOGS[$i]}" | sed 's/^/    /'
        say "stopping every other role"
        stop_roles
        exit "$code"
    done
    return 0
}

watch_roles() {
    while true; do
        check_roles
        if [ "$ALL_FINISHED" = 1 ]; then
            say "run finished; stopping the remaining roles"
            stop_roles
            exit 0
        fi
        sleep 2
    done
}

http_ok() {  # http_ok URL: 0 when URL answers 200
    if command -v curl >/dev/null 2>&1; then
        curl -sf -o /dev/null --max-time 5 "$1"
    else
        python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1" 2>/dev/null
    fi
}

# wait_for_servers URL...: until each answers /health, failing the job if a role dies meanwhile
wait_for_servers() {
    local url waited=0
    for url in "$@"; do
        until http_ok "$url/health"; do
            check_roles
            if [ "$waited" -ge "$SERVER_TIMEOUT_S" ]; then
                say "inference server $url did not come up within ${SERVER_TIMEOUT_S}s; see $LOGS/inference-*.log"
                stop_roles
                exit 1
            fi
            sleep 5
            waited=$((waited + 5))
        done
        say "inference server $url is up"
    done
}

trap 'say "job cancelled or timed out: stopping every role"; stop_roles; exit 143' TERM INT
# ----------------------------------------------------------------------------------------------
