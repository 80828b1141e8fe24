#!/bin/sh
# One rank of the mixed job of test_worker_lib_mix.py: the native example (worker library) and a
# torch 2.6 gloo worker run side by side in the same rank, on the same agent store.
#   mixed_rank.sh NATIVE_ALLREDUCE TORCH_WORKER.py
"$1" &
native=$!
"$PYTHON_EXEC" "$2"
torch_rc=$?
wait "$native"
native_rc=$?
echo "mixed rank $RANK: native exit $native_rc, torch exit $torch_rc"
[ "$native_rc" = 0 ] && [ "$torch_rc" = 0 ]
