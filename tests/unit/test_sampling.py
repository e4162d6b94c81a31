"""The embedded engine's sampler: draws follow the row's probabilities and never pick a truncated token."""

import torch

from rlx.rollout.engines.embedded.sampling import SamplingParams, draw, sample


def test_draws_follow_each_rows_probabilities():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.05, 0.6, 0.0, 0.15, 0.2], [0.0, 0.0, 0.5, 0.5, 0.0]])
    rows = probs.repeat(100_000, 1)
    tokens = draw(rows * 3.0, g).view(-1, 2)  # unnormalised rows too
    for r in range(2):
        freq = torch.bincount(tokens[:, r], minlength=5).float() / tokens.shape[0]
        assert torch.allclose(freq, probs[r], atol=0.005), (r, freq)
        assert freq[probs[r] == 0].sum() == 0


def test_a_uniform_rounded_up_to_the_total_takes_the_last_token_with_probability(monkeypatch):
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape))
    assert draw(probs, torch.Generator()).tolist() == [1, 3]


def test_truncation_and_greedy_rows_in_one_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]).repeat(4, 1)
    params = [SamplingParams(top_k=2), SamplingParams(temperature=0), SamplingParams(top_p=0.01),
              SamplingParams(min_p=0.5)]
    for _ in range(200):
        tokens, logprobs = sample(logits, params, g)
        assert tokens[0] in (1, 2) and tokens[1] == 1 and tokens[2] == 1 and tokens[3] in (1, 2)
        want = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]  # temperature 1: the model's log-prob
        assert torch.allclose(logprobs[[0, 2, 3]], want[[0, 2, 3]])
