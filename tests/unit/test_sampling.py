"""The embedded engine's sampler: draws follow the row's probabilities and never pick a truncated token; a row with a
sampling_seed draws the same token whatever else runs."""

import torch

from rlx.rollout.engines.embedded.sampling import SamplingParams, draw, propose, sample, seeded_uniform, verify


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


def _processed(logits, temperature=1.0, top_p=1.0):
    """The distribution `sample` draws from, normalised: by hand, with sorting, for the tests below."""
    p = torch.softmax(logits / temperature, -1)
    sp, order = p.sort(descending=True)
    sp[(sp.cumsum(-1) - sp) >= top_p] = 0
    return torch.zeros_like(p).scatter(-1, order, sp) / sp.sum(-1, keepdim=True)


def test_speculative_verify_by_hand():
    """p = [0.5, 0.3, 0.2] at the row's last token, draft 1: the draft passes with probability p(1) = 0.3, else the
    token is drawn from p without it, [0.5, 0, 0.2] / 0.7; so token 0 has 0.7 * 5/7 = 0.5, token 1 0.3, token 2 0.2:
    p itself. A passed draft is followed by a draw from the next position's distribution."""
    n = 200_000
    l0 = torch.tensor([0.5, 0.3, 0.2]).log()
    l1 = torch.tensor([0.1, 0.1, 0.8]).log()
    logits = torch.stack([l0, l1])[None].repeat(n, 1, 1)
    tokens, logprobs, accepted = verify(logits, torch.ones(n, 1, dtype=torch.long), torch.ones(n, dtype=torch.long),
                                        [SamplingParams()] * n, torch.Generator().manual_seed(0))
    assert abs(accepted.float().mean() - 0.3) < 0.005
    first = torch.bincount(tokens[:, 0], minlength=3).float() / n
    assert torch.allclose(first, torch.tensor([0.5, 0.3, 0.2]), atol=0.005)
    second = torch.bincount(tokens[accepted == 1, 1], minlength=3).float() / int((accepted == 1).sum())
    assert torch.allclose(second, torch.tensor([0.1, 0.1, 0.8]), atol=0.01)
    assert torch.allclose(logprobs[:, 0], l0[tokens[:, 0]])  # the target's log-probs (temperature 1)
    assert torch.allclose(logprobs[accepted == 1, 1], l1[tokens[accepted == 1, 1]])


def test_speculative_tokens_follow_plain_sampling_at_temperature_1_and_0_6_with_top_p():
    """Random logits over 8 tokens, three drafts (one likely, one unlikely, one cut by top-p): for each prefix of
    drafts passed, the next token's frequency is the processed distribution at that position, the
    distribution plain sampling draws from there (within four standard errors); the log-probs are
    log_softmax(logits / temperature)."""
    g = torch.Generator().manual_seed(3)
    v, n = 8, 300_000
    logits = torch.randn(4, v, generator=g) * 2
    for temperature, top_p in ((1.0, 1.0), (0.6, 0.8)):
        p = _processed(logits, temperature, top_p)
        drafts = torch.stack([p[0].argmax(), p[1].argsort()[-3], p[2].argmin()])  # likely, unlikely, truncated
        tokens, logprobs, accepted = verify(logits[None].repeat(n, 1, 1), drafts[None].repeat(n, 1),
                                            torch.full((n,), 3), [SamplingParams(temperature=temperature,
                                                                                 top_p=top_p)] * n,
                                            torch.Generator().manual_seed(1))
        for j in range(4):  # rows that passed the first j drafts: their token j follows p[j]
            rows = accepted >= j
            if not rows.any():  # (past the draft top-p cuts)
                continue
            freq = torch.bincount(tokens[rows, j], minlength=v).float() / int(rows.sum())
            assert torch.allclose(freq, p[j], atol=4 * (0.25 / int(rows.sum())) ** 0.5 + 1e-3), (temperature, j)
        assert top_p == 1 or int((accepted == 3).sum()) == 0  # a draft top-p cut never passes
        want = torch.log_softmax(logits / temperature, -1)
        assert torch.allclose(logprobs, want[torch.arange(4)[None].expand(n, 4), tokens])


def test_speculative_greedy_padding_and_seeded_rows():
    """Greedy rows keep the drafts that are the argmax and then take the argmax; drafts past a row's length are
    padding, never taken even where they match; a seeded row's tokens do not depend on the generator."""
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]])[None].repeat(4, 1, 1)
    drafts = torch.tensor([[1, 0], [1, 2], [1, 0], [2, 0]])
    greedy = [SamplingParams(temperature=0)] * 4
    tokens, _, accepted = verify(logits, drafts, torch.tensor([2, 2, 1, 2]), greedy, torch.Generator())
    assert accepted.tolist() == [2, 1, 1, 0]
    assert [t[:a + 1] for t, a in zip(tokens.tolist(), accepted.tolist())] == [[1, 0, 2], [1, 0], [1, 0], [1]]
    seeded = [SamplingParams(sampling_seed=5)] * 4
    runs = {str(verify(logits, drafts, torch.tensor([2, 2, 1, 2]), seeded, torch.Generator().manual_seed(g),
                       {i: (5, 7) for i in range(4)})[0].tolist()) for g in range(5)}
    assert len(runs) == 1


def test_speculative_verify_of_a_draft_models_samples_by_hand():
    """Drafts drawn from q = [0.2, 0.6, 0.2] (`propose`) for p = [0.5, 0.3, 0.2]: a draft passes with probability
    min(1, p/q), in all sum(min(p, q)) = 0.7; a refused one is replaced from max(p - q, 0) / 0.3 = [1, 0, 0]; so the
    token is 0 with 0.2 + 0.3 = 0.5, 1 with 0.3, 2 with 0.2: p. A greedy row's draft is q's argmax, one-hot."""
    n = 200_000
    g = torch.Generator().manual_seed(4)
    q_logits = torch.tensor([0.2, 0.6, 0.2]).log()[None].repeat(n, 1)
    drafts, q = propose(q_logits, [SamplingParams()] * n, g)
    assert torch.allclose(q[0], torch.tensor([0.2, 0.6, 0.2]))
    logits = torch.stack([torch.tensor([0.5, 0.3, 0.2]).log(), torch.zeros(3)])[None].repeat(n, 1, 1)
    tokens, _, accepted = verify(logits, drafts[:, None], torch.ones(n, dtype=torch.long), [SamplingParams()] * n, g,
                                 q=q[:, None])
    assert abs(accepted.float().mean() - 0.7) < 0.005
    assert torch.allclose(torch.bincount(tokens[:, 0], minlength=3).float() / n, torch.tensor([0.5, 0.3, 0.2]),
                          atol=0.005)
    token, q = propose(q_logits[:1], [SamplingParams(temperature=0)], g)
    assert token.tolist() == [1] and q.tolist() == [[0.0, 1.0, 0.0]]
