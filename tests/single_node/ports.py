"""Ports a test must name up front, where a program cannot bind port 0 and say which it got:
TORCHELASTIC_HEALTH_CHECK_PORT (torch's contract) and etcd's client and peer URLs
(tests/multinode/etcd_cluster.py uses this module too)."""
import random
import socket

_given = set()


def free_port(host=None):
    """A port free on `host` now (None: every interface, IPv6 and IPv4, as the health endpoint
    binds), never one this process handed out before (two calls in a row must not give one port
    to an etcd member's client and peer URLs). Taken at random from below the kernel's ephemeral
    range: a port a probe releases there is not handed out again to another bind(0) or connect()
    in the meantime (the agent's own store, for one), which is what made ports from inside the
    range collide. Away from torch's defaults, 29400 and 29500. Where the ephemeral range starts
    too low to leave room below it (some hosts tune it to "1024 65535"), bind(0)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    below = low > 4096
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(2048, low - 12000), low) if below else 0
        if 29300 <= port <= 29600 or port in _given:
            continue
        if host is not None:
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            addr = (host, port)
        else:
            try:
                s = socket.socket(socket.AF_INET6)
                addr = ("::", port)
            except OSError:  # no IPv6 here: the endpoint binds IPv4 then
                s = socket.socket(socket.AF_INET)
                addr = ("0.0.0.0", port)
        with s:
            try:
                s.bind(addr)
            except OSError:
                continue
            port = s.getsockname()[1]
        if port in _given:
            continue
        _given.add(port)
        return port
    raise RuntimeError("no free port below %d" % low)
