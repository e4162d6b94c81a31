"""Drafts for the embedded engine's speculative decoding (``--speculative-algorithm NGRAM``).

N-gram drafts (prompt lookup; SGLang's NGRAM, vLLM's ``ngram``): the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, longest n first. They cost no model and are right where an output
repeats its context: tool outputs quoted back, code edited in place, a chain of thought that restates the
question. The scheduler verifies them against the target model in one forward (`sampling.verify`), so the
tokens follow the target's distribution whatever the drafts are; drafts only change how many tokens a forward
yields.
"""

from __future__ import annotations

import numpy as np

# the longest and shortest tails looked up (SGLang's NGRAM matches windows of 1 to a few tokens too)
MAX_MATCH = 4
MIN_MATCH = 1


def ngram_draft(seq: list[int] | np.ndarray, k: int, max_match: int = MAX_MATCH, min_match: int = MIN_MATCH
                ) -> list[int]:
    """Up to `k` tokens to follow `seq`: those after the latest earlier occurrence of its last n tokens that has k
    after it (else the earliest, which has the most), for the largest n in [min_match, max_match] that occurs;
    none when no tail occurs before. (In a loop the latest occurrence is the window just before the tail, with
    one token after it: the latest with k after it drafts the loop on.)"""
    a = np.asarray(seq, dtype=np.int64)
    ends = np.flatnonzero(a[:-1] == a[-1])  # where an earlier copy of the last token sits: every match ends there
    for n in range(min(max_match, len(a) - 1), min_match - 1, -1):
        hits = ends[ends >= n - 1]
        for i in range(1, n):
            hits = hits[a[hits - i] == a[-1 - i]]
        if len(hits):
            whole = hits[hits + 1 + k <= len(a)]
            start = int(whole[-1] if len(whole) else hits[0]) + 1
            return a[start:start + k].tolist()
    return []
