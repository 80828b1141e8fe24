"""Remote probe for test_fixture_smoke.py: records what a command started over ssh sees when the
ssh client dies. stdlib only.

    ssh_probe.py OUT_FILE read|noread|silent

Appends lines to OUT_FILE: `started PID`, `signal N` for SIGHUP/SIGTERM/SIGINT/SIGPIPE received,
`eof` when stdin reaches EOF (mode read), `stdout-error ERRNO` when a write to stdout fails.
Modes read and noread write a heartbeat line to stdout every 50 ms (so a dead connection also
shows up as a write error or SIGPIPE); mode silent neither reads stdin nor writes stdout.
Exits 0 after EOF on stdin (mode read) or after 60 s.
"""
import os
import signal
import sys
import threading
import time

out_path, mode = sys.argv[1], sys.argv[2]


def note(text):
    with open(out_path, "a") as f:
        f.write(text + "\n")


def on_signal(signo, _frame):
    note("signal %d" % signo)
    if signo != signal.SIGPIPE:
        os._exit(128 + signo)


for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
    signal.signal(s, on_signal)
note("started %d" % os.getpid())
done = threading.Event()


def reader():
    while os.read(0, 4096):
        pass
    note("eof")
    done.set()


if mode == "read":
    threading.Thread(target=reader, daemon=True).start()
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not done.is_set():
    if mode == "silent":
        time.sleep(0.05)
        continue
    try:
        os.write(1, b"tick\n")
    except OSError as e:
        note("stdout-error %d" % e.errno)
        break
    time.sleep(0.05)
note("exit")
