"""The embedded engine's sampler: draws follow the row's probabilities and never pick a truncated token; a row with a
sampling_seed draws the same token whatever else runs."""

import torch

from rlx.rollout.engines.embedded.sampling import SamplingParams, draw, sample, seeded_uniform


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


def test_a_seeded_row_draws_its_own_number_whatever_else_the_batch_holds():
    """A row with a sampling_seed inverts its cdf at seeded_uniform(seed, position): by hand, probabilities
    [0.2, 0.5, 0.3] (cdf 0.2, 0.7, 1.0) at u = 0.65 take token 1 and at u = 0.75 token 2. The row's token is the same
    alone or beside other rows, and with any generator state; the unseeded rows still draw from the generator."""
    probs = torch.tensor([[0.2, 0.5, 0.3]])
    assert draw(probs, torch.Generator(), {0: 0.65}).tolist() == [1]
    assert draw(probs, torch.Generator(), {0: 0.75}).tolist() == [2]
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(sampling_seed=s) for s in (11, None, 12, None, 11)]
    alone = [sample(logits[i:i + 1], [params[i]], torch.Generator().manual_seed(i),
                    {0: seeded_uniform(params[i].sampling_seed, 3)})[0].item() for i in (0, 2, 4)]
    for g in range(5):
        seeded = {i: seeded_uniform(p.sampling_seed, 3) for i, p in enumerate(params) if p.sampling_seed is not None}
        tokens, _ = sample(logits, params, torch.Generator().manual_seed(g), seeded)
        assert tokens[[0, 2, 4]].tolist() == alone
    unseeded = {tuple(sample(logits, params, torch.Generator().manual_seed(g))[0][[1, 3]].tolist()) for g in range(20)}
    assert len(unseeded) > 1


def test_seeded_uniforms_depend_on_seed_and_position_only_and_are_uniform():
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3)
    assert len({seeded_uniform(7, p) for p in range(1000)}) == 1000
    assert seeded_uniform(7, 3) != seeded_uniform(8, 3)
    us = torch.tensor([seeded_uniform(s, p) for s in range(100) for p in range(100)], dtype=torch.float64)
    assert 0 <= float(us.min()) and float(us.max()) < 1
    counts = torch.histc(us, bins=10, min=0, max=1)  # 1000 expected per tenth; sd about 30
    assert bool((counts - 1000).abs().max() < 150), counts
