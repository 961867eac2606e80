#!/usr/bin/env bash
# A bare install works: a fresh virtual environment outside the checkout with only what the
# README's first command installs (`pip install torch==2.13.0 -e .`, no extras), then that
# command with fewer steps, --resume of the run, export, generate and report on it. Each must
# exit 0, or — for a command that needs an extra — exit non-zero with one line naming the
# extra (`noloco[...]`); no step may print a traceback. Run by .ci/run before the test suite;
# `bash .ci/bare_install.sh` alone works too.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=$(mktemp -d /tmp/noloco-bare.XXXXXX)
trap 'rm -rf "$work"' EXIT
t0=$(date +%s)

python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 -e "$repo" \
    2> >(grep -v '^WARNING: Location' >&2)
noloco="$work/venv/bin/noloco"
run="$work/runs/first"
fail=0

# check NAME EXPECT CMD...: EXPECT is "ok" (exit 0), "extra:NAME" (non-zero, naming it) or
# "serves" (a server still up when `timeout` stops it: exit 124, and it said it listens)
check() {
    local name=$1 expect=$2
    shift 2
    local rc=0
    (cd "$work" && "$@") > "$work/out.txt" 2>&1 || rc=$?
    local why=""
    if grep -q "Traceback (most recent call last)" "$work/out.txt"; then
        why="printed a traceback"
    elif [[ $expect == ok && $rc -ne 0 ]]; then
        why="exit $rc"
    elif [[ $expect == serves ]]; then
        [[ $rc -eq 124 ]] || why="exit $rc before it was stopped"
        grep -q "listening on" "$work/out.txt" || why="$why; no 'listening on' line"
    elif [[ $expect == extra:* ]]; then
        local extra=${expect#extra:}
        if [[ $rc -eq 0 ]]; then
            grep -q "noloco\[$extra\]" "$work/out.txt" || why="exit 0 without noloco[$extra]"
        elif ! grep -q "noloco\[$extra\]" "$work/out.txt"; then
            why="exit $rc without a line naming noloco[$extra]"
        elif [[ $(grep -c . "$work/out.txt") -ne 1 ]]; then
            why="exit $rc, more than one line"
        fi
    fi
    if [[ -n $why ]]; then
        echo "bare install: FAIL $name: $why" >&2
        tail -n 20 "$work/out.txt" | sed 's/^/    /' >&2
        fail=1
    else
        echo "bare install: ok   $name (exit $rc)"
    fi
}

# the README's first command, shortened (its --steps is the only change)
check "train" ok "$noloco" train --steps 20 --out "$run"
status="import json, sys; s = json.load(open('$run/summary.json')); print(s['status'], s['steps'])"
check "completed" ok python3 -c "$status; sys.exit(s['status'] != 'completed')"
check "resume" ok "$noloco" train --resume "$run" --steps 30
check "resumed to 30" ok python3 -c "$status; sys.exit(s['status'] != 'completed' or s['steps'] != 30)"
check "generate" ok "$noloco" generate "$run" --prompt "def " --max-tokens 16
check "report" ok "$noloco" report "$run" --out "$work/report"
check "export" extra:hf "$noloco" export "$run" "$work/hf"
check "netsim predict" ok "$noloco" netsim predict "$run" --bandwidth 1e8
check "netsim --plot" extra:plot "$noloco" netsim predict "$run" --bandwidth 1e8 --plot p.png
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
check "coordinator" serves timeout 5 "$noloco" coordinator --host 127.0.0.1 --port "$port"

echo "bare install: $(( $(date +%s) - t0 )) s"
exit $fail
