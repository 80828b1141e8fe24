#!/bin/bash
# Prints the executable of a one-rank ddprun job's containment watchdog (ddprun from PATH): the
# process that calls itself ddp-watchdog and is a child of the job's agent, found by the worker
# through /proc/N/stat (the per-thread children files can miss a child while a thread ends).
# Used by deb_inside.sh and wheel_inside.sh, from their own directory.
set -euo pipefail
exec timeout 60 ddprun --master-port 0 --nproc-per-node 1 --no-python sh -c \
  'for d in /proc/[0-9]*; do [ "$(cat $d/comm 2>/dev/null)" = ddp-watchdog ] && [ "$(awk "{print \$4}" $d/stat 2>/dev/null)" = "$PPID" ] && readlink $d/exe; done; true'
