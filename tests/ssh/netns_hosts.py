"""A real multi-host test bed on one machine: network namespaces with a real sshd in each.

    with SshCluster(3, tmpdir) as c:
        p = c.run_in_launcher_ns([DDPRUN, "--ssh-config", c.ssh_config, "--hosts", "h0,h1,h2", ...])
        ...
        c.assert_no_leftovers(15)

Topology (everything lives inside namespaces this object creates; the host's own network
configuration, /etc/hosts and /run are never touched):

  ddprun-<pid>-l     "launcher" namespace: bridge br0 = 10.203.K.1/24, one veth end per host
  ddprun-<pid>-h<i>  host i: eth0 = 10.203.K.(10+i)/24, sshd on :22, hostname h<i> (own UTS ns)
  ddprun-<pid>-hx    (optional) address 10.203.K.50, no sshd: connections are refused
  h9                 ssh config entry for 10.203.K.99: nothing answers there (unreachable)

Every process started in a namespace goes through `ip netns exec NS unshare --uts sh -c ...`,
whose private mount namespace (ip netns exec makes all mounts slaves) gets
  * /etc/hosts bind-mounted from a test file naming launcher, h0.. (so the names resolve everywhere,
    like on a real cluster, without editing the real /etc/hosts),
  * /root bind-mounted from a per-namespace home directory in the test dir (ssh and sshd use the
    passwd home, not $HOME; this keeps the machine's ~/.bashrc, pyenv shims etc. out of the hosts),
  * hosts only: a tmpfs on /run holding the privilege-separation directory /run/sshd that sshd needs.
K is derived from the pid; since the whole 10.203.K.0/24 lives behind the launcher namespace's
own routing table, concurrent test beds cannot collide even with equal K.

Keys are generated per bed (ssh-keygen ed25519: one host key, one user key). The client config
(`ssh -F FILE`, i.e. ddprun --ssh-config FILE) has a Host entry per name, the user key, User root,
StrictHostKeyChecking no, UserKnownHostsFile /dev/null, LogLevel ERROR.

Teardown (context exit, atexit, SIGTERM/SIGINT/SIGHUP of the test process): SIGKILL every process
in every namespace of the bed, delete the namespaces (this also removes the bridge and veths),
remove the test dir when the bed created it. Namespaces left behind by a bed whose process died
by SIGKILL are swept on the next bed's start (their pid no longer exists).

Not root, `ip netns add` failing or sshd/ssh missing: `skip(reason)` prints "SKIPPED: reason" and
exits 77 (ctest SKIP_RETURN_CODE).

Thread safety: none; one bed per test process, used from the main thread.
"""
import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SKIP_CODE = 77
SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
SSH_KEYGEN = "/usr/bin/ssh-keygen"
NS_PREFIX = "ddprun-"

# Runs in the private mount namespace that `ip netns exec` creates; $1 hostname, $2 hosts file,
# $3 home directory, $4 "run" to put a tmpfs on /run (for sshd), then the command.
_NS_WRAPPER = r'''
hostname "$1" || exit 120
mount --bind "$2" /etc/hosts || exit 121
mount --bind "$3" /root || exit 122
if [ "$4" = run ]; then
  mount -t tmpfs -o mode=0755 ddprun-run /run || exit 123
  mkdir -m 0755 /run/sshd || exit 124
fi
shift 4
exec "$@"
'''


class SkipTest(Exception):
    pass


def skip(reason):
    print("SKIPPED: %s" % reason, flush=True)
    sys.exit(SKIP_CODE)


