"""tests/interop/contract.py over every pair with torch 2.6 in it (fresh server per pair):

  torch 2.6 client     -> torch 2.6 server  (validates the expectations against 2.6 itself)
  torch 2.6 client     -> ddprun-rdzvd
  ddprun client modern -> torch 2.6 server
  torch 1.13 + torch 2.6 clients -> one ddprun-rdzvd, the contract run by both at once, each
                          under its own key prefix (num_keys checks skipped: they count both)
"""
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _torch2 import Torch2Runner, start_torch2_server  # noqa: E402
from _common import Checker, main, start_rdzvd  # noqa: E402
from contract import CONTRACT, DriverRunner, TorchRunner, run_contract  # noqa: E402


class Prefixed:
    """Runs the contract under a key prefix, without the num_keys steps (a shared server)."""

    def __init__(self, inner, prefix):
        self.inner, self.prefix = inner, prefix

    def run(self, op, args):
        if op == "num_keys":
            return None
        if op == "wait":
            return self.inner.run(op, ([self.prefix + k for k in args[0]], args[1]))
        return self.inner.run(op, (self.prefix + args[0],) + tuple(args[1:]))


def test():
    ck = Checker()
    pairs = [
        ("torch2.6->torch2.6", start_torch2_server, Torch2Runner),
        ("torch2.6->rdzvd", start_rdzvd, Torch2Runner),
        ("ddprun(modern)->torch2.6", start_torch2_server, lambda port: DriverRunner(port, "modern")),
    ]
    for name, start, make in pairs:
        proc, port = start()
        try:
            run_contract(make(port), name, ck)
        finally:
            proc.kill()
            proc.wait(timeout=10)

    # Both generations at the same time on one port.
    proc, port = start_rdzvd()
    contract_no_count = [(op, a, None if op == "num_keys" else w) for op, a, w in CONTRACT]
    results = {}

    def run(name, runner):
        sub = Checker()
        for i, (op, args, want) in enumerate(contract_no_count):
            got = runner.run(op, args)
            sub.eq(f"{name} #{i} {op}", got, want)
        results[name] = sub

    runners = {"torch1.13+2.6->rdzvd: 1.13": Prefixed(TorchRunner(port), "g13/"),
               "torch1.13+2.6->rdzvd: 2.6": Prefixed(Torch2Runner(port), "g26/")}
    threads = [threading.Thread(target=run, args=(n, r), daemon=True) for n, r in runners.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        ck.true("contract thread finished", not t.is_alive())
    for name, sub in results.items():
        ck.passed += sub.passed
        ck.failures += sub.failures
    proc.kill()
    proc.wait(timeout=10)
    print(f"{len(CONTRACT)} operations x {len(pairs) + 2} runs")
    ck.finish("store contract with torch 2.6")


if __name__ == "__main__":
    main(test)
