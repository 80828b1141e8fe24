#!/usr/bin/env python3
"""SSH fan-out benchmark on the namespace test bed (tests/ssh/netns_hosts.py): N hosts, each a
network namespace with its own sshd, ddprun launched in the launcher namespace with --hosts.

Measures, for each host count N (1 worker per host; repeated, median with min-max):
  * floor: N parallel `ssh hI true` from the launcher namespace (connection + auth + exec, the
    cost any ssh fan-out pays), timed by the same harness;
  * ddprun: whole-command time of `ddprun --hosts h0,..,hN-1 --nproc-per-node 1 timed_worker.sh`
    (rendezvous across N remote agents, workers run, all agents exit);
  * first / last worker started after command start (the worker logs `date +%s.%N`; one clock,
    since every namespace shares the machine's);
  * kill -> clean: SIGKILL of the launcher while N silent workers hold, until no process is left in
    any namespace (the control-channel EOF path).

and, flat vs the launch tree (agents that start agents, --ssh-tree-fanout F) on one bed per
--tree-hosts count: whole command, last worker started, launcher-side CPU, SIGKILL -> nothing left;
the markdown adds a model for 1,000 and 10,000 hosts from the measured constants.

Needs root (network namespaces, sshd). Usage:
  run.py --ddprun build/bin/ddprun [--quick] [--hosts 2,4,8] [--reps 5] [--tree-hosts 8,16,32,64]
         [--tree-fanouts 2,4,16] [--out results.json]
"""
import argparse
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "ssh"))
from netns_hosts import SshCluster, preflight, SkipTest  # noqa: E402
sys.path.insert(0, os.path.join(HERE, ".."))
from doc_block import update_doc  # noqa: E402

WORKER = os.path.join(HERE, "timed_worker.sh")


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def read_starts(path):
    try:
        with open(path) as f:
            return [float(line.split()[0]) for line in f if " start " in line]
    except FileNotFoundError:
        return []


