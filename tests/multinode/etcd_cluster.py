"""Real etcd members (Debian's /usr/bin/etcd) for the end-to-end tests: one or several members on
loopback addresses, ports picked free, data and logs under the test's directory. A member is ready
when it logs "serving client traffic" (read from its output pipe, no sleeping); members die with
the test process (PR_SET_PDEATHSIG) and carry the caller's environment (the orphan marker)."""
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

# One port picker for the tests that must name ports up front: etcd cannot bind port 0 and say
# which it got.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "single_node"))
from ports import free_port  # noqa: E402

ETCD = "/usr/bin/etcd"
ETCDCTL = "/usr/bin/etcdctl"
_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class TlsFiles:
    """A CA, a server certificate for 127.0.0.1 (server and client auth: etcd's gateway dials its
    own port with it) and a client certificate, made with the openssl CLI in `directory`."""

    def __init__(self, directory):
        script = (
            "set -e; "
            "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=ddprun-test-ca -keyout ca.key -out ca.pem; "
            "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth,clientAuth\\n' > srv.ext; "
            "openssl req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout server.key -out server.csr; "
            "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile srv.ext "
            "-out server.pem; "
            "printf 'extendedKeyUsage=clientAuth\\n' > cli.ext; "
            "openssl req -newkey rsa:2048 -nodes -subj /CN=root -keyout client.key -out client.csr; "
            "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile cli.ext "
            "-out client.pem")
        r = subprocess.run(["/bin/sh", "-c", script], cwd=directory, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError("openssl failed: " + r.stdout + r.stderr)
        j = lambda n: os.path.join(directory, n)  # noqa: E731
        self.ca, self.server_cert, self.server_key = j("ca.pem"), j("server.pem"), j("server.key")
        self.client_cert, self.client_key = j("client.pem"), j("client.key")


class Member:
    def __init__(self, name, host, directory, tls=False):
        self.tls = tls
        self.name = name
        self.host = host
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self.data_dir = os.path.join(directory, name + ".etcd")
        self.log_path = os.path.join(directory, name + ".log")
        self.proc = None
        self.ready = threading.Event()

    @property
    def endpoint(self):
        return "%s:%d" % (self.host, self.client_port)

    @property
    def client_url(self):
        return ("https://" if self.tls else "http://") + self.endpoint

    @property
    def peer_url(self):
        return "http://%s:%d" % (self.host, self.peer_port)

    def start(self, cluster, state, env, extra):
        args = [ETCD, "--name", self.name, "--data-dir", self.data_dir,
                "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
                "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", "ddprun-test", "--heartbeat-interval", "50",
                "--election-timeout", "500", "--logger", "zap", "--log-outputs", "stderr"] + list(extra)
        self.ready.clear()
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent)
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()

    def _pump(self, proc):
        with open(self.log_path, "ab") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if b"serving client traffic" in line:
                    self.ready.set()

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)


class EtcdCluster:
    """`tls`: a TlsFiles; the members then serve https with client-certificate auth."""

    def __init__(self, directory, env, size=1, hosts=None, extra=(), tls=None):
        hosts = hosts or ["127.0.0.1"] * size
        self.env = env
        self.extra = list(extra)
        if tls:
            self.extra += ["--cert-file", tls.server_cert, "--key-file", tls.server_key, "--trusted-ca-file", tls.ca,
                           "--client-cert-auth"]
        self.members = [Member("m%d" % i, hosts[i], directory, tls=bool(tls)) for i in range(size)]
        self.cluster = ",".join("%s=%s" % (m.name, m.peer_url) for m in self.members)
        for m in self.members:
            m.start(self.cluster, "new", env, self.extra)
        self.wait_ready(self.members)

    def wait_ready(self, members, timeout=30):
        deadline = time.monotonic() + timeout
        for m in members:
            if not m.ready.wait(max(0.1, deadline - time.monotonic())):
                with open(m.log_path, errors="replace") as f:
                    raise RuntimeError("etcd member %s did not get ready:\n%s" % (m.name, f.read()[-3000:]))

    @property
    def endpoints(self):
        return ",".join(m.endpoint for m in self.members)

    def restart(self, i):
        m = self.members[i]
        m.start(self.cluster, "existing", self.env, self.extra)
        self.wait_ready([m])

    def leader(self):
        """Index of the member that says it leads (etcdctl endpoint status), or -1."""
        for i, m in enumerate(self.members):
            if not m.alive():
                continue
            try:
                out = subprocess.run([ETCDCTL, "--endpoints", m.client_url, "--dial-timeout=1s",
                                      "--command-timeout=2s", "endpoint", "status", "-w", "json"],
                                     capture_output=True, text=True, timeout=5,
                                     env=dict(self.env, ETCDCTL_API="3"))
            except subprocess.TimeoutExpired:
                continue
            if out.returncode != 0:
                continue
            # Fields that are 0 are left out of etcdctl's JSON (no leader during an election).
            st = json.loads(out.stdout)[0]["Status"]
            if st.get("leader") and st.get("header", {}).get("member_id") == st["leader"]:
                return i
        return -1

    def wait_leader(self, timeout=15, exclude=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            i = self.leader()
            if i >= 0 and i != exclude:
                return i
            time.sleep(0.1)
        raise RuntimeError("no etcd leader within %s s" % timeout)

    def kill_all(self):
        for m in self.members:
            m.kill()
