#!/bin/sh
# Elastic benchmark worker: logs its start (time, world size, rank, restart count, pid) and blocks.
# `exec` keeps the pid, so the harness can crash a worker by pid.
echo "$(date +%s.%N) start rank=$RANK world=$WORLD_SIZE restart=$TORCHELASTIC_RESTART_COUNT pid=$$" >> "$OUTF"
exec sleep 600
