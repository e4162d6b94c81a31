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
    __slots__ = ("children", "label", "entry")

    def __init__(self, label: tuple[int, ...], entry: int):
        self.children: dict[int, _Node] = {}  # by the first id of the child's label
        self.label = label  # the ids on the edge into this node
        self.entry = entry  # the id of a cached sequence that passes through this node (the newest; -1: the root)


class PrefixCache:
    """Sequences' KV by their ids, found through a radix tree of token ids (an edge holds a run of ids that no
    held sequence branches in): a lookup compares the request's ids against the edges once, whatever the number
    of entries, and an insert adds one node for the ids no held sequence shares (and splits one edge where the
    new ids leave it). Nodes name entries by a small integer, never by the sequence itself: hashing a 60k-token
    tuple at every node of a 60k-token path would take minutes."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, tuple[tuple[int, ...], KV]] = OrderedDict()  # least recently used first
        self._next = 0
        self.root = _Node((), -1)
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[tuple[int, ...]]:
        """The cached sequences, least recently used first."""
        return [seq for seq, _ in self._entries.values()]

    def _walk(self, ids: tuple[int, ...]) -> tuple[list[_Node], int, int]:
        """Follow `ids` down the tree: (the nodes entered, root first; how many ids matched; how many ids of the
        last node's label matched, which is all of it unless `ids` leave the tree inside that edge)."""
        path, node, n, into = [self.root], self.root, 0, 0
        while n < len(ids):
            child = node.children.get(ids[n])
            if child is None:
                break
            label = child.label
            path.append(child)
            if ids[n:n + len(label)] == label:
                n += len(label)
                node, into = child, len(label)
                continue
            into = 1  # the first id matched (it is the child's key); find where the rest leaves the edge
            while into < len(label) and n + into < len(ids) and ids[n + into] == label[into]:
                into += 1
            n += into
            break
        return path, n, into

    def match(self, ids: list[int]) -> tuple[int, KV] | None:
        """The longest cached prefix of `ids` that leaves at least one id to run: (its length, its KV views)."""
        if not self._entries or len(ids) < 2:
            return None
        path, n, _ = self._walk(tuple(ids[:-1]))
        if n == 0:
            return None
        eid = path[-1].entry  # its sequence runs through the whole last edge, so through these n ids
        self._entries.move_to_end(eid)
        return n, [(k[:, :, :n], v[:, :, :n]) for k, v in self._entries[eid][1]]

    def insert(self, ids: list[int], kv: KV) -> None:
        """Keep `kv` (owned copies, [1, heads, len(ids), dim] per layer) for `ids`. A held sequence that `ids`
        extends goes; `ids` already inside a held sequence are not added."""
        if not ids or len(ids) > self.max_tokens:
            return
        key = tuple(ids)
        path, n, into = self._walk(key)
        if n == len(key):  # already held, as itself or inside a longer sequence
            self._entries.move_to_end(path[-1].entry)
            return
        eid, self._next = self._next, self._next + 1
        last = path[-1]
        if into < len(last.label):  # `key` leaves inside this edge: split it where it does
            parent = path[-2]
            head = _Node(last.label[:into], last.entry)
            last.label = last.label[into:]
            head.children[last.label[0]] = last
            parent.children[head.label[0]] = head
            path[-1] = last = head
        last.children[key[n]] = _Node(key[n:], eid)
        passing = set()
        for node in path[1:]:
            passing.add(node.entry)
            node.entry = eid
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

    def _evict(self, eid: int) -> None:
        """Drop an entry and the nodes only it used; nodes it shares point at another entry."""
        key = self._entries[eid][0]
        self._forget(eid)
        path, _, _ = self._walk(key)
        for depth in range(len(path) - 1, 0, -1):
            node = path[depth]
            if node.entry != eid:
                continue
            if node.children:
                node.entry = next(iter(node.children.values())).entry
            else:
                del path[depth - 1].children[node.label[0]]

    def clear(self) -> None:
        self._entries.clear()
        self.root = _Node((), -1)
        self.tokens = 0
