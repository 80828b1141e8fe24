"""ddprun --metrics-port 0 --nproc-per-node 2: scrape a running agent with urllib (every line
parsed strictly) while its workers run, let one worker fail so the group restarts, and check that
the attempt, restarts, rounds and worker states move; the endpoint listens on loopback unless
--metrics-host says otherwise (checked in /proc/net/tcp). Readiness: the agent's log line
`metrics on http://127.0.0.1:PORT/metrics`; the workers announce themselves with files and wait
for a `go` file, so the test never guesses timing."""
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prom_text  # noqa: E402
from common import BIN_DIR, PYTHON, check_hostile, listen_addresses, scrape  # noqa: E402
from prom_text import value  # noqa: E402

WORKER = """
import os, sys, time
d = sys.argv[1]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
rank = os.environ["LOCAL_RANK"]
open(os.path.join(d, f"ready_{attempt}_{rank}"), "w").close()
deadline = time.monotonic() + 100
while not os.path.exists(os.path.join(d, f"go_{attempt}")):
    assert time.monotonic() < deadline
    time.sleep(0.02)
sys.exit(3 if attempt == "0" and rank == "1" else 0)
"""


def wait_files(paths, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert proc.poll() is None, f"agent exited early with {proc.returncode}"
        assert time.monotonic() < deadline, f"workers never wrote {paths}"
        time.sleep(0.02)


def metrics_line(agent):
    """The port of the agent's `metrics on http://ADDR:PORT/metrics` line and ADDR."""
    buf = b""
    deadline = time.monotonic() + 30
    while True:
        m = re.search(rb"metrics on http://(\S+):(\d+)/metrics", buf)
        if m:
            return m.group(1).decode(), int(m.group(2))
        left = deadline - time.monotonic()
        assert left > 0, f"no metrics line (have {buf!r})"
        r, _, _ = select.select([agent.stderr], [], [], left)
        if r:
            chunk = os.read(agent.stderr.fileno(), 4096)
            assert chunk, f"agent exited early: {buf!r}"
            buf += chunk


def check_flags(tmp):
    """--metrics-host: every address when told, an IP literal only, and only with --metrics-port."""
    ddprun = os.path.join(BIN_DIR, "ddprun")
    ok = os.path.join(tmp, "ok.py")
    with open(ok, "w") as w:
        w.write("import os, sys, time\nwhile not os.path.exists(sys.argv[1]):\n    time.sleep(0.02)\n")
    go = os.path.join(tmp, "go_flags")
    agent = subprocess.Popen([ddprun, "--master-port", "0", "--metrics-port", "0", "--metrics-host", "0.0.0.0",
                              "--nproc-per-node", "1", PYTHON, ok, go], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        addr, port = metrics_line(agent)
        assert addr == "0.0.0.0", addr
        assert listen_addresses(port) == ["00000000"], listen_addresses(port)
        assert value(scrape(port), "ddprun_agent_rounds_total") == 1
        open(go, "w").close()
        _, err = agent.communicate(timeout=60)
        assert agent.returncode == 0, err.decode()[-3000:]
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    r = subprocess.run([ddprun, "--metrics-port", "0", "--metrics-host", "my-host", "--nproc-per-node", "1", PYTHON,
                        ok, go], capture_output=True, timeout=60)
    assert r.returncode != 0 and b"--metrics-host=my-host: not an IP address" in r.stderr, r
    r = subprocess.run([ddprun, "--metrics-host", "127.0.0.1", "--nproc-per-node", "1", PYTHON, ok, go],
                       capture_output=True, timeout=60)
    assert r.returncode != 0 and b"--metrics-host is given without --metrics-port" in r.stderr, r


def main():
    prom_text.self_test()
    with tempfile.TemporaryDirectory() as tmp:
        check_flags(tmp)
        worker = os.path.join(tmp, "worker.py")
        with open(worker, "w") as w:
            w.write(WORKER)
        agent = subprocess.Popen([os.path.join(BIN_DIR, "ddprun"), "--master-port", "0", "--metrics-port", "0",
                                  "--nproc-per-node", "2", "--max-restarts", "1", PYTHON, worker, tmp],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            buf = b""
            deadline = time.monotonic() + 30
            m = None
            while m is None:
                left = deadline - time.monotonic()
                assert left > 0, f"no metrics line (have {buf!r})"
                r, _, _ = select.select([agent.stderr], [], [], left)
                if r:
                    chunk = os.read(agent.stderr.fileno(), 4096)
                    assert chunk, f"agent exited early: {buf!r}"
                    buf += chunk
                    m = re.search(rb"metrics on http://127\.0\.0\.1:(\d+)/metrics", buf)
            port = int(m.group(1))
            assert listen_addresses(port) == ["0100007F"], listen_addresses(port)

            wait_files([os.path.join(tmp, f"ready_0_{r}") for r in (0, 1)], agent)
            f = scrape(port)
            assert value(f, "ddprun_agent_attempt") == 0
            assert value(f, "ddprun_agent_restarts_total") == 0
            assert value(f, "ddprun_agent_rounds_total") == 1
            assert value(f, "ddprun_agent_workers", state="running") == 2
            assert value(f, "ddprun_agent_in_rendezvous") == 0
            assert value(f, "ddprun_agent_rendezvous_seconds_total") >= 0
            version = f["ddprun_build_info"]["samples"][0][1]["version"]
            assert value(f, "ddprun_build_info", version=version) == 1

            open(os.path.join(tmp, "go_0"), "w").close()  # rank 1 fails: the group restarts
            wait_files([os.path.join(tmp, f"ready_1_{r}") for r in (0, 1)], agent)
            f = scrape(port)
            assert value(f, "ddprun_agent_attempt") == 1
            assert value(f, "ddprun_agent_restarts_total") == 1
            assert value(f, "ddprun_agent_rounds_total") == 2
            assert value(f, "ddprun_agent_workers", state="running") == 2

            check_hostile(port)
            open(os.path.join(tmp, "go_1"), "w").close()
            _, err = agent.communicate(timeout=60)
            assert agent.returncode == 0, (buf + err).decode()[-3000:]
            print("ok")
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()


if __name__ == "__main__":
    main()
