"""SGLang's own code in a CPU process, for tests that check rlx against it rather than against a reading of it.

SGLang needs a GPU stack to run, but the parts rlx must agree with are plain Python: the request
dataclasses (``managers/io_struct.py``), sampling-parameter checks, the OpenAI-compatible types, the
payload loader (``MultiprocessingSerializer`` with its unpickling allow-list) and the engine's side of the
weight-update group. `load()` imports those from an installed ``sglang`` (``pip install --no-deps``; see
``scripts/sglang-code.txt``) after putting inert stand-ins in place of the GPU-only packages its modules
import at the top (triton, torchvision, flashinfer, sgl-kernel, ...), so that importing works on a CPU
machine. Nothing rlx checks runs through a stand-in: a test that reached one would fail.

Use it in a subprocess (the stand-ins make ``find_spec('torchvision')`` succeed, which misleads libraries
that probe for it), with ``PYTHONPATH`` pointing at the SGLang version to check.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

# Packages SGLang imports at module level that only exist (or only work) on a GPU machine.
GPU_ONLY = ("triton", "torchvision", "tvm_ffi", "sgl_kernel", "flashinfer", "deep_gemm", "tilelang", "cuda")


class _StandIn(type):
    """A class whose every attribute, call and subscript is another stand-in; called on one callable (a
    decorator such as ``@triton.jit``) it returns that callable unchanged."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(name)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _stand_in("result")

    def __getitem__(cls, key):
        return _stand_in("item")

    def __bool__(cls):
        return False

    def __or__(cls, other):
        return cls

    __ror__ = __or__


def _stand_in(name: str) -> type:
    return _StandIn(name, (), {})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+rlx-stand-in"
        return module

    def exec_module(self, module):
        pass


_LOADED: dict[str, types.ModuleType] = {}


def load() -> types.ModuleType:
    """Import the installed ``sglang`` with stand-ins for the GPU-only packages missing here; returns it.
    Raises ImportError naming what to install when SGLang itself is absent."""
    if "sglang" in _LOADED:
        return _LOADED["sglang"]
    if importlib.util.find_spec("sglang") is None:
        raise ImportError("the sglang package is not installed: run scripts/setup (it installs SGLang's code "
                          "without its GPU dependencies, from scripts/sglang-code.txt)")
    # torch decides whether triton exists when its compiler modules are first imported: let it see the truth.
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    missing = {n for n in GPU_ONLY if importlib.util.find_spec(n) is None}
    sys.meta_path.insert(0, _Finder(missing))
    import sglang
    import sglang.srt.entrypoints.openai.protocol  # noqa: F401
    import sglang.srt.managers.io_struct  # noqa: F401
    import sglang.srt.utils  # noqa: F401

    _LOADED["sglang"] = sglang
    return sglang


def version() -> str:
    sglang = load()
    return getattr(sglang, "__version__", None) or importlib.import_module("sglang.version").__version__
