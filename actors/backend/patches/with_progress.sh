#!/usr/bin/env bash
# Run a long, silent command, saying every PROGRESS_EVERY_S seconds (30) that it goes on,
# with the last "[ NN%]" step its output shows; its output goes to LOG, whose end is
# printed if it fails.
#   usage: with_progress.sh LOG COMMAND [ARGS...]
set -uo pipefail
LOG="$1"
shift
EVERY="${PROGRESS_EVERY_S:-30}"
"$@" > "$LOG" 2>&1 &
JOB=$!
START=$SECONDS
while kill -0 "$JOB" 2>/dev/null; do
    sleep "$EVERY" &
    wait $! || true
    if kill -0 "$JOB" 2>/dev/null; then
        STEP="$(grep -oE '\[ *[0-9]+%\]' "$LOG" | tail -n 1)"
        echo "  still building: $(( (SECONDS - START) / 60 ))m$(( (SECONDS - START) % 60 ))s ${STEP}"
    fi
done
if ! wait "$JOB"; then
    tail -n 40 "$LOG"
    echo "the build failed after $(( SECONDS - START )) s (the end of its log is above)" >&2
    exit 1
fi
echo "done in $(( (SECONDS - START) / 60 ))m$(( (SECONDS - START) % 60 ))s"
