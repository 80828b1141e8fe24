"""Worker for the TORCHELASTIC_HEALTH_CHECK_PORT test: asks the agent's health endpoint once and
writes the raw HTTP answer to OUT. Plain sockets: no torch needed."""
import socket
import sys

port, out = int(sys.argv[1]), sys.argv[2]
with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
    s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    data = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
with open(out, "wb") as f:
    f.write(data)
