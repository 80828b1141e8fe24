"""Shared helpers of the metrics tests: scraping with urllib, raw sockets for hostile requests."""
import os
import socket
import time
import urllib.error
import urllib.request

import prom_text

BIN_DIR = os.environ.get("DDPRUN_BIN_DIR", "")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")


def scrape(port, path="/metrics"):
    """GET with a real HTTP client; returns the parsed families (every line strictly parsed)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        assert r.status == 200, r.status
        ctype = r.headers["Content-Type"]
        assert ctype == "text/plain; version=0.0.4; charset=utf-8", ctype
        text = r.read().decode()
    return prom_text.parse(text)


def listen_addresses(port):
    """The local addresses of the sockets listening on TCP `port` (from /proc/net/tcp and tcp6),
    as hex strings the kernel writes: "0100007F" is 127.0.0.1, "00000000" is 0.0.0.0."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for row in f:
                cols = row.split()
                addr, hexport = cols[1].split(":")
                if int(hexport, 16) == port and cols[3] == "0A":  # 0A: LISTEN
                    out.append(addr)
    return out


def http_status(port, path, method="GET"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def read_all(sock, timeout):
    """Everything the server sends until it closes; asserts it closes within `timeout`."""
    deadline = time.monotonic() + timeout
    out = b""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"server did not close the connection within {timeout}s (got {out[:80]!r})"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def check_hostile(port):
    # Wrong path, wrong method.
    assert http_status(port, "/") == 404
    assert http_status(port, "/metricsx") == 404
    assert http_status(port, "/metrics", "POST") == 405
    # Garbage request line.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"HELLO\r\n\r\n")
        assert read_all(s, 10).startswith(b"HTTP/1.1 400 "), "garbage request line not answered 400"
    # Oversized head: the server answers 431 (or resets) and closes; it never reads it all.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 20000 + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = read_all(s, 10)
        assert got == b"" or got.startswith(b"HTTP/1.1 431 "), got[:80]
    # Slow request: half a request line, then nothing; cut off after the read timeout (5 s).
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metr")
        assert read_all(s, 15) == b""
    took = time.monotonic() - start
    assert 3 < took < 15, f"slow request closed after {took:.1f}s, expected about 5s"
    # Concurrent connections are capped at 16, and idle ones cannot shut a scrape out: the 17th is
    # served, and the oldest idle connection is closed unanswered to make room for it.
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(16)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_all(s, 5).startswith(b"HTTP/1.1 200 "), "17th connection was not served"
        assert read_all(idle[0], 5) == b"", "the oldest idle connection was answered"
    finally:
        for s in idle:
            s.close()
    # Served again once the idle ones are gone (their EOF closes them server-side).
    deadline = time.monotonic() + 10
    while True:
        try:
            scrape(port)
            break
        except (urllib.error.URLError, ConnectionError, AssertionError):
            assert time.monotonic() < deadline, "scrapes not served after idle connections closed"
            time.sleep(0.05)
