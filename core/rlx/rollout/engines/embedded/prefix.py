"""The embedded engine's prefix cache: keys and values of token sequences it has seen, for requests that start
with them.

A multi-turn or agent conversation sends its whole history every turn; SGLang keeps the history's KV in a radix
tree, so a turn prefills only its new tokens (and sglang-router's cache-aware policy sends a conversation back to
the engine that holds it). This cache does the same for the embedded engine:

- after a prefill, each new prompt's KV goes in; when a request finishes, its prompt and output's KV replaces it;
- a request takes the longest cached prefix of its ids (always leaving at least one token to run, whose logits
  it samples from), and prefills only the rest;
- entries are evicted least recently used first, beyond a budget of tokens; a weight update or
  ``/flush_cache`` empties it (KV from other weights is not these weights' KV).

Entries are flat (an entry per sequence, not a tree that shares prefixes): simpler, at the price of memory when
many sequences share a long prefix, which the budget bounds. The n samples of one prompt share its prefill
without the cache (the scheduler forks the prompt's KV).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [1, kv heads, tokens, head dim]


class _Node:
    __slots__ = ("children", "entry")

    def __init__(self, entry: int | None):
        self.children: dict[int, _Node] = {}
        self.entry = entry  # the id of a cached sequence that passes through this node (the newest)


class PrefixCache:
    """Sequences' KV by their ids, found through a token trie: a lookup walks the request's ids once (a dict
    lookup per id), whatever the number of entries. Nodes name entries by a small integer, never by the
    sequence itself: hashing a 60k-token tuple at every node of a 60k-token path would take minutes."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, tuple[tuple[int, ...], KV]] = OrderedDict()  # least recently used first
        self._next = 0
        self.root = _Node(None)
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[tuple[int, ...]]:
        """The cached sequences, least recently used first."""
        return [seq for seq, _ in self._entries.values()]

    def _walk(self, ids: list[int] | tuple[int, ...]) -> list[_Node]:
        """The nodes along `ids` that exist, root first."""
        path, node = [self.root], self.root
        for t in ids:
            node = node.children.get(t)
            if node is None:
                break
            path.append(node)
        return path

    def match(self, ids: list[int]) -> tuple[int, KV] | None:
        """The longest cached prefix of `ids` that leaves at least one id to run: (its length, its KV views)."""
        if not self._entries or len(ids) < 2:
            return None
        path = self._walk(ids[:-1])
        n = len(path) - 1
        if n == 0:
            return None
        eid = path[-1].entry
        self._entries.move_to_end(eid)
        return n, [(k[:, :, :n], v[:, :, :n]) for k, v in self._entries[eid][1]]

    def insert(self, ids: list[int], kv: KV) -> None:
        """Keep `kv` (owned copies, [1, heads, len(ids), dim] per layer) for `ids`. A held sequence that `ids`
        extends goes; `ids` already inside a held sequence are not added."""
        if not ids or len(ids) > self.max_tokens:
            return
        key = tuple(ids)
        path = self._walk(key)
        if len(path) - 1 == len(key):  # already held, as itself or inside a longer sequence
            self._entries.move_to_end(path[-1].entry)
            return
        eid, self._next = self._next, self._next + 1
        node = path[-1]
        for t in key[len(path) - 1:]:
            node.children[t] = _Node(eid)
            node = node.children[t]
        passing = set()
        for n in path[1:]:
            passing.add(n.entry)
            n.entry = eid
        for old in passing:  # held sequences that `key` extends are now redundant
            seq = self._entries[old][0] if old in self._entries else None
            if seq is not None and len(seq) <= len(key) and key[:len(seq)] == seq:
                self._forget(old)
        self._entries[eid] = (key, kv)
        self.tokens += len(key)
        while self.tokens > self.max_tokens:
            self._evict(next(iter(self._entries)))

    def _forget(self, eid: int) -> None:
        """Drop an entry whose ids a newer entry holds (its nodes stay, pointing at the newer one)."""
        seq, _ = self._entries.pop(eid)
        self.tokens -= len(seq)

    def evict(self, ids: tuple[int, ...] | list[int]) -> None:
        """Drop the entry holding exactly `ids`."""
        path = self._walk(ids)
        eid = path[-1].entry if len(path) - 1 == len(ids) else None
        if eid is None or self._entries[eid][0] != tuple(ids):
            raise KeyError(f"no cached sequence of {len(ids)} ids like that")
        self._evict(eid)

    def _evict(self, eid: int) -> None:
        """Drop an entry and the trie nodes only it used; nodes it shares point at another entry."""
        key = self._entries[eid][0]
        self._forget(eid)
        path = self._walk(key)
        for depth in range(len(path) - 1, 0, -1):
            node = path[depth]
            if node.entry != eid:
                continue
            if node.children:
                node.entry = next(iter(node.children.values())).entry
            else:
                del path[depth - 1].children[key[depth - 1]]

    def clear(self) -> None:
        self._entries.clear()
        self.root = _Node(None)
        self.tokens = 0
