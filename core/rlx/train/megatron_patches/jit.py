"""On a machine without CUDA, megatron's ``jit_fuser`` becomes a no-op decorator as ``megatron.core.jit`` is
imported.

``jit_fuser`` is ``torch.compile``. Decorating megatron's fused functions with it imports torch's dynamo and
inductor, 1.3 s of every trainer process's start. Compiling them on their first call would take tens of seconds
on CPU, so rlx never lets that happen (`rlx.train.megatron_patches.cpu.no_compile`); as plain functions they are the
same code. Installed by ``import rlx.train``, which every trainer process does before megatron; torch-free until
megatron itself is imported. GPU machines keep megatron's choice.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Sequence


class _NoJitFuserOnCPU:  # a meta path finder (not importlib.abc's class: importing that costs 18 ms)
    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            import torch

            if not torch.cuda.is_available():
                module.disable_jit_fuser()

        setattr(spec.loader, "exec_module", exec_module)  # this spec's own loader object (a method, to its types)
        return spec


def install() -> None:
    if "megatron.core.jit" not in sys.modules and not any(isinstance(f, _NoJitFuserOnCPU) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoJitFuserOnCPU())
