"""A server that pretends to be the rendezvous daemon and says "no token needed".

An agent or `ddprun status` that holds a token must refuse it: anything can skip the challenge,
only the daemon that knows the token can answer AUTH_OK's MAC. Before, the agent went on and took
its MASTER_ADDR/PORT from whatever the impostor assigned. The impostor here answers HELLO with
CHALLENGE {"auth": false} and then records anything else the client sends (a JOIN would mean the
client accepted it). Loopback only; every wait bounded; the impostor's socket closes on exit.
"""
import json
import os
import select
import socket
import struct
import subprocess
import threading

BIN = os.environ.get("DDPRUN_BIN_DIR", "")
DDPRUN = os.path.join(BIN, "ddprun")
HELLO, CHALLENGE = 0x48, 0x68


class Impostor:
    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.after_challenge = []  # opcodes a client sent after the CHALLENGE
        self.stop = False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop:
            r, _, _ = select.select([self.sock], [], [], 0.2)
            if not r:
                continue
            c, _ = self.sock.accept()
            threading.Thread(target=self.client, args=(c,), daemon=True).start()

    def client(self, c):
        buf = b""
        challenged = False
        c.settimeout(30)
        try:
            while True:
                chunk = c.recv(65536)
                if not chunk:
                    return
                buf += chunk
                while len(buf) >= 5:
                    op, n = struct.unpack("<BI", buf[:5])
                    if len(buf) < 5 + n:
                        break
                    buf = buf[5 + n:]
                    if op == HELLO and not challenged:
                        body = json.dumps({"server_nonce": "ab" * 32, "auth": False}).encode()
                        c.sendall(struct.pack("<BI", CHALLENGE, len(body)) + body)
                        challenged = True
                    else:
                        self.after_challenge.append(op)
        except OSError:
            return
        finally:
            c.close()

    def close(self):
        self.stop = True
        self.thread.join(5)
        self.sock.close()


def main():
    imp = Impostor()
    try:
        env = dict(os.environ, DDPRUN_RDZV_TOKEN="the-real-daemons-token")
        agent = subprocess.run(
            [DDPRUN, "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             "127.0.0.1:%d" % imp.port, "--rdzv-id", "j1", "--rdzv-conf", "join_timeout=20", "--no-python", "/bin/sh",
             "-c", 'echo "MASTER=$MASTER_ADDR:$MASTER_PORT"'],
            capture_output=True, text=True, timeout=60, env=env)
        assert agent.returncode != 0, agent
        assert "did not ask for the token" in agent.stderr, agent.stderr
        assert "127.0.0.1:%d" % imp.port in agent.stderr, agent.stderr
        assert "MASTER=" not in agent.stdout, agent.stdout  # no worker ran on the impostor's word
        status = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", "127.0.0.1:%d" % imp.port, "--timeout", "20"],
                                capture_output=True, text=True, timeout=60, env=env)
        assert status.returncode != 0, status
        assert "did not ask for the token" in status.stderr, status.stderr
        assert imp.after_challenge == [], "a client went on after the impostor's CHALLENGE: %r" % imp.after_challenge
        # Without a token the same server is a daemon without one: status goes on (and gets no answer).
        quiet = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", "127.0.0.1:%d" % imp.port, "--timeout", "1"],
                               capture_output=True, text=True, timeout=60,
                               env={k: v for k, v in os.environ.items() if k != "DDPRUN_RDZV_TOKEN"})
        assert "did not ask for the token" not in quiet.stderr, quiet.stderr
    finally:
        imp.close()
    print("OK")


if __name__ == "__main__":
    main()
