"""Built-in kernels for the ``matmul`` op: which library runs a process's fp32 matrix products on CPU.

torch runs CPU matmuls (``aten::mm``, and ``aten::addmm`` for a linear layer with a bias) through MKL. MKL picks
its code path by CPU vendor: on AMD CPUs it does not use AVX-512, and oneDNN, which torch also ships, runs the
same fp32 products about twice as fast there (this project's AMD EPYC, 2 threads: 190-210 GFLOP/s through MKL,
380-460 through oneDNN; ``benchmarks/limits.py`` prints both). ``matmul-onednn`` routes those two ops through
oneDNN in the process that installs it (`rlx.train.kernel_choice.install_matmul`): the trainer's megatron layers forward and backward,
and the embedded engine's model. oneDNN builds a primitive the first time it meets a shape (0.3-0.4 ms on this machine,
more than a small product takes): a product of at least `ONEDNN_BIG_MACS` multiply-adds goes to oneDNN at once,
a smaller one of at least `ONEDNN_MIN_MACS` once its shape has come `ONEDNN_REPEATS` times (a decode step's
products at one batch size), torch's own kernel before that and for the smallest. Both compute in fp32 with
fp32 accumulation; their sums are ordered differently, so results differ in the last bits (about 5e-6
relative), as between any two BLAS libraries.

``auto`` takes oneDNN only where it measures at least `ONEDNN_MIN_SPEEDUP` times torch's own speed on a product
of the model's width (``[1024, hidden] @ [hidden, hidden]``, once per process, at most about 10 ms): a CPU where
MKL is at its best keeps MKL, and so does a model too narrow to gain (the built-in tiny one, 64 wide), which
would only pay the replacement's dispatch on every product. Replacing torch's kernel is opt-in: without
``model.kernels.matmul`` (or with ``torch``) torch's own runs; ``{matmul: auto}`` measures, ``{matmul: onednn}``
asks for oneDNN whatever it measures.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlx.hookspecs import RegisterKernels, hookimpl

if TYPE_CHECKING:
    import torch  # imported where a kernel runs: not when the plugins load

ONEDNN_MIN_MACS = 1 << 22  # smaller products stay with torch's kernel (oneDNN's fixed cost per call is larger)
ONEDNN_BIG_MACS = 1 << 26  # products this large go to oneDNN the first time: building its primitive costs less
ONEDNN_REPEATS = 8  # a product in between goes to oneDNN once its shape has come this many times
_SEEN_MAX = 1 << 14  # shapes counted before the count starts again (prompt lengths vary without end)
ONEDNN_MIN_SPEEDUP = 1.3  # auto: oneDNN must be this much faster than torch's own on this CPU

def _is_cpu(device: torch.device | str | None) -> bool:
    return device is None or str(device).split(":")[0] == "cpu"


def _onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    import torch

    # a @ b as oneDNN's linear: out = a @ weight.t() (+ bias) with weight = b.t(), a view (no copy)
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")


_seen: dict[tuple[int, int, int], int] = {}


def _use_onednn(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    if a.dtype is not torch.float32 or b.dtype is not torch.float32:
        return False
    shape = (a.shape[0], a.shape[1], b.shape[1])
    macs = shape[0] * shape[1] * shape[2]
    if macs >= ONEDNN_BIG_MACS:
        return True
    if macs < ONEDNN_MIN_MACS:
        return False
    if len(_seen) >= _SEEN_MAX:
        _seen.clear()
    n = _seen[shape] = _seen.get(shape, 0) + 1
    return n > ONEDNN_REPEATS


def _torch_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.mm(a, b, out=a.new_empty((a.shape[0], b.shape[1])))  # aten::mm.out: torch's own kernel


@functools.cache
def onednn_speedup(rows: int = 1024, hidden: int = 512, reps: int = 5) -> tuple[float, float]:
    """GFLOP/s of an fp32 ``[rows, hidden] @ [hidden, hidden]`` product (a layer of a model `hidden` wide) through
    torch's own kernel and through `OneDNNMatmul`, which keeps torch's for products too small to gain and pays
    its own dispatch; on this process's threads, best of `reps` after a warm-up each.

    It runs on a thread of its own that ends with it. A thread's first parallel op gives it an OpenMP team that
    lives as long as the thread, and libgomp counts every team's threads: with more than the cores, its idle
    threads stop spinning, and every small parallel op waits for a wake-up. Measured from the embedded engine's
    main thread (its model runs on the scheduler's), that took the tiny model's rollout from 0.07 to 0.11 s."""
    import threading

    result: list[tuple[float, float]] = []
    worker = threading.Thread(target=lambda: result.append(_measure(rows, hidden, reps)), name="rlx-matmul-measure")
    worker.start()
    worker.join()
    return result[0]


def _measure(rows: int, hidden: int, reps: int) -> tuple[float, float]:
    import torch

    a, b = torch.randn(rows, hidden), torch.randn(hidden, hidden)
    out = torch.empty(rows, hidden)
    onednn = OneDNNMatmul()

    def best(f: Callable[[], object]) -> float:
        f()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return 2 * rows * hidden * hidden / min(times) / 1e9

    return best(lambda: torch.mm(a, b, out=out)), best(lambda: onednn(a, b))


class OneDNNMatmul:
    name = "matmul-onednn"
    op = "matmul"
    priority = 10

    def supports(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None, measure: bool = True,
                 hidden: int = 512,
                 **query: Any) -> str | None:
        import torch

        if not _is_cpu(device):
            return f"runs on CPU, the model is on {device} (torch's own matmul runs there)"
        if dtype is not None and dtype is not torch.float32:
            return f"replaces fp32 products, the model is {dtype} (torch already runs those through oneDNN)"
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return "this torch build has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)"
        if measure:
            own, onednn = onednn_speedup(hidden=hidden)
            if onednn < ONEDNN_MIN_SPEEDUP * own:
                return (f"not {ONEDNN_MIN_SPEEDUP}x faster than torch's own on this CPU for a layer {hidden} wide "
                        f"({onednn:.0f} against {own:.0f} GFLOP/s)")
        return None

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _onednn_mm(a, b) if _use_onednn(a, b) else _torch_mm(a, b)

    def addmm(self, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1,
              alpha: float = 1) -> torch.Tensor:
        import torch

        if (beta == 1 and alpha == 1 and bias.shape == (b.shape[1],) and bias.dtype is a.dtype
                and _use_onednn(a, b)):
            return _onednn_mm(a, b, bias)
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty((a.shape[0], b.shape[1])))


class TorchMatmul:
    name = "matmul-torch"
    op = "matmul"
    priority = 0
    native = True  # installing it leaves torch's own aten::mm in place

    def supports(self, **query: Any) -> str | None:
        return None

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _torch_mm(a, b)


@hookimpl
def register_kernels(register: RegisterKernels) -> None:
    register(OneDNNMatmul)
    register(TorchMatmul)
