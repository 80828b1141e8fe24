"""Worker for the TORCHELASTIC_ENABLE_FILE_TIMER tests: on the first attempt it arms a 1 s timer
through torch's own FileTimerClient (torch.distributed.elastic.timer) and then hangs past it; the
agent must kill it with the requested signal, and the restarted attempt records that it ran."""
import os
import signal
import sys
import time

out_dir = sys.argv[1]
sig = int(sys.argv[2]) if len(sys.argv) > 2 else int(signal.SIGKILL)
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = os.environ["RANK"]
with open(os.path.join(out_dir, f"timer_file.{restart}.{rank}"), "w") as f:
    f.write(os.environ.get("TORCHELASTIC_TIMER_FILE", ""))
if restart > 0:
    with open(os.path.join(out_dir, f"restarted.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    sys.exit(0)
if rank != "0":
    time.sleep(120)  # stopped by the agent when rank 0 is killed
    sys.exit(0)

import torch.distributed.elastic.timer as timer  # noqa: E402

timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"], signal=sig))
with open(os.path.join(out_dir, "armed"), "w") as f:
    f.write(str(os.getpid()))
with timer.expires(after=1, scope="stuck_step"):
    time.sleep(120)
sys.exit(5)  # the timer did not fire
