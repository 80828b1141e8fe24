"""One contract (contract.py), every client/server pair:

  torch 1.13 client   -> torch 1.13 server   (validates the expectations themselves)
  torch 1.13 client   -> ddprun-rdzvd
  ddprun client legacy -> ddprun-rdzvd
  ddprun client modern -> ddprun-rdzvd
  ddprun client legacy -> torch 1.13 server
Each pair gets a fresh server, so num_keys counts are exact.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Checker, main, start_rdzvd, start_torch_server  # noqa: E402
from contract import CONTRACT, DriverRunner, TorchRunner, run_contract  # noqa: E402


def test():
    ck = Checker()
    pairs = [
        ("torch->torch", start_torch_server, lambda port: TorchRunner(port)),
        ("torch->rdzvd", start_rdzvd, lambda port: TorchRunner(port)),
        ("ddprun(legacy)->rdzvd", start_rdzvd, lambda port: DriverRunner(port, "legacy")),
        ("ddprun(modern)->rdzvd", start_rdzvd, lambda port: DriverRunner(port, "modern")),
        ("ddprun(legacy)->torch", start_torch_server, lambda port: DriverRunner(port, "legacy")),
    ]
    for name, start, make in pairs:
        proc, port = start()
        try:
            run_contract(make(port), name, ck)
        finally:
            proc.kill()
            proc.wait(timeout=10)
    print(f"{len(CONTRACT)} operations x {len(pairs)} client/server pairs")
    ck.finish("store contract")


if __name__ == "__main__":
    main(test)
