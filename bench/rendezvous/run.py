#!/usr/bin/python3
"""Rendezvous benchmark: N simulated agents against ddprun-rdzvd's native rendezvous.

  python3 bench/rendezvous/run.py --bin-dir build/bin [--sizes 16,256,1024,4096,10000,max,30000,100000]
        [--relay-sizes 10000,25000,50000,100000] [--agents-per-relay 16000]
        [--reps N] [--threads T] [--out results.json] [--markdown table.md] [--update-doc docs/performance.md]

For each N, rdzv_bench (bench/rendezvous/rdzv_bench.cpp) starts a fresh ddprun-rdzvd on
127.0.0.1 port 0 with a token, opens N connections from 127.0.0.0/8 source addresses (1,000 agents
per address, the daemon's per-address cap of 4,096 stays on), and takes each agent through the
real path: HELLO, AUTH (HMAC), JOIN. When N-1 agents are joined it sends the last JOIN and
measures the time until every agent holds its ASSIGNMENT. It reads the daemon's VmRSS / VmHWM and
CPU time from /proc and its own CPU time. Each figure is the median of --reps runs (min-max; one
run above N = 4096). "max" is the largest N the open-files hard limit allows (both processes need
N descriptors); sizes above it are skipped with a note, and the total at the goal size is then
modelled from the fit. rdzv_logic_bench runs the daemon's RendezvousService on every size without
sockets (the user-space part of the daemon's cost, at sizes the limit forbids).

The relay series (--relay-sizes) starts a root ddprun-rdzvd and R = ceil(N / --agents-per-relay)
relays (`ddprun-rdzvd --relay-to ROOT`), all on 127.0.0.1 port 0 with one token, and runs
rdzv_bench with the relays as endpoints (agents spread over them round-robin, split over bench
processes of at most 16,000 agents each): no process holds more sockets than the open-files limit
allows, so N = 100,000 is measured rather than modelled. The root's and the relays' CPU and RSS
are read from /proc. A daemon without the relay mode skips the series with a note.

Writes JSON (--out) and a markdown block (--markdown, --update-doc between the rdzv-bench
markers); nothing is typed by hand.
"""
import argparse
import datetime
import json
import math
import os
import platform
import resource
import secrets
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from doc_block import update_doc as write_doc_block  # noqa: E402

GOALS_MS = {16: 10.0, 1024: 100.0, 10000: 1500.0}  # last join -> all assigned
GOAL_TOTAL = (100000, 10.0)  # N, seconds: connect + handshake + joins + round close (the goal)
DAEMON_RESERVE = 1024 + 64  # descriptors the daemon keeps beyond its connections, plus slack


