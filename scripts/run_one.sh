#!/bin/sh
# run_one.sh: launch one training job on this box, detached, with its sidecar.
#
#   scripts/run_one.sh [rgt-onbox launch options] -- python train.py --your --args
#
# A thin front for people who launch by hand: every argument goes to `rgt-onbox launch`
# unchanged (`rgt-onbox launch --help` lists the options: --project, --run-id, --profile,
# --ckpt-dir, --metrics, --durable-dir, --env NAME[=VALUE], --no-preflight, --min-free, --json).
# The launcher makes <root>/<project>/active/<run-id>, runs the pre-flight and the disk gate,
# starts the job in its own session (train.log, rgt/exit.json) and its sidecar, and returns.
#
# Secrets: never put a token in the command (nor in --env NAME=VALUE): export it, pass --env NAME
# and read it from the environment in the job. The launcher records variable names only.
#
# RGT_ONBOX names the rgt-onbox to run (default: the one on PATH, else `python3 -m onbox.cli`).
# Exit status is rgt-onbox's: 0 launched, 1 failed, 2 bad usage, 3 refused by a gate.
set -eu

usage() {
    echo "usage: $0 [rgt-onbox launch options] -- COMMAND [ARGS...]" >&2
    echo "  e.g. $0 --project mnist -- python train.py --epochs 20" >&2
}

if [ "$#" -eq 0 ]; then
    usage
    exit 2
fi

if [ -n "${RGT_ONBOX:-}" ]; then
    exec "$RGT_ONBOX" launch "$@"
elif command -v rgt-onbox >/dev/null 2>&1; then
    exec rgt-onbox launch "$@"
else
    exec python3 -m onbox.cli launch "$@"
fi
