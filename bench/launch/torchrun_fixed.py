# Copied from shared/tools/torch-baseline/torchrun_fixed.py: Debian's torchrun 1.13 on Python 3.11
# fails in Std.from_str("0") (IntFlag change); patch that one call, then run torchrun's main().
import sys
from torch.distributed.elastic.multiprocessing import api
_orig = api.Std.from_str.__func__
def _from_str(cls, vm):
    return cls.NONE if vm == "0" else _orig(cls, vm)
api.Std.from_str = classmethod(_from_str)
from torch.distributed.run import main
sys.exit(main())
