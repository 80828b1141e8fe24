#!/bin/sh
# Fan-out benchmark worker: logs "<epoch seconds> start <RANK> <hostname>" to $OUTF, then exits,
# or (HOLD=1) stays silent until killed (only the launcher's control channel can stop it).
echo "$(date +%s.%N) start ${RANK} $(hostname)" >> "${OUTF:?OUTF not set}"
if [ "${HOLD:-0}" = 1 ]; then
  exec sleep 120
fi