def children_cpu():
    """CPU seconds (user + system) of every child this process has waited for."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# OpenSSH 9.x's default key exchange (sntrup761x25519, post-quantum) costs the client most of its
# handshake CPU; the classic curve25519 exchange is measured beside it for comparison.
CLASSIC_KEX = ["-o", "KexAlgorithms=curve25519-sha256"]


def floor_once(c, extra_opts=()):
    cpu0 = children_cpu()
    t0 = time.time()
    procs = [c.run_in_launcher_ns(c.ssh_argv(h, "true", extra_opts=list(extra_opts)), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
             for h in c.hosts]
    for p in procs:
        _, err = p.communicate(timeout=60)
        if p.returncode != 0:
            raise RuntimeError("ssh floor failed: %s" % err.decode()[-500:])
    # The ssh clients' own CPU (client side of each handshake; the sshds are not our children).
    return time.time() - t0, children_cpu() - cpu0


def ddprun_argv(c, ddprun, fanout=None):
    """fanout None: the flat launch; F: the launch tree with fan-out F whatever the host count."""
    tree = ["--ssh-tree-threshold", "off"] if fanout is None else \
        ["--ssh-tree-threshold", "1", "--ssh-tree-fanout", str(fanout)]
    return [ddprun, "--ssh-config", c.ssh_config, "--hosts", ",".join(c.hosts), "--nproc-per-node", "1"] + tree + \
        ["--env", "OUTF", "--env", "HOLD", WORKER]


def tree_depth(n, fanout):
    """Levels of ssh hops of a launch tree (launcher/fanout.hpp: contiguous runs, nearly equal)."""
    def depth(count):
        if count == 0:
            return 0
        k = min(fanout, count)
        base, extra = divmod(count, k)
        return 1 + max(depth(base + (1 if i < extra else 0) - 1) for i in range(k))
    return depth(n)


def ddprun_once(c, ddprun, outf, fanout=None):
    env = c.base_env({"OUTF": outf, "HOLD": "0"})
    cpu0 = children_cpu()
    t0 = time.time()
    p = c.run_in_launcher_ns(ddprun_argv(c, ddprun, fanout), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, cwd=c.dir)
    _, err = p.communicate(timeout=120)
    t1 = time.time()
    cpu = children_cpu() - cpu0  # the launcher and the ssh clients it ran (not the remote agents)
    if p.returncode != 0:
        raise RuntimeError("ddprun exited %d: %s" % (p.returncode, err.decode()[-2000:]))
    starts = read_starts(outf)
    if len(starts) != len(c.hosts):
        raise RuntimeError("%d of %d workers logged a start" % (len(starts), len(c.hosts)))
    c.assert_no_leftovers(15)
    return t1 - t0, min(starts) - t0, max(starts) - t0, cpu


def kill_once(c, ddprun, outf, fanout=None):
    env = c.base_env({"OUTF": outf, "HOLD": "1"})
    with open(outf + ".err", "wb") as err:
        p = c.run_in_launcher_ns(ddprun_argv(c, ddprun, fanout), env=env, stdout=subprocess.DEVNULL,
                                 stderr=err, cwd=c.dir)
    deadline = time.monotonic() + 60
    while len(read_starts(outf)) < len(c.hosts):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            with open(outf + ".err", errors="replace") as f:
                raise RuntimeError("workers did not all start (launcher exit %s): %s" % (p.returncode, f.read()[-2000:]))
        time.sleep(0.01)
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    left = c.wait_no_leftovers(30)
    if left:
        c.kill_leftovers()
        raise RuntimeError("processes left 30 s after SIGKILL of the launcher: %s" % left)
    return time.monotonic() - t0


def bench(ddprun, host_counts, reps):
    res = {}
    for n in host_counts:
        with tempfile.TemporaryDirectory(prefix="ddprun-fanout-bench-") as d:
            with SshCluster(n, d, sshd_log_level="ERROR") as c:
                floor, floor_cpu, classic_cpu, whole, first, last, cpu, kill = [], [], [], [], [], [], [], []
                for r in range(reps):
                    fl, fc = floor_once(c)
                    floor.append(fl)
                    floor_cpu.append(fc / n)
                    classic_cpu.append(floor_once(c, CLASSIC_KEX)[1] / n)
                    w, f, l, u = ddprun_once(c, ddprun, os.path.join(d, "starts-%d" % r))
                    whole.append(w)
                    first.append(f)
                    last.append(l)
                    cpu.append(u / n)
                    kill.append(kill_once(c, ddprun, os.path.join(d, "hold-%d" % r)))
                res[str(n)] = {"ssh_floor_s": summary(floor), "ddprun_whole_s": summary(whole),
                               "first_worker_s": summary(first), "last_worker_s": summary(last),
                               "sigkill_to_clean_s": summary(kill),
                               "ssh_client_cpu_per_host_s": summary(floor_cpu),
                               "ssh_client_cpu_classic_kex_per_host_s": summary(classic_cpu),
                               "launcher_cpu_per_host_s": summary(cpu)}
                print("hosts=%d %s" % (n, json.dumps(res[str(n)])), flush=True)
    return res


def tree_bench(ddprun, host_counts, reps, fanouts):
    """Flat vs launch tree on the same bed, interleaved per repetition (so drift on a shared box
    hits both alike): whole command, last worker started, launcher-side CPU, and for the tree the
    SIGKILL-of-the-launcher -> nothing left time (EOF cascading down every level)."""
    res = {}
    for n in host_counts:
        with tempfile.TemporaryDirectory(prefix="ddprun-tree-bench-") as d:
            with SshCluster(n, d, sshd_log_level="ERROR") as c:
                kinds = [None] + list(fanouts)
                runs = {k: {"whole": [], "last": [], "cpu": [], "kill": []} for k in kinds}
                for r in range(reps):
                    for k in kinds:
                        w, _f, l, u = ddprun_once(c, ddprun, os.path.join(d, "starts-%s-%d" % (k, r)), k)
                        runs[k]["whole"].append(w)
                        runs[k]["last"].append(l)
                        runs[k]["cpu"].append(u)
                        if k is not None:
                            runs[k]["kill"].append(kill_once(c, ddprun, os.path.join(d, "hold-%s-%d" % (k, r)), k))
                entry = {"flat_whole_s": summary(runs[None]["whole"]), "flat_last_worker_s": summary(runs[None]["last"]),
                         "flat_launcher_cpu_s": summary(runs[None]["cpu"]), "tree": {}}
                for k in fanouts:
                    entry["tree"][str(k)] = {"depth": tree_depth(n, k), "whole_s": summary(runs[k]["whole"]),
                                             "last_worker_s": summary(runs[k]["last"]),
                                             "launcher_cpu_s": summary(runs[k]["cpu"]),
                                             "sigkill_to_clean_s": summary(runs[k]["kill"])}
                res[str(n)] = entry
                print("tree hosts=%d %s" % (n, json.dumps(entry)), flush=True)
    return res


def fit(points):
    """Least-squares line y = a + b*x through [(x, y)]; returns (a, b)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def markdown(doc):
    res = doc["results"]
    m = doc["machine"]
    lines = ["Machine: %d vCPUs, %s; %s. Every host is a network namespace with its own sshd on this "
             "same machine, so the sshds' CPU competes with the launcher's. %d repetitions, median "
             "(min-max); 1 worker per host." % (m["cpus"], m["platform"], m.get("ssh", "OpenSSH"), doc["reps"]), "",
             "| hosts | ssh floor (N parallel `ssh true`) | ddprun whole command | first worker | last worker "
             "| SIGKILL of the launcher -> nothing left | launcher CPU per host |", "|---|---|---|---|---|---|---|"]

    def fmt(s):
        return "%.3f s (%.3f-%.3f)" % (s["median"], s["min"], s["max"])
    for n, r in res.items():
        lines.append("| %s | %s | %s | %s | %s | %s | %.1f ms |" % (
            n, fmt(r["ssh_floor_s"]), fmt(r["ddprun_whole_s"]), fmt(r["first_worker_s"]), fmt(r["last_worker_s"]),
            fmt(r["sigkill_to_clean_s"]), 1000 * r["launcher_cpu_per_host_s"]["median"]))
    if len(res) >= 2:
        pts = [(int(n), r["last_worker_s"]["median"]) for n, r in res.items()]
        a, b = fit(pts)
        fa, fb = fit([(int(n), r["ssh_floor_s"]["median"]) for n, r in res.items()])
        over = [r["ddprun_whole_s"]["median"] - r["ssh_floor_s"]["median"] for r in res.values()]
        cpu = statistics.median(r["launcher_cpu_per_host_s"]["median"] for r in res.values())
        client = statistics.median(r["ssh_client_cpu_per_host_s"]["median"] for r in res.values())
        classic = statistics.median(r["ssh_client_cpu_classic_kex_per_host_s"]["median"] for r in res.values())
        tree_from = 8 / cpu  # hosts at which 8 launcher cores spend one second
        lines += ["",
                  "Fit (least squares over the medians): last worker started = %.3f s + %.1f ms x hosts; "
                  "the ssh floor alone = %.3f s + %.1f ms x hosts. ddprun's whole command minus the bare ssh "
                  "floor: %.0f to %.0f ms (rendezvous, workers, orderly exit; within the noise of the floor)." % (
                      a, 1000 * b, fa, 1000 * fb, 1000 * min(over), 1000 * max(over)),
                  "",
                  "Launcher-side CPU per host: %.1f ms, of which the ssh client's own handshake is %.1f ms and "
                  "ddprun's %.1f ms. On a real cluster the sshd side runs on each host, so the launcher's share "
                  "is what serialises: with C launcher cores, N hosts cost about N x %.1f ms / C of CPU before "
                  "the last agent starts: %.1f s for 1,000 hosts on 8 cores, %.0f s for 10,000. The launch tree "
                  "(agents starting agents, fan-out F per level) costs about F x %.1f ms per level instead; "
                  "it pays once the flat launch's CPU passes about a second, i.e. from about %.0f hosts "
                  "on an 8-core launcher." % (
                      1000 * cpu, 1000 * client, 1000 * max(cpu - client, 0.0), 1000 * cpu, 1000 * cpu / 8,
                      10000 * cpu / 8, 1000 * cpu, tree_from),
                  "",
                  "Most of the client's share is OpenSSH's default post-quantum key exchange "
                  "(sntrup761x25519): with `--ssh-option KexAlgorithms=curve25519-sha256` the same bare "
                  "`ssh true` costs the client %.1f ms of CPU instead of %.1f ms (a security trade-off "
                  "left to the user; ddprun does not change ssh's defaults)." % (1000 * classic, 1000 * client)]
    if doc.get("tree"):
        lines += ["", tree_markdown(doc)]
    return "\n".join(lines) + "\n"


