"""What SGLang's ``return_logprob`` adds beside the sampled tokens' log-probs, for the embedded engine's requests: a
prompt's log-probs from ``logprob_start_len`` (plain log-softmax, whatever the temperature; none for the first token,
as SGLang), the top log-probs and the asked ids' log-probs at each prompt position and at each sampled token (there at
the row's temperature, as its log-prob). Checked against live SGLang's values on the live tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlx.rollout.engines.embedded.scheduler import Request

LOGPROB_CHUNK = 2048  # prompt positions scored at a time (SGLang's SGLANG_LOGPROB_CHUNK_SIZE default)


def topk(logp: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """Per row of `logp`, its `k` largest log-probs with their ids, largest first (all of them, for a `k` past the
    vocabulary, where SGLang's scheduler would fail)."""
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]


def of_ids(logp: torch.Tensor, ids: list[int]) -> list[list[tuple[float, int]]]:
    """Per row of `logp`, the log-probs of `ids`, in their order."""
    return [list(zip(v, ids, strict=True)) for v in logp[:, ids].tolist()]


def score_prompt(requests: list[Request], ids: list[int], logits: torch.Tensor, first: int) -> None:
    """SGLang's prompt log-probs for `requests` (all with the prompt `ids`) from the logits of positions `first` on (``[positions,
    V]``): from each request's start, the token with the log-prob its position before gives it (none for the first,
    as SGLang), the top log-probs and the asked ids' log-probs there (plain log-softmax, no temperature, as SGLang);
    and for a request that generates nothing, SGLang's one entry of output top log-probs, from the last position."""
    for r in requests:
        s = r.logprob_start_len
        if r.scores_prompt:
            r.input_logprobs, r.input_top, r.input_ids_logprobs = [(None, ids[s])], [None], [None]
            # the positions before tokens s + 1 .. (in chunks, as SGLang's: a [positions, V] fp32 copy of a long
            # prompt's logits would be gigabytes)
            for c in range(s, len(ids) - 1, LOGPROB_CHUNK):
                end = min(c + LOGPROB_CHUNK, len(ids) - 1)
                rows = torch.log_softmax(logits[c - first:end - first].float(), -1)
                after = torch.tensor(ids[c + 1:end + 1], dtype=torch.long, device=rows.device)
                r.input_logprobs += zip(rows.gather(1, after[:, None])[:, 0].tolist(), ids[c + 1:end + 1],
                                        strict=True)
                if r.top_logprobs_num > 0:
                    r.input_top += topk(rows, r.top_logprobs_num)
                if r.token_ids_logprob is not None:
                    r.input_ids_logprobs += of_ids(rows, r.token_ids_logprob)
            if r.top_logprobs_num <= 0:
                r.input_top = []
            if r.token_ids_logprob is None:
                r.input_ids_logprobs = []
        if r.params.max_new_tokens <= 0:
            last = torch.log_softmax(logits[-1:].float(), -1)
            if r.top_logprobs_num > 0:
                r.output_top = topk(last, r.top_logprobs_num)
            if r.token_ids_logprob is not None:
                r.output_ids_logprobs = of_ids(last, r.token_ids_logprob)

def extras(r: Request, logits: torch.Tensor) -> None:
    """The top log-probs and asked ids' log-probs of the distribution a token of `r` was sampled from (`logits`
    ``[V]``, at the row's temperature, as its log-prob), where the request asks for them."""
    t = r.params.temperature
    logp = torch.log_softmax(logits[None].float() / (t if t > 0 else 1.0), -1)
    if r.top_logprobs_num > 0:
        r.output_top += topk(logp, r.top_logprobs_num)
    if r.token_ids_logprob is not None:
        r.output_ids_logprobs += of_ids(logp, r.token_ids_logprob)