def _run(argv, check=True, timeout=30):
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError("%s failed (exit %d): %s" % (" ".join(argv), r.returncode, r.stderr.strip()))
    return r


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _is_zombie(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def ns_pids(ns):
    """Pids of the live (non-zombie) processes whose network namespace is NS."""
    r = _run(["ip", "netns", "pids", ns], check=False)
    if r.returncode != 0:
        return []
    return [int(x) for x in r.stdout.split() if x.strip() and not _is_zombie(int(x))]


def sweep_stale_namespaces():
    """Deletes ddprun-<pid>-* namespaces of beds whose process is gone (killed by SIGKILL)."""
    r = _run(["ip", "netns", "list"], check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(r"^ddprun-(\d+)-(l|h\d+|hx)$", name)
        if m and not _pid_alive(int(m.group(1))):
            for pid in ns_pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _run(["ip", "netns", "del", name], check=False)


def preflight():
    """Raises SkipTest naming why the bed cannot be built here."""
    if os.geteuid() != 0:
        raise SkipTest("needs root (network namespaces, sshd); running as uid %d" % os.geteuid())
    for tool in (SSHD, SSH, SSH_KEYGEN):
        if not os.access(tool, os.X_OK):
            raise SkipTest("%s is missing (install openssh-server/openssh-client)" % tool)
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            raise SkipTest("%s is not on PATH" % tool)
    probe = "%sprobe-%d" % (NS_PREFIX, os.getpid())
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        raise SkipTest("`ip netns add` fails here: %s" % r.stderr.strip())
    r = _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"], check=False)
    _run(["ip", "netns", "del", probe], check=False)
    if r.returncode != 0:
        raise SkipTest("cannot create a bridge in a namespace: %s" % r.stderr.strip())


class SshCluster:
    def __init__(self, n_hosts, tmpdir=None, with_refusing_host=False, sshd_log_level="VERBOSE"):
        self.n = n_hosts
        self.pid = os.getpid()
        self.k = 20 + self.pid % 200
        self.subnet = "10.203.%d" % self.k
        self.launcher_ns = "%s%d-l" % (NS_PREFIX, self.pid)
        self.host_ns = ["%s%d-h%d" % (NS_PREFIX, self.pid, i) for i in range(n_hosts)]
        self.hosts = ["h%d" % i for i in range(n_hosts)]
        self.addrs = ["%s.%d" % (self.subnet, 10 + i) for i in range(n_hosts)]
        self.launcher_addr = "%s.1" % self.subnet
        self.with_refusing_host = with_refusing_host
        self.refusing_ns = "%s%d-hx" % (NS_PREFIX, self.pid)
        self.refusing_addr = "%s.50" % self.subnet
        self.unreachable_addr = "%s.99" % self.subnet
        self.sshd_log_level = sshd_log_level
        self._own_dir = tmpdir is None
        self.dir = tmpdir or tempfile.mkdtemp(prefix="ddprun-ssh-")
        self.sshd = {}  # host index -> Popen of the sshd daemon
        self._namespaces = []
        self._torn_down = False
        self._old_handlers = {}

    # ---------- setup ----------

    def __enter__(self):
        try:
            preflight()
        except SkipTest as e:
            self._cleanup_dir()
            skip(str(e))
        sweep_stale_namespaces()
        atexit.register(self.teardown)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._write_files()
            self._make_network()
            self._start_sshds()
            self.wait_ready(20)
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc):
        self.teardown()
        return False

    def _on_signal(self, signo, _frame):
        self.teardown()
        # Exit as a signal death would; no code after this in the test runs.
        os._exit(128 + signo)

    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    def _write_files(self):
        os.makedirs(self.path("keys"), exist_ok=True)
        for name in ["l"] + self.hosts + ["hx"]:
            os.makedirs(self.path("home", name), exist_ok=True)
        for i in range(self.n):
            os.makedirs(self.path("tmp-h%d" % i), exist_ok=True)
        self.host_key = self.path("keys", "host_ed25519")
        self.user_key = self.path("keys", "user_ed25519")
        for key in (self.host_key, self.user_key):
            _run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "ddprun-test", "-f", key])
        self.authorized_keys = self.path("keys", "authorized_keys")
        shutil.copyfile(self.user_key + ".pub", self.authorized_keys)
        os.chmod(self.authorized_keys, 0o600)

        self.hosts_file = self.path("hosts")
        with open(self.hosts_file, "w") as f:
            f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
            f.write("%s\tlauncher\n" % self.launcher_addr)
            for h, a in zip(self.hosts, self.addrs):
                f.write("%s\t%s\n" % (a, h))
            f.write("%s\thx\n%s\th9\n" % (self.refusing_addr, self.unreachable_addr))

        self.sshd_configs = []
        for i, addr in enumerate(self.addrs):
            cfg = self.path("sshd_config_h%d" % i)
            with open(cfg, "w") as f:
                f.write("\n".join([
                    "ListenAddress %s" % addr,
                    "Port 22",
                    "HostKey %s" % self.host_key,
                    "AuthorizedKeysFile %s" % self.authorized_keys,
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "StrictModes no",
                    "UsePAM no",
                    "UseDNS no",
                    "PrintMotd no",
                    "PrintLastLog no",
                    "X11Forwarding no",
                    "PermitUserEnvironment no",
                    "MaxStartups 200",
                    "MaxSessions 50",
                    # Keeps what remote agents put under $TMPDIR (log dirs) in the test dir.
                    "SetEnv TMPDIR=%s" % self.path("tmp-h%d" % i),
                    "PidFile %s" % self.path("sshd_h%d.pid" % i),
                    "LogLevel %s" % self.sshd_log_level,
                    "",
                ]))
            self.sshd_configs.append(cfg)

        self.ssh_config = self.path("ssh_config")
        with open(self.ssh_config, "w") as f:
            entries = list(zip(self.hosts, self.addrs)) + [("hx", self.refusing_addr),
                                                           ("h9", self.unreachable_addr)]
            for h, a in entries:
                f.write("Host %s\n    HostName %s\n" % (h, a))
            f.write("\n".join([
                "Host *",
                "    User root",
                "    Port 22",
                "    IdentityFile %s" % self.user_key,
                "    IdentitiesOnly yes",
                "    StrictHostKeyChecking no",
                "    UserKnownHostsFile /dev/null",
                "    GlobalKnownHostsFile /dev/null",
                "    LogLevel ERROR",
                "",
            ]))

    def _ip(self, *args):
        _run(["ip"] + list(args))

    def _make_network(self):
        namespaces = [self.launcher_ns] + self.host_ns + ([self.refusing_ns] if self.with_refusing_host else [])
        for ns in namespaces:
            self._ip("netns", "add", ns)
            self._namespaces.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
        L = self.launcher_ns
        self._ip("-n", L, "link", "add", "br0", "type", "bridge")
        self._ip("-n", L, "addr", "add", "%s/24" % self.launcher_addr, "dev", "br0")
        self._ip("-n", L, "link", "set", "br0", "up")
        legs = list(zip(self.host_ns, self.addrs))
        if self.with_refusing_host:
            legs.append((self.refusing_ns, self.refusing_addr))
        for i, (ns, addr) in enumerate(legs):
            # Both ends are created directly in namespaces: nothing appears in the host's namespace.
            self._ip("-n", L, "link", "add", "v%d" % i, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("-n", L, "link", "set", "v%d" % i, "master", "br0", "up")
            self._ip("-n", ns, "addr", "add", "%s/24" % addr, "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")

    def ns_argv(self, ns, name, argv, run_tmpfs=False):
        """argv wrapped to run in namespace NS with hostname NAME and the bed's mounts."""
        return (["ip", "netns", "exec", ns, "unshare", "--uts", "--", "sh", "-c", _NS_WRAPPER, "sh", name,
                 self.hosts_file, self.path("home", name), "run" if run_tmpfs else "-"] + list(argv))

    def _start_sshds(self):
        for i, ns in enumerate(self.host_ns):
            log = open(self.path("sshd_h%d.log" % i), "ab")
            argv = self.ns_argv(ns, self.hosts[i], [SSHD, "-D", "-e", "-f", self.sshd_configs[i]], run_tmpfs=True)
            self.sshd[i] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            env=self.base_env(), start_new_session=True)
            log.close()

    def base_env(self, extra=None):
        """A small, explicit environment for processes in the bed (HOME in the test dir)."""
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": self.path("home", "l"),
            "LANG": "C.UTF-8",
            "TMPDIR": self.dir,
        }
        env.update(extra or {})
        return env

    def ssh_argv(self, host, command, extra_opts=()):
        return [SSH, "-F", self.ssh_config, "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"] + list(extra_opts) + \
               [host, "--", command]

    def wait_ready(self, timeout):
        """Bounded poll until `ssh hI true` succeeds from the launcher namespace for every host."""
        deadline = time.monotonic() + timeout
        for i, h in enumerate(self.hosts):
            while True:
                if self.sshd[i].poll() is not None:
                    raise RuntimeError("sshd for %s exited with %s:\n%s" % (h, self.sshd[i].returncode,
                                                                           self.sshd_log(i)))
                r = subprocess.run(self.ns_argv(self.launcher_ns, "l", self.ssh_argv(h, "true")),
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True, env=self.base_env(),
                                   timeout=max(1, deadline - time.monotonic()) + 5)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("sshd on %s not reachable within %ss: %s\nsshd log:\n%s"
                                       % (h, timeout, r.stderr.strip(), self.sshd_log(i)))
                time.sleep(0.1)

    def sshd_log(self, i):
        try:
            with open(self.path("sshd_h%d.log" % i), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    # ---------- running things ----------

    def run_in_launcher_ns(self, argv, env=None, **popen_kwargs):
        """Popen of argv inside the launcher namespace (hostname `launcher`). The Popen's pid is the
        process itself (every wrapper execs), so signals sent to it reach the program directly."""
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.ns_argv(self.launcher_ns, "l", argv),
                                env=self.base_env() if env is None else env, **popen_kwargs)

    def run_in_host_ns(self, i, argv, env=None, **popen_kwargs):
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.ns_argv(self.host_ns[i], self.hosts[i], argv),
                                env=self.base_env() if env is None else env, **popen_kwargs)

    def ssh(self, host, command, timeout=30, input=None):
        """Runs `ssh host command` from the launcher namespace; CompletedProcess (text)."""
        return subprocess.run(self.ns_argv(self.launcher_ns, "l", self.ssh_argv(host, command)),
                              input=input, stdin=None if input is not None else subprocess.DEVNULL,
                              capture_output=True, text=True, env=self.base_env(), timeout=timeout)

    # ---------- inspection ----------

    def pids_in(self, ns):
        return ns_pids(ns)

    def daemon_pids(self):
        return {p.pid for p in self.sshd.values() if p.poll() is None}

    def all_leftover_pids(self, include_launcher_ns=True):
        """{namespace: [(pid, cmdline)]} of every live process in the bed except the sshd daemons.
        Session sshd processes (one per open connection) count: an open session is a leftover."""
        out = {}
        daemons = self.daemon_pids()
        namespaces = ([self.launcher_ns] if include_launcher_ns else []) + self.host_ns
        if self.with_refusing_host:
            namespaces.append(self.refusing_ns)
        for ns in namespaces:
            pids = [(p, cmdline(p)) for p in self.pids_in(ns) if p not in daemons]
            if pids:
                out[ns] = pids
        return out

    def wait_no_leftovers(self, timeout):
        """Polls (20 ms) until nothing is left; returns what is left at the deadline ({} = clean)."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.all_leftover_pids()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.02)

    def assert_no_leftovers(self, timeout):
        left = self.wait_no_leftovers(timeout)
        if left:
            lines = ["%s: pid %d: %s" % (ns, pid, cmd) for ns, pids in left.items() for pid, cmd in pids]
            raise AssertionError("processes left in the test namespaces after %ss:\n  %s"
                                 % (timeout, "\n  ".join(lines)))

    def all_cmdlines(self):
        """{pid: cmdline bytes} of every process in every namespace of the bed (for secret checks)."""
        out = {}
        namespaces = [self.launcher_ns] + self.host_ns
        for ns in namespaces:
            for pid in self.pids_in(ns):
                try:
                    with open("/proc/%d/cmdline" % pid, "rb") as f:
                        out[pid] = f.read()
                except OSError:
                    pass
        return out

    def kill_leftovers(self):
        """SIGKILLs every non-daemon process of the bed (after a failed check, so the next scenario
        starts clean)."""
        for _ns, pids in self.all_leftover_pids().items():
            for pid, _cmd in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ---------- teardown ----------

    def teardown(self):
        if self._torn_down:
            return
        self._torn_down = True
        for ns in self._namespaces:
            for _ in range(50):
                pids = ns_pids(ns)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.02)
        for p in self.sshd.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for ns in self._namespaces:
            _run(["ip", "netns", "del", ns], check=False)
        self._namespaces = []
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._cleanup_dir()

    def _cleanup_dir(self):
        if self._own_dir and not os.environ.get("DDPRUN_SSH_KEEP"):
            shutil.rmtree(self.dir, ignore_errors=True)
