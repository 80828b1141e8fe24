"""Test-environment fix for Debian trixie's torch 2.6 (python3-torch2 puts this directory first
on PYTHONPATH).

Debian builds torch 2.6 without libuv, yet TCPStore(...) defaults to use_libuv=True and torchrun's
c10d backend passes use_libuv=True explicitly, so every store fails with "use_libuv was requested
but PyTorch was build without libuv support". When torch._C loads, TCPStore is replaced by a
subclass that always selects the other (non-libuv) backend, the one this build has. The c10d
submodule only exists once torch.distributed calls torch._C._c10d_init(), so that call is wrapped
when torch._C loads. Nothing is imported until the program imports torch itself, so plain Python
starts as fast as before.
"""
import importlib.abc
import importlib.machinery
import sys


def _patch(c_module):
    c10d = getattr(c_module, "_distributed_c10d", None)
    if c10d is None or getattr(c10d.TCPStore, "_ddprun_no_libuv", False):
        return
    base = c10d.TCPStore

    class TCPStore(base):
        _ddprun_no_libuv = True
        __doc__ = base.__doc__

        def __init__(self, *args, **kwargs):
            kwargs["use_libuv"] = False
            super().__init__(*args, **kwargs)

    TCPStore.__module__ = base.__module__
    TCPStore.__qualname__ = base.__qualname__
    c10d.TCPStore = TCPStore


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        init = getattr(module, "_c10d_init", None)
        if init is None:
            return

        def _c10d_init(*args, **kwargs):
            ok = init(*args, **kwargs)
            _patch(module)
            return ok

        module._c10d_init = _c10d_init


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "torch._C":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())


def _chain():
    """Run the sitecustomize this file shadows (python3-torch2 puts this directory first on
    PYTHONPATH, ahead of e.g. ddprun's stack hook, docs/errors.md): without this, a ddprun worker
    run through python3-torch2 would never register its faulthandler hook."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    # This directory holds nothing else: off the path, so the import below finds the next one.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the next one on the path)
    except ImportError:
        sys.modules["sitecustomize"] = me


_chain()
