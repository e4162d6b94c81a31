"""Splitting a step's samples across data-parallel ranks, and the built-in balancers (``train.balancer``):
``tokens`` (equal token counts per rank) and ``flops`` (equal compute per rank).

* Across ranks: Karmarkar–Karp (largest differencing) into k parts of near-equal cost, the cost of a
  sample being its tokens or its FLOPs, ``a·L + b·L²`` with ``a`` and ``b`` from the model's shape
  (dense matmuls grow with L, attention with L²). Karmarkar–Karp beats greedy on the long-tailed
  lengths RL produces.
Each part keeps its samples in their original order, so training order stays deterministic. Cutting a
rank's share into micro-batches is packing's job (`rlx.train.packing.micro_batches`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from rlx import hookimpl
from rlx.hookspecs import RegisterBalancers
from rlx.protocols import Flops


@dataclass
class FlopsModel:
    """Forward cost of one sequence of length L: ``a·L + b·L²`` (constant factors dropped)."""

    a: float
    b: float

    @classmethod
    def from_shape(cls, hidden: int, layers: int, ffn: int, vocab: int, kv_heads: int | None = None,
                   heads: int | None = None) -> FlopsModel:
        kv_frac = (kv_heads / heads) if kv_heads and heads else 1.0
        per_token = layers * (2 * hidden * hidden * (1 + kv_frac) + 3 * hidden * ffn) + hidden * vocab
        per_pair = layers * hidden  # QK^T and AV, per (query, key) pair
        return cls(float(per_token), float(per_pair))

    def cost(self, length: int) -> float:
        return self.a * length + self.b * length * length


def karmarkar_karp(costs: list[float], k: int) -> list[list[int]]:
    """Partition indices 0..n-1 into k lists with near-equal cost sums (largest differencing method)."""
    if k <= 0:
        raise ValueError("k must be positive")
    # Each heap entry is a k-way partial partition: (-(max - min), tiebreak, sums, parts), parts sorted
    # by sum descending. Merging the two with the largest spread pairs the big sums with the small ones.
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for i, c in enumerate(costs):
        sums = [c] + [0.0] * (k - 1)
        parts = [[i]] + [[] for _ in range(k - 1)]
        heapq.heappush(heap, (-c, i, sums, parts))
    counter = len(costs)
    while len(heap) > 1:
        _, _, s1, p1 = heapq.heappop(heap)
        _, _, s2, p2 = heapq.heappop(heap)
        merged = sorted(((s1[j] + s2[k - 1 - j], p1[j] + p2[k - 1 - j]) for j in range(k)),
                        key=lambda x: -x[0])
        sums = [m[0] for m in merged]
        parts = [m[1] for m in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), counter, sums, parts))
        counter += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(p) for p in heap[0][3]]


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