def tree_model(client_cpu, level_latency, hosts, fanout, cores):
    """Seconds until the last agent starts: every level pays one connection's latency plus its
    node's share of F handshakes of client CPU on `cores` cores; flat when fanout is None."""
    if fanout is None:
        return level_latency + hosts * client_cpu / cores
    return tree_depth(hosts, fanout) * (level_latency + min(fanout, hosts) * client_cpu / cores)


def measured_summary(doc):
    """What the tree table says, in words: where the best tree overtook the flat launch here."""
    tree = doc["tree"]
    best = {}
    for n, e in tree.items():
        f, t = min(e["tree"].items(), key=lambda kv: kv[1]["last_worker_s"]["median"])
        best[int(n)] = (int(f), t["last_worker_s"]["median"], e["flat_last_worker_s"]["median"])
    wins = sorted(n for n, (_f, t, fl) in best.items() if t < fl)
    loses = sorted(n for n, (_f, t, fl) in best.items() if t >= fl)
    big = max(best)
    text = ("Every sshd, agent and worker of every namespace runs on the same %d vCPUs, so both launches spend "
            "about the same CPU in total (N handshakes); what the tree moves is where it is spent: the "
            "launcher's own CPU falls from N handshakes to F (the launcher CPU columns). Measured here: at %d "
            "hosts the last worker started after %.2f s flat and %.2f s through the best tree (fan-out %d)" %
            (doc["machine"]["cpus"], big, best[big][2], best[big][1], best[big][0]))
    if wins and (not loses or max(loses) < min(wins)):
        text += "; the tree was faster from %d hosts on%s." % (
            min(wins), " and slower at %s" % ", ".join(str(n) for n in loses) if loses else "")
    else:
        text += "; faster at %s, not at %s (no clear threshold on this box)." % (
            ", ".join(map(str, wins)) or "none", ", ".join(map(str, loses)) or "none")
    text += (" A SIGKILL of the launcher left nothing in any namespace at every depth measured (up to %d)." %
             max(t["depth"] for e in tree.values() for t in e["tree"].values()))
    return text


