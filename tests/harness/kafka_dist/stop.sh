#!/usr/bin/env bash
# Stops the broker that start.sh beside it started in $DATA_DIR: SIGTERM (a clean shutdown), then
# SIGKILL if it still runs after ${STOP_WAIT_S:-30} s. Only the pid of $DATA_DIR/kafka.pid is signalled.
set -euo pipefail
: "${DATA_DIR:?DATA_DIR, the data directory of the node}"
pid="$(cat "$DATA_DIR/kafka.pid" 2>/dev/null || true)"
[ -n "$pid" ] || exit 0
kill -TERM "$pid" 2>/dev/null || exit 0
deadline=$((SECONDS + ${STOP_WAIT_S:-30}))
while kill -0 "$pid" 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        kill -KILL "$pid" 2>/dev/null || true
        break
    fi
    sleep 0.2
done
