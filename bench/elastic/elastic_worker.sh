#!/bin/sh
# Elastic benchmark worker: logs its start (time, world size, restart count) and blocks.
echo "$(date +%s.%N) start rank=$RANK world=$WORLD_SIZE restart=$TORCHELASTIC_RESTART_COUNT" >> "$OUTF"
exec sleep 600
