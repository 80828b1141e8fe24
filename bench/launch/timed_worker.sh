#!/bin/sh
# Benchmark worker (adapted from shared/tools/torch-baseline/worker.sh): appends its wall-clock
# start time to $OUTF, and an `end` line just before it exits (teardown = launcher exit minus the
# last `end`). With FAIL_ONCE=1, rank 0 fails on attempt 0 while the other ranks block (exec
# sleep, so SIGTERM stops them at once): measures failure -> group restarted.
# With HOLD=1 every worker blocks (for footprint measurements).
echo "$(date +%s.%N) start rank=$RANK restart=$TORCHELASTIC_RESTART_COUNT" >> "$OUTF"
if [ "$FAIL_ONCE" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
  if [ "$RANK" = 0 ]; then
    echo "$(date +%s.%N) fail rank=$RANK" >> "$OUTF"; exit 1
  fi
  exec sleep 60
fi
if [ "$HOLD" = 1 ]; then exec sleep 60; fi
echo "$(date +%s.%N) end" >> "$OUTF"
exit 0
