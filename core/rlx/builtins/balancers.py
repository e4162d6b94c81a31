"""Built-in balancers: Karmarkar–Karp across data-parallel ranks by tokens or by FLOPs."""

from __future__ import annotations

from rlx import hookimpl
from rlx.hookspecs import RegisterBalancers
from rlx.protocols import Flops
from rlx.train.balance import karmarkar_karp


class ByTokens:
    """Equal token counts per rank."""

    name = "tokens"

    def partition(self, lengths: list[int], k: int, flops: Flops | None = None) -> list[list[int]]:
        return karmarkar_karp([float(n) for n in lengths], k)


class ByFlops:
    """Equal compute per rank: cost a·L + b·L² from the model's shape, so long samples weigh more."""

    name = "flops"

    def partition(self, lengths: list[int], k: int, flops: Flops | None = None) -> list[list[int]]:
        if flops is None:
            raise ValueError("the flops balancer needs the model's FlopsModel")
        return karmarkar_karp([flops.cost(n) for n in lengths], k)


@hookimpl
def register_balancers(register: RegisterBalancers) -> None:
    register(ByTokens)
    register(ByFlops)
