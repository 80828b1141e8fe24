"""Worker for the worker-store attack: prints "master <MASTER_PORT>" (its store), then blocks
on the release FIFO until the test has attacked the store, and exits 0. argv: INFO RELEASE."""
import os
import sys

print("master", os.environ["MASTER_PORT"], os.environ["MASTER_ADDR"], flush=True)
with open(sys.argv[2]) as release:  # blocks until the test opens the FIFO for writing
    release.readline()
