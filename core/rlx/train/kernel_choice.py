"""Choosing a kernel for an operation that model bridges run through the kernels hook (``register_kernels``).

A kernel is registered as ``{op}-{choice}`` (for example ``gdn-flashqla``, ``gdn-fla``, ``gdn-torch``) with
``op``, ``priority`` (higher is preferred by ``auto``; 0 by default), and ``supports(**query)``, which returns
None when it can run the query (device, dtype, head sizes...) or the reason it cannot, without importing anything
heavy. `select` returns the kernel a bridge should call:

* a choice by name must be able to run the query, else a clear error saying why (never a silent fallback);
* ``auto`` takes the most preferred kernel that can, after every one that cannot says why.

Each selection is logged once per process (op, kernel, and why the better ones were passed over).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from rlx.errors import RLXError

if TYPE_CHECKING:
    import torch

    from rlx.plugins import Plugins
    from rlx.protocols import Kernel

_logged: set[tuple[str, str]] = set()
_installed: dict[str, Any] = {"kernel": None, "library": None}


def candidates(plugins: Plugins, op: str) -> list[Any]:
    """The registered kernels for `op`, most preferred first."""
    found = [plugins.component("kernels", n) for n in plugins.names("kernels")]
    found = [c for c in found if getattr(c.obj, "op", None) == op]
    objs = [c.obj() if isinstance(c.obj, type) else c.obj for c in found]
    return sorted(objs, key=lambda k: -getattr(k, "priority", 0))


def select(plugins: Plugins, op: str, choice: str = "auto", where: str = "kernels", **query: Any) -> Any:
    """The kernel for `op` (`choice`: a kernel's name without the ``{op}-`` prefix, or ``auto``), able to run
    `query`. `where` names the caller's setting in errors (a model bridge passes its config key)."""
    kernels = candidates(plugins, op)
    if not kernels:
        raise RLXError(f"{where}.{op}: no kernel for {op!r} is installed (kernel plugins register them; "
                       f"`rl plugins` lists the installed kernels)")
    names = [k.name.removeprefix(f"{op}-") for k in kernels]
    passed: list[str] = []
    if choice != "auto":
        if choice not in names:
            raise RLXError(f"{where}.{op}: unknown kernel {choice!r}; installed: {', '.join(names)} (or auto)")
        kernel = kernels[names.index(choice)]
        reason = kernel.supports(**query)
        if reason is not None:
            raise RLXError(f"{where}.{op}: {choice!r} cannot run here: {reason}")
    else:
        for kernel, name in zip(kernels, names, strict=True):
            reason = kernel.supports(**query)
            if reason is None:
                break
            passed.append(f"{name}: {reason}")
        else:
            raise RLXError(f"{where}.{op}: no installed kernel can run here: " + "; ".join(passed))
    key = (op, kernel.name)
    if key not in _logged:
        _logged.add(key)
        why = f" (passed over: {'; '.join(passed)})" if passed else ""
        print(f"rlx: kernel for {op}: {kernel.name} ({choice}){why}", file=sys.stderr, flush=True)
    return kernel


def matmul_choice(kernels: dict[str, str]) -> str:
    """``model.kernels.matmul``: torch's own unless named. Replacing torch's ``aten::mm`` in a process is opt-in
    (``auto``, which measures, or ``onednn``), never a default."""
    return kernels.get("matmul", "torch")


def use_matmul(plugins: Plugins, choice: str = "torch", device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, hidden: int = 512, fallback: bool = False) -> Kernel:
    """Select this process's ``matmul`` kernel (``model.kernels.matmul``) and install it for torch's CPU matrix
    products (`install_matmul`); returns the kernel. ``auto`` lets a kernel measure whether
    it pays on this CPU (``measure=True`` in the query); a kernel chosen by name is taken as chosen. With
    `fallback` (an engine, whose device may not be the trainer's), a named kernel that cannot run here gives way
    to ``auto``, saying so. `hidden`: the model's width, the shape a kernel measures."""
    try:
        kernel = select(plugins, "matmul", choice, where="model.kernels", device=device, dtype=dtype,
                        hidden=hidden, measure=choice == "auto")
    except RLXError as e:
        if choice == "auto" or not fallback:
            raise
        print(f"rlx: warning: {e}; this process uses auto", file=sys.stderr, flush=True)
        kernel = select(plugins, "matmul", "auto", where="model.kernels", device=device, dtype=dtype, hidden=hidden,
                        measure=True)
    install_matmul(kernel)
    return kernel


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _installed["kernel"](a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1,
           alpha: float = 1) -> torch.Tensor:
    kernel = _installed["kernel"]
    if hasattr(kernel, "addmm"):
        return kernel.addmm(bias, a, b, beta=beta, alpha=alpha)
    out = kernel(a, b)
    if alpha != 1:
        out.mul_(alpha)
    return out.add_(bias, alpha=beta)


def install_matmul(kernel: Kernel) -> None:
    """Make `kernel` (a ``matmul`` kernel: ``kernel(a, b)`` is ``a @ b``, with an optional ``addmm(bias, a, b,
    beta=, alpha=)``) this process's CPU ``aten::mm`` and ``aten::addmm``; a kernel with ``native = True``
    (``matmul-torch``) leaves torch's own in place, or puts it back. Autograd's backward products go through the
    same ops, so a training step's gradients use the kernel too."""
    import warnings

    import torch

    native = getattr(kernel, "native", False)
    if not native and _installed["library"] is None:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns that a kernel for a built-in op is being replaced
            warnings.simplefilter("ignore")
            lib.impl("mm", _mm, "CPU")
            lib.impl("addmm", _addmm, "CPU")
        _installed["library"] = lib
    elif native and _installed["library"] is not None:
        _installed["library"]._destroy()
        _installed["library"] = None
    _installed["kernel"] = kernel