def run_one(bench, daemon, n, timeout, threads):
    p = subprocess.run([bench, "--nodes", str(n), "--daemon", daemon, "--timeout", str(timeout),
                        "--threads", str(threads)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout + 60)
    line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if p.returncode == 3:
        return json.loads(line)
    if p.returncode != 0:
        raise SystemExit(f"rdzv_bench --nodes {n} failed (exit {p.returncode}): {p.stderr.strip()}")
    return json.loads(line)


RELAY_TOOL_MISSING = "ddprun-rdzvd has no relay mode (--relay-to): the relay series is skipped"
SERVER_START_S = 30.0  # a root or relay that prints no readiness line in this time failed to start
SUMMARY_FIELDS = (("ms", "last_join_to_all_assigned_ms"), ("setup_s", "setup_s"), ("total_s", "total_s"),
                  ("rss_kib", "daemon_rss_kib"), ("hwm_kib", "daemon_hwm_kib"),
                  ("rss_idle_kib", "daemon_rss_idle_kib"), ("daemon_cpu_setup_s", "daemon_cpu_setup_s"),
                  ("daemon_cpu_close_s", "daemon_cpu_close_s"), ("bench_cpu_setup_s", "bench_cpu_setup_s"),
                  ("bench_cpu_close_s", "bench_cpu_close_s"), ("relay_cpu_setup_s", "relay_cpu_setup_s"),
                  ("relay_cpu_close_s", "relay_cpu_close_s"), ("relay_rss_idle_kib", "relay_rss_idle_kib"),
                  ("relay_rss_kib", "relay_rss_kib"), ("relay_hwm_kib", "relay_hwm_kib"))


def has_relay_mode(daemon):
    p = subprocess.run([daemon, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
    return "--relay-to" in p.stdout


def die_with_parent():
    """Child setup: the kernel kills a root or relay when this script dies (PR_SET_PDEATHSIG)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class Server:
    """A ddprun-rdzvd (root or relay) on 127.0.0.1 port 0; ready once it prints `listening on HOST:PORT`."""

    def __init__(self, argv, what):
        self.what = what
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, preexec_fn=die_with_parent)
        line = b""
        deadline = time.monotonic() + SERVER_START_S
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            chunk = os.read(self.proc.stdout.fileno(), 1) if ready else b""
            if not chunk:
                self.stop()
                raise SystemExit(f"{what} did not report readiness within {SERVER_START_S:g} s "
                                 f"(`{' '.join(argv)}`): {self.stderr()}")
            line += chunk
        text = line.decode().strip()
        prefix = "listening on "
        if not text.startswith(prefix):
            self.stop()
            raise SystemExit(f"{what} printed '{text}' instead of 'listening on HOST:PORT': {self.stderr()}")
        self.endpoint = text[len(prefix):]
        self.pid = self.proc.pid

    def stderr(self):
        self.log.seek(0)
        return self.log.read().strip()[-2000:] or "(no output on stderr)"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def relay_count(n, per_relay):
    return max(1, math.ceil(n / per_relay))


def run_relay_one(bench, daemon, n, relays, timeout, threads, hard):
    """Root + R relays + rdzv_bench over the relays; the bench's JSON (or a "skipped" entry)."""
    share = math.ceil(n / relays)
    if share + DAEMON_RESERVE > hard:
        return {"nodes": n, "relays": relays,
                "skipped": f"open-files limit {hard} is below the {share + DAEMON_RESERVE} descriptors one relay "
                           f"needs for its {share} agents (raise --agents-per-relay's R: fewer agents per relay)"}
    token = secrets.token_hex(16)
    with tempfile.NamedTemporaryFile("w", prefix="rdzv_bench_token.", delete=False) as f:
        f.write(token + "\n")
        token_file = f.name
    servers = []
    try:
        common = ["--host", "127.0.0.1", "--port", "0", "--token-file", token_file, "--log-level", "warning"]
        root = Server([daemon] + common, "the root ddprun-rdzvd")
        servers.append(root)
        for i in range(relays):
            servers.append(Server([daemon, "--relay-to", root.endpoint] + common +
                                  ["--max-connections", str(share + 64)], f"relay {i} (ddprun-rdzvd --relay-to)"))
        argv = [bench, "--nodes", str(n), "--endpoint", ",".join(s.endpoint for s in servers[1:]),
                "--daemon-pid", str(root.pid), "--timeout", str(timeout), "--threads", str(threads)]
        for s in servers[1:]:
            argv += ["--relay-pid", str(s.pid)]
        env = dict(os.environ, DDPRUN_RDZV_TOKEN=token)
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout + 60,
                           env=env)
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        if p.returncode not in (0, 3):
            logs = "; ".join(f"{s.what}: {s.stderr()}" for s in servers)
            raise SystemExit(f"rdzv_bench --nodes {n} over {relays} relays failed (exit {p.returncode}): "
                             f"{p.stderr.strip()}\nserver logs: {logs}")
        r = json.loads(line)
        r["relays"] = relays
        return r
    finally:
        for s in reversed(servers):
            s.stop()
        os.unlink(token_file)


def summarize_runs(n, runs):
    entry = {"nodes": n, "raw": runs}
    for key, field in SUMMARY_FIELDS:
        values = [x[field] for x in runs if x.get(field) is not None]
        if values:
            entry[key] = summarize(values)
    for key in ("relays", "processes"):
        if key in runs[0]:
            entry[key] = runs[0][key]
    return entry


def run_logic(logic, n, timeout):
    p = subprocess.run([logic, "--nodes", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"rdzv_logic_bench --nodes {n} failed (exit {p.returncode}): {p.stderr.strip()}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def largest_size(hard):
    """The largest N (a multiple of 1,000) whose connections fit the open-files hard limit."""
    return max(16, (hard - DAEMON_RESERVE) // 1000 * 1000)


def summarize(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def fmt(s, digits=1, scale=1.0):
    med, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
    if len(s["runs"]) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def growth_fit(results, key, scale):
    """Least squares t = a + b*N over the medians, on relative residuals (weights 1/t^2: the sizes
    span three decades, and plain least squares would fit the largest N only), the largest
    relative residual, and the local exponent k = ln(t2/t1) / ln(N2/N1) between consecutive sizes
    (k ~ 1: linear, ~ 2: quadratic)."""
    pts = [(r["nodes"], r[key]["median"] * scale) for r in results if "skipped" not in r]
    pts = [(x, y) for x, y in pts if y > 0]
    if len(pts) < 3:
        return None
    ws = [1.0 / (y * y) for _, y in pts]
    sw = sum(ws)
    mx = sum(w * x for w, (x, _) in zip(ws, pts)) / sw
    my = sum(w * y for w, (_, y) in zip(ws, pts)) / sw
    b = (sum(w * (x - mx) * (y - my) for w, (x, y) in zip(ws, pts))
         / sum(w * (x - mx) ** 2 for w, (x, _) in zip(ws, pts)))
    a = my - b * mx
    worst = max(abs(y - (a + b * x)) / y for x, y in pts)
    steps = [{"from": x1, "to": x2, "exponent": math.log(y2 / y1) / math.log(x2 / x1)}
             for (x1, y1), (x2, y2) in zip(pts, pts[1:])]
    bend = next((st for st in steps if st["exponent"] > LINEAR_EXPONENT_MAX), None)
    return {"intercept_ms": a, "per_agent_us": b * 1e3, "max_rel_residual": worst,
            "n_min": pts[0][0], "n_max": pts[-1][0], "steps": steps, "superlinear_from": bend}


LINEAR_EXPONENT_MAX = 1.25  # a local exponent above this counts as "no longer linear"


def fit_text(name, f):
    steps = ", ".join(f"{st['from']}→{st['to']}: {st['exponent']:.2f}" for st in f["steps"])
    if f["superlinear_from"] is None:
        verdict = (f"linear or better over the whole range (every local exponent ≤ "
                   f"{LINEAR_EXPONENT_MAX:g})")
    else:
        st = f["superlinear_from"]
        verdict = (f"stops being linear between N = {st['from']} and {st['to']} (local exponent "
                   f"{st['exponent']:.2f} > {LINEAR_EXPONENT_MAX:g})")
    return (f"* {name}: least squares on relative residuals over the medians, t ≈ "
            f"{f['intercept_ms']:.2f} ms + {f['per_agent_us']:.1f} µs × N (largest residual "
            f"{100 * f['max_rel_residual']:.0f} % of its point); local exponent "
            f"ln(t₂/t₁)/ln(N₂/N₁) between sizes: {steps}; {verdict}.")


def model_total(results, fits):
    """Total at the goal size from the setup and close fits, when the goal size was skipped."""
    n, _ = GOAL_TOTAL
    if any(r["nodes"] == n and "skipped" not in r for r in results):
        return None
    s, c = fits.get("setup"), fits.get("close")
    if not s or not c:
        return None
    setup_ms = s["intercept_ms"] + s["per_agent_us"] * n / 1e3
    close_ms = c["intercept_ms"] + c["per_agent_us"] * n / 1e3
    model = {"nodes": n, "setup_s": setup_ms / 1e3, "close_ms": close_ms, "total_s": (setup_ms + close_ms) / 1e3,
             "from_n_max": s["n_max"]}
    # CPU, proportional from the largest measured size: wall time on a shared machine includes
    # other processes' turns, CPU time does not. Daemon and bench are one thread each, so on an
    # otherwise idle machine with two cores the round takes at least the larger of the two.
    big = max((r for r in results if "skipped" not in r and r.get("daemon_cpu_setup_s")), key=lambda r: r["nodes"],
              default=None)
    if big:
        m = big["nodes"]
        model["cpu_from_n"] = m
        model["daemon_cpu_s"] = (big["daemon_cpu_setup_s"]["median"] + big["daemon_cpu_close_s"]["median"]) * n / m
        model["bench_cpu_s"] = (big["bench_cpu_setup_s"]["median"] + big["bench_cpu_close_s"]["median"]) * n / m
        model["daemon_cpu_close_s"] = big["daemon_cpu_close_s"]["median"] * n / m
    return model


def per_agent_kib(r, after, idle):
    """RSS growth per agent, (after - idle) / N, from the medians; "" when not read."""
    if after not in r or idle not in r:
        return ""
    return f"{(r[after]['median'] - r[idle]['median']) / r['nodes']:.2f}"


def cpu_pair(r, key):
    if f"{key}_cpu_setup_s" not in r:
        return "–"
    return f"{r[f'{key}_cpu_setup_s']['median']:.2f} / {r[f'{key}_cpu_close_s']['median']:.2f}"


def relay_markdown(relay_results, meta, direct):
    lines = ["", "**Through relays** (the relay series): a root `ddprun-rdzvd` and R relays (`ddprun-rdzvd --relay-to "
             f"ROOT`, R = ⌈N / {meta.get('agents_per_relay', 16000):,}⌉), all on 127.0.0.1 with the same token; the "
             "agents connect to the relays round-robin and authenticate end to end with the root through them; the "
             "bench runs as several processes of at most 16,000 agents each. CPU and RSS of the relays are summed "
             "over the R relays.", ""]
    rows = [r for r in relay_results if "skipped" not in r]
    skipped = [r for r in relay_results if "skipped" in r]
    if rows:
        lines += ["| agents (N) | relays (R) | bench processes | total: connect + auth + joins + close (s) | goal | "
                  "setup (s) | last join → all assigned (ms) | CPU setup / close: root (s) | relays, sum (s) | "
                  "bench (s) | root RSS per agent (KiB) | relays' RSS per agent (KiB) | root peak RSS (MiB) | "
                  "relays' peak RSS, sum (MiB) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            n = r["nodes"]
            goal = ""
            if n == GOAL_TOTAL[0]:
                goal = f"total ≤ {GOAL_TOTAL[1]:g} s {'✓' if r['total_s']['median'] <= GOAL_TOTAL[1] else '✗'}"
            rhwm = fmt(r["relay_hwm_kib"], 1, 1 / 1024) if "relay_hwm_kib" in r else ""
            lines.append(f"| {n} | {r.get('relays', '')} | {r.get('processes', '')} | {fmt(r['total_s'], 2)} | "
                         f"{goal} | {fmt(r['setup_s'], 2)} | {fmt(r['ms'], 1)} | {cpu_pair(r, 'daemon')} | "
                         f"{cpu_pair(r, 'relay')} | {cpu_pair(r, 'bench')} | "
                         f"{per_agent_kib(r, 'rss_kib', 'rss_idle_kib')} | "
                         f"{per_agent_kib(r, 'relay_rss_kib', 'relay_rss_idle_kib')} | "
                         f"{fmt(r['hwm_kib'], 1, 1 / 1024)} | {rhwm} |")
        same = [(d, r) for r in rows for d in direct if d["nodes"] == r["nodes"] and "skipped" not in d]
        for d, r in same:
            lines += ["", f"At N = {r['nodes']}, directly against one daemon: total {d['total_s']['median']:.2f} s, "
                      f"daemon CPU {d['daemon_cpu_setup_s']['median'] + d['daemon_cpu_close_s']['median']:.2f} s; "
                      f"through {r['relays']} relay(s): total {r['total_s']['median']:.2f} s, root CPU "
                      f"{r['daemon_cpu_setup_s']['median'] + r['daemon_cpu_close_s']['median']:.2f} s, relays' CPU "
                      f"{r['relay_cpu_setup_s']['median'] + r['relay_cpu_close_s']['median']:.2f} s."]
    for r in skipped:
        lines.append(f"* N = {r['nodes']} over {r.get('relays', '?')} relays: skipped: {r['skipped']}.")
    return lines


def markdown(results, meta, relay_results=None):
    lines = [
        f"Measured {meta['date']} on {meta['machine']} ({meta['cpus']} vCPU {meta['cpu_model']}, Linux {meta['kernel']}), "
        f"`{meta['command']}`; median of {meta['reps_text']} (min–max). Open-files hard limit "
        f"{meta['fd_limit']}; token ON (HELLO, AUTH with HMAC, JOIN per agent); {meta.get('threads', 1)} bench "
        f"thread(s).",
        "",
        "| agents (N) | total: connect + auth + joins + close (s) | last join → all assigned (ms) | goal | "
        "setup: connect + auth + N-1 joins (s) | daemon CPU setup / close (s) | bench CPU setup / close (s) | "
        "daemon RSS after (MiB) | daemon peak RSS (MiB) | RSS per agent (KiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    idle = next((r["rss_idle_kib"]["median"] for r in results if "skipped" not in r and r.get("rss_idle_kib")), None)
    for r in results:
        n = r["nodes"]
        if "skipped" in r:
            lines.append(f"| {n} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        goal = GOALS_MS.get(n)
        goal_text = "" if goal is None else (f"close ≤ {goal:g} ms ✓" if r["ms"]["median"] <= goal
                                             else f"close ≤ {goal:g} ms ✗")
        if n == GOAL_TOTAL[0]:
            ok = r["total_s"]["median"] <= GOAL_TOTAL[1]
            goal_text = f"total ≤ {GOAL_TOTAL[1]:g} s {'✓' if ok else '✗'}"
        cpu = (f"{r['daemon_cpu_setup_s']['median']:.2f} / {r['daemon_cpu_close_s']['median']:.2f}"
               if r.get("daemon_cpu_setup_s") else "")
        bcpu = (f"{r['bench_cpu_setup_s']['median']:.2f} / {r['bench_cpu_close_s']['median']:.2f}"
                if r.get("bench_cpu_setup_s") else "")
        per = ("" if idle is None or n < 1000 else f"{(r['rss_kib']['median'] - idle) / n:.2f}")
        lines.append(f"| {n} | {fmt(r['total_s'], 2)} | {fmt(r['ms'], 1)} | {goal_text} | {fmt(r['setup_s'], 2)} | "
                     f"{cpu} | {bcpu} | {fmt(r['rss_kib'], 1, 1 / 1024)} | {fmt(r['hwm_kib'], 1, 1 / 1024)} | {per} |")
    fits = meta.get("fits") or {}
    if fits:
        lines += ["", "Growth (generated from the medians above):", ""]
        if fits.get("close"):
            lines.append(fit_text("Round close (last join → all assigned)", fits["close"]))
        if fits.get("setup"):
            lines.append(fit_text("Setup (connect + auth + N-1 joins, as ms)", fits["setup"]))
    model = meta.get("model")
    if model:
        relayed = [r for r in (relay_results or []) if r.get("nodes") == model["nodes"] and "total_s" in r]
        where = " (through relays it is measured: the relay series below)" if relayed else ""
        lines += ["", f"N = {model['nodes']} directly against one daemon did not fit this machine's open-files "
                  f"limit{where}. The fits above, "
                  f"extrapolated from N ≤ {model['from_n_max']}, give setup {model['setup_s']:.1f} s + close "
                  f"{model['close_ms'] / 1e3:.1f} s = **{model['total_s']:.1f} s** of wall time (goal ≤ "
                  f"{GOAL_TOTAL[1]:g} s) — a model, not a measurement."]
        if model.get("daemon_cpu_s") is not None:
            lines.append(f"By CPU time, proportional from N = {model['cpu_from_n']}: the daemon would spend "
                         f"{model['daemon_cpu_s']:.1f} s (of which the close {model['daemon_cpu_close_s']:.1f} s) "
                         f"and the bench {model['bench_cpu_s']:.1f} s; each is one thread, so on two otherwise idle "
                         f"cores the round takes at least {max(model['daemon_cpu_s'], model['bench_cpu_s']):.1f} s.")
    if relay_results:
        lines += relay_markdown(relay_results, meta, results)
    logic = meta.get("logic") or []
    if logic:
        lines += ["", "The daemon's rendezvous logic alone (`rdzv_logic_bench`: its RendezvousService fed the same "
                  "HELLO, AUTH and JOIN frames without sockets; CPU time inside the service; RSS growth of its state):",
                  "", "| agents (N) | setup: CPU per agent (µs) | close: CPU per agent (µs) | close (ms) | "
                  "state per agent (KiB) | HEARTBEAT: CPU per frame (µs) | STATUS of the job: CPU (ms), reply (MiB) |",
                  "|---|---|---|---|---|---|---|"]
        for x in logic:
            hb = f"{x['heartbeat_us']:.2f}" if "heartbeat_us" in x else ""
            st = f"{x['status_ms']:.1f}, {x['status_reply_bytes'] / 2**20:.1f}" if "status_ms" in x else ""
            lines.append(f"| {x['nodes']} | {x['setup_us_per_agent']:.1f} | {x['close_us_per_agent']:.2f} | "
                         f"{x['close_ms']:.1f} | {x['rss_kib_per_agent']:.2f} | {hb} | {st} |")
    lines += [
        "",
        "The daemon is idle when the last JOIN is sent (every earlier join has been answered), so",
        "the close column is the round close: ranks, offsets and N ASSIGNMENT frames encoded and written.",
        "Setup is N connects (at most 1,024 agents between connect and JOINED at once, below the listen",
        "backlog), N handshakes and N-1 joins. Daemon and bench share the machine's cores: the CPU",
        "columns say how the time splits (kernel TCP work on loopback is charged to whichever side",
        "sends). RSS per agent = (RSS after − idle RSS) / N.",
    ]
    return "\n".join(lines)


def update_doc(path, md):
    write_doc_block(path, "rdzv-bench", "bench/rendezvous/run.py", md)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", help="build/bin with rdzv_bench and ddprun-rdzvd (required unless --render)")
    ap.add_argument("--sizes", default="16,256,1024,4096,10000",
                    help="comma-separated N; 'max' = the largest N the open-files limit allows")
    ap.add_argument("--threads", type=int, default=1, help="bench threads per bench process (rdzv_bench --threads)")
    ap.add_argument("--relay-sizes", default="",
                    help="comma-separated N for the relay series (root + relays); empty: no relay series")
    ap.add_argument("--agents-per-relay", type=int, default=16000,
                    help="relays per size: R = ceil(N / this); one relay holds its agents' sockets")
    ap.add_argument("--no-logic", action="store_true", help="skip rdzv_logic_bench")
    ap.add_argument("--reps", type=int, default=3, help="runs per size (sizes above 4096: 1)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--out", default=None, metavar="JSON")
    ap.add_argument("--markdown", default=None, metavar="MD")
    ap.add_argument("--update-doc", default=None, metavar="MD",
                    help="replace the block between the rdzv-bench markers in this file")
    ap.add_argument("--render", metavar="JSON",
                    help="only re-render the markdown (and --update-doc, --out) from a saved --out JSON")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        saved["meta"]["fits"] = {"close": growth_fit(saved["results"], "ms", 1.0),
                                 "setup": growth_fit(saved["results"], "setup_s", 1e3)}
        saved["meta"]["model"] = model_total(saved["results"], saved["meta"]["fits"])
        saved["goal_total"] = {"nodes": GOAL_TOTAL[0], "s": GOAL_TOTAL[1]}
        md = markdown(saved["results"], saved["meta"], saved.get("relay_results"))
        print(md)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(saved, f, indent=2)
        if args.update_doc:
            update_doc(args.update_doc, md)
        return
    if not args.bin_dir:
        ap.error("--bin-dir is required (unless --render)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    bench = os.path.join(args.bin_dir, "rdzv_bench")
    daemon = os.path.join(args.bin_dir, "ddprun-rdzvd")
    logic_bin = os.path.join(args.bin_dir, "rdzv_logic_bench")
    for path in (bench, daemon) + (() if args.no_logic else (logic_bin,)):
        if not os.access(path, os.X_OK):
            raise SystemExit(f"{path} not found: build the rdzv_bench, rdzv_logic_bench and ddprun-rdzvd targets first")

    sizes = []
    for text in (s for s in args.sizes.split(",") if s):
        n = largest_size(hard) if text == "max" else int(text)
        if n not in sizes:
            sizes.append(n)
    sizes.sort()
    results = []
    for n in sizes:
        reps = args.reps if n <= 4096 else 1
        runs = []
        for _ in range(reps):
            r = run_one(bench, daemon, n, args.timeout, args.threads)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if "skipped" in r:
                break
            runs.append(r)
        if not runs:
            results.append(r)
            continue
        results.append(summarize_runs(n, runs))
    relay_results = []
    relay_sizes = sorted({int(x) for x in args.relay_sizes.split(",") if x})
    if relay_sizes and not has_relay_mode(daemon):
        print(f"rendezvous: {RELAY_TOOL_MISSING}", file=sys.stderr, flush=True)
        relay_results = [{"nodes": n, "relays": relay_count(n, args.agents_per_relay), "skipped": RELAY_TOOL_MISSING}
                         for n in relay_sizes]
        relay_sizes = []
    for n in relay_sizes:
        relays = relay_count(n, args.agents_per_relay)
        reps = args.reps if n <= 4096 else 1
        runs = []
        for _ in range(reps):
            r = run_relay_one(bench, daemon, n, relays, args.timeout, args.threads, hard)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if "skipped" in r:
                break
            runs.append(r)
        relay_results.append(summarize_runs(n, runs) if runs else r)
    logic = []
    if not args.no_logic:
        for n in [x for x in sizes if x >= 1000]:
            x = run_logic(logic_bin, n, args.timeout)
            print(json.dumps(x), file=sys.stderr, flush=True)
            logic.append(x)

    reps_text = f"{args.reps} runs" + (" (1 above N = 4096)" if args.reps > 1 else "")
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.node() or "unknown host",
        "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                           if l.startswith("model name")), platform.machine()),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "command": " ".join(["bench/rendezvous/run.py"] + sys.argv[1:]),
        "reps_text": reps_text,
        "fd_limit": hard,
        "threads": args.threads,
        "logic": logic,
        "agents_per_relay": args.agents_per_relay,
    }
    meta["fits"] = {"close": growth_fit(results, "ms", 1.0),
                    "setup": growth_fit(results, "setup_s", 1e3)}
    meta["model"] = model_total(results, meta["fits"])
    md = markdown(results, meta, relay_results)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "goals_ms": GOALS_MS, "goal_total": {"nodes": GOAL_TOTAL[0], "s": GOAL_TOTAL[1]},
                       "results": results, "relay_results": relay_results}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md + "\n")
    if args.update_doc:
        update_doc(args.update_doc, md)


if __name__ == "__main__":
    main()
