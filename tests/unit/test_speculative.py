"""The embedded engine's speculative decoding: n-gram drafts and a draft model's, verified in the running batch, give
the tokens and log-probs of plain decoding (greedy: the same tokens; sampled: the same distribution), with fewer
forwards."""

import copy

import pytest
import torch

from rlx.rollout.engines.embedded.sampling import SamplingParams
from rlx.rollout.engines.embedded.scheduler import Scheduler
from rlx.rollout.engines.embedded.speculative import ngram_draft
from rlx.testing.runs import decode


def test_ngram_drafts_follow_the_latest_longest_match():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]  # [1, 2, 3] last seen before 7
    assert ngram_draft([4, 1, 2, 8, 8, 5, 2], 2) == [8, 8]  # only [2] occurs earlier
    assert ngram_draft([1, 2, 3, 1, 2], 5) == [3, 1, 2]  # as many as follow
    assert ngram_draft([1, 2, 3], 4) == [] and ngram_draft([7], 4) == []
    assert ngram_draft([5, 5, 5], 2) == [5]  # the latest match: the window before the tail's own


@pytest.fixture(scope="module")
def noisy(model):
    """A draft model: the target with noise on every weight, whose drafts pass about a quarter of the time."""
    d = copy.deepcopy(model[0])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.03)
    return d


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoTokenizer

    from rlx.models.load import load_lm

    m = load_lm(tiny_model_path, torch.float32).eval()
    with torch.no_grad():  # a sharper random model: few likely tokens, so that drafts pass and frequencies compare
        m.lm_head.weight.mul_(6.0)
    return m, AutoTokenizer.from_pretrained(tiny_model_path)


def generate(model, prompts, params, speculative, seed=0, draft=None):
    reqs, s, _ = decode(*model, prompts, params, speculative=speculative, seed=seed, max_running=64, draft=draft)
    return reqs, s


PROMPTS = [[5, 6, 7, 8] * 6, [9, 3] * 3 + [5, 6, 7], [11, 12, 13, 11, 12], [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40]]


@pytest.mark.parametrize("drafts", ["ngram", "draft model"])
def test_greedy_tokens_and_logprobs_are_plain_decodings(model, noisy, drafts):
    """Rows of several lengths, joining and leaving the batch: the same tokens as without drafts, and each token's
    log-prob that of a full forward over the finished sequence."""
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    plain, s0 = generate(model, PROMPTS * 3, params, 0)
    spec, s1 = generate(model, PROMPTS * 3, params, 4, draft=noisy if drafts == "draft model" else None)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert s1.spec_correct > 0 and s1.steps < s0.steps  # drafts were taken: fewer forwards
    for r in spec[:4]:
        ids = torch.tensor([r.input_ids + r.output_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model[0](ids).logits[0].float(), -1)
        want = lp[len(r.input_ids) - 1:-1].gather(1, ids[0, len(r.input_ids):, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-5)
        assert r.spec_verify_ct > 0 and 0 < r.spec_correct <= r.spec_proposed


def _chi2_critical(df, z=3.09):
    """The 0.999 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("drafts", ["ngram", "draft model"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 0.9)])
def test_sampled_tokens_have_plain_samplings_distribution(model, noisy, temperature, top_p, drafts):
    """1000 samples of 4 tokens from one repetitive prompt, with and without drafts: at each output position the
    two token counts pass a chi-square test of homogeneity at 0.999 (tokens seen under 5 times in both pooled),
    and drafts were taken; every log-prob is the target's at that temperature. (This checks the engine's wiring:
    positions, KV kept, per-row parameters. The acceptance rule's exactness has a sharper test on synthetic logits in
    test_sampling, which catches a rule off by as little as a square root.)"""
    greedy, _ = generate(model, [[5, 6, 7, 8] * 3], SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True),
                         0)
    prompt = greedy[0].input_ids + greedy[0].output_ids  # what the model says: its lookups draft what it may say
    # the logits scaled with the temperature: the same distributions at both, where drafts pass often but not always
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=4, ignore_eos=True)
    with torch.no_grad():
        model[0].lm_head.weight.mul_(temperature)
        noisy.lm_head.weight.mul_(temperature)
    try:
        plain, _ = generate(model, [prompt] * 1000, params, 0, seed=1)
        spec, s = generate(model, [prompt] * 1000, params, 3, seed=2, draft=noisy if drafts == "draft model" else None)
        r = spec[0]
        ids = torch.tensor([r.input_ids + r.output_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model[0](ids).logits[0].float() / temperature, -1)
        want = lp[len(r.input_ids) - 1:-1].gather(1, ids[0, len(r.input_ids):, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-5)
    finally:
        with torch.no_grad():
            model[0].lm_head.weight.div_(temperature)
            noisy.lm_head.weight.div_(temperature)
    assert 0.2 * s.spec_proposed < s.spec_correct < 0.95 * s.spec_proposed, (s.spec_correct, s.spec_proposed)
    for j in range(4):
        a = torch.bincount(torch.tensor([r.output_ids[j] for r in plain]), minlength=512).double()
        b = torch.bincount(torch.tensor([r.output_ids[j] for r in spec]), minlength=512).double()
        big = (a + b) >= 5
        a = torch.cat([a[big], a[~big].sum()[None]])
        b = torch.cat([b[big], b[~big].sum()[None]])
        keep = (a + b) > 0
        a, b = a[keep], b[keep]
        expected_a, expected_b = (a + b) * a.sum() / (a.sum() + b.sum()), (a + b) * b.sum() / (a.sum() + b.sum())
        chi2 = float(((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum())
        assert len(a) < 2 or chi2 < _chi2_critical(len(a) - 1), (j, chi2, len(a))


def test_a_model_with_linear_attention_is_refused(model):
    m, tok = model
    before = m.config.layer_types
    m.config.layer_types = ["linear_attention", "full_attention"]
    try:
        with pytest.raises(ValueError, match="linear-attention layers"):
            Scheduler(m, tok, speculative=2)
    finally:
        m.config.layer_types = before


def test_a_draft_model_equal_to_the_target_has_every_draft_taken(model):
    """With q = p every draft passes (min(1, p/q) = 1), at any temperature: the draft's KV is the target's, column for
    column, through prefill, forks (n samples of a prompt), merges and refused columns."""
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)
    same = copy.deepcopy(model[0])
    spec, s = generate(model, PROMPTS * 3 + [PROMPTS[0]] * 4, params, 3, draft=same)
    assert s.spec_proposed > 0 and s.spec_correct == s.spec_proposed
