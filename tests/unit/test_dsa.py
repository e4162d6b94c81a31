"""DeepSeek sparse attention's indexer loss (`rlx.train.dsa.indexer_kl`, DeepSeek-V3.2's sparse stage) against values
computed by hand: KL from the attention's distribution over the kept keys to the indexer's softmax over them, a mean
over queries; keys not kept count for nothing however they score."""

import math

import torch

from rlx.train.dsa import indexer_kl


def test_the_indexer_kl_by_hand():
    keep = torch.tensor([[[True, False, False],
                          [True, True, False],
                          [True, False, True]]])
    # summed over heads: query 1 gives its two keys 3 : 1, query 2 gives keys 0 and 2 1 : 1 (key 1, not kept, 5)
    attention = torch.tensor([[[2.0, 0.0, 0.0],
                               [1.5, 0.5, 0.0],
                               [0.5, 5.0, 0.5]]])
    index = torch.tensor([[[7.0, 100.0, 100.0],
                           [0.0, math.log(3.0), 100.0],
                           [1.0, 100.0, 1.0]]])
    # query 0: one key, KL 0; query 1: p = (3/4, 1/4), q = (1/4, 3/4): KL = (3/4 - 1/4) ln 3; query 2: p = q, KL 0
    assert math.isclose(indexer_kl(index, attention, keep).item(), 0.5 * math.log(3.0) / 3, rel_tol=1e-6)


def test_it_is_zero_when_the_indexer_agrees_and_its_gradient_moves_scores_toward_the_attention():
    keep = torch.ones(2, 4, 4, dtype=torch.bool).tril()
    attention = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(0)).masked_fill(~keep, 0)
    agreeing = torch.log(attention.clamp_min(1e-30)).masked_fill(~keep, 0)
    assert indexer_kl(agreeing, attention, keep).item() < 1e-6
    index = torch.zeros(2, 4, 4, requires_grad=True)
    indexer_kl(index, attention, keep).backward()
    p = attention / attention.sum(-1, keepdim=True)
    # d/dq_j of KL(p || softmax(q)) over the kept keys is softmax(q)_j - p_j, over the queries' mean
    q = torch.softmax(torch.zeros(4, 4).masked_fill(~keep[0], float("-inf")), -1)
    assert torch.allclose(index.grad, ((q - p) / 8).masked_fill(~keep, 0), atol=1e-6)
