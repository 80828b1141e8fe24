"""Ports the single-node tests must name up front (TORCHELASTIC_HEALTH_CHECK_PORT)."""
import random
import socket


def free_port():
    """A port for TORCHELASTIC_HEALTH_CHECK_PORT, which must be a number given up front (torch's
    contract), so it cannot be bound as port 0 and read back. Taken from below the kernel's
    ephemeral range: a port released by this probe and handed out again to another bind(0) in
    the meantime (the agent's own store, for one) is what made a port from inside the range
    collide. Free on every interface, as the endpoint binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
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
        return port
    raise RuntimeError("no free port below %d" % low)