def tree_markdown(doc):
    tree = doc["tree"]
    res = doc["results"]
    fanouts = sorted({int(f) for e in tree.values() for f in e["tree"]})

    def fmt(s):
        return "%.2f s (%.2f-%.2f)" % (s["median"], s["min"], s["max"])
    head = "| hosts | flat: whole command | flat: last worker | flat: launcher CPU |"
    for f in fanouts:
        head += " tree F=%d: depth, whole command | last worker | launcher CPU | SIGKILL -> nothing left |" % f
    lines = ["**Launch tree** (`--ssh-tree-threshold 1 --ssh-tree-fanout F`, agents that start agents; flat and "
             "tree runs interleaved on the same bed, %d repetitions, median (min-max)):" % doc["tree_reps"], "",
             head, "|" + "---|" * (4 + 4 * len(fanouts))]
    for n, e in tree.items():
        row = "| %s | %s | %s | %.2f s |" % (n, fmt(e["flat_whole_s"]), fmt(e["flat_last_worker_s"]),
                                              e["flat_launcher_cpu_s"]["median"])
        for f in fanouts:
            t = e["tree"].get(str(f))
            row += " %d, %s | %s | %.2f s | %s |" % (t["depth"], fmt(t["whole_s"]), fmt(t["last_worker_s"]),
                                                    t["launcher_cpu_s"]["median"], fmt(t["sigkill_to_clean_s"])) \
                if t else " - | - | - | - |"
        lines.append(row)
    # The model's constants, from this run: client CPU per handshake (flat table) and the latency of
    # one level (the 1-host ssh floor when measured, else the floor fit's intercept).
    if res:
        cpu = statistics.median(r["launcher_cpu_per_host_s"]["median"] for r in res.values())
        latency = res["1"]["ssh_floor_s"]["median"] if "1" in res else min(
            r["ssh_floor_s"]["median"] for r in res.values())
        cores = 8
        rows = []
        for n in (100, 1000, 10000):
            cells = ["%.1f s" % tree_model(cpu, latency, n, None, cores)]
            cells += ["%.1f s (depth %d)" % (tree_model(cpu, latency, n, f, cores), tree_depth(n, f))
                      for f in (16, 32)]
            rows.append("| %d | %s |" % (n, " | ".join(cells)))
        even = next((n for n in range(2, 100000)
                     if tree_model(cpu, latency, n, 16, cores) < tree_model(cpu, latency, n, None, cores)), None)
        lines += ["", measured_summary(doc), "",
                  "Model for real hosts (each node has its own cores): one level costs a connection's latency "
                  "L = %.2f s (the 1-host ssh floor measured above) plus F handshakes of client CPU, c = %.1f ms "
                  "each, on the node's C cores; a flat launch costs L + N x c / C, a tree depth x (L + F x c / C). "
                  "With C = %d:" % (latency, 1000 * cpu, cores), "",
                  "| hosts | flat | tree F=16 | tree F=32 |", "|---|---|---|---|"] + rows + [
                  "", "Break-even (tree F=16 faster than flat, same model, C = %d): from %s hosts; ddprun's "
                  "defaults are --ssh-tree-threshold 64, --ssh-tree-fanout 16 (launchers with fewer cores break "
                  "even earlier). On this %d-vCPU bed every host shares the launcher's cores, so the measured "
                  "gain is the launcher's own CPU (the columns above), not the wall time." %
                  (cores, even if even else "-", doc["machine"]["cpus"])]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ddprun", required=True)
    ap.add_argument("--quick", action="store_true", help="hosts 2,4 and 3 repetitions")
    ap.add_argument("--hosts", default=None, help="comma list of host counts (default 2,4,8,16)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--tree-hosts", default=None,
                    help="comma list of host counts for flat vs launch tree (default 8,16,32,64; --quick: 3; 0: none)")
    ap.add_argument("--tree-fanouts", default=None, help="comma list of tree fan-outs (default 2,4,16; --quick: 2)")
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    ap.add_argument("--update-doc", help="replace the fanout block of this docs/performance.md")
    a = ap.parse_args()
    try:
        preflight()
    except SkipTest as e:
        sys.exit("cannot run the fan-out benchmark here: %s" % e)
    counts = [int(x) for x in (a.hosts or ("2,4" if a.quick else "2,4,8,16")).split(",") if int(x) > 0]
    reps = a.reps or (3 if a.quick else 5)
    res = bench(os.path.abspath(a.ddprun), counts, reps) if counts else {}
    tree_counts = [int(x) for x in (a.tree_hosts or ("3" if a.quick else "8,16,32,64")).split(",") if int(x) > 0]
    fanouts = [int(x) for x in (a.tree_fanouts or ("2" if a.quick else "2,4,16")).split(",")]
    tree_reps = min(reps, 3)
    tree = tree_bench(os.path.abspath(a.ddprun), tree_counts, tree_reps, fanouts) if tree_counts else {}
    ssh_version = subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip()
    doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "ssh": ssh_version},
           "reps": reps, "results": res, "tree_reps": tree_reps, "tree": tree}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)
    md = markdown(doc)
    if a.update_doc:
        update_doc(a.update_doc, "fanout", "bench/fanout/run.py", md)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    print(md)


if __name__ == "__main__":
    main()
