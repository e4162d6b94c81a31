import torch

from rlx.train.packing import pack, per_token
from rlx.types import Sample


def test_pack_layout_targets_and_block_diagonal_mask():
    a = Sample([1, 2], [3, 4], sample_id=10)
    b = Sample([5], [6, 7, 8], sample_id=11)
    p = pack([a, b])
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert p.targets.tolist() == [2, 3, 4, 0, 6, 7, 8, 0]
    # a's response 3,4 is predicted at positions 1,2; b's 6,7,8 at 4,5,6
    assert p.response_positions.tolist() == [1, 2, 4, 5, 6] and p.seq_index.tolist() == [0, 0, 1, 1, 1]
    assert p.targets[p.response_positions].tolist() == [3, 4, 6, 7, 8]
    assert p.attention_mask.blocks == [[4, 4]]
    allowed = ~p.attention_mask.dense()[0, 0]
    assert allowed[5].tolist() == [False, False, False, False, True, True, False, False]
    assert allowed[3].tolist() == [True, True, True, True, False, False, False, False]


def test_pack_into_short_rows_pads_and_reorders():
    a = Sample([1, 2], [3, 4, 5, 6], sample_id=0)  # 6 tokens
    b = Sample([7], [8, 9], sample_id=1)  # 3 tokens
    c = Sample([10], [11], sample_id=2)  # 2 tokens
    p = pack([c, a, b], row_tokens=6)
    # first-fit decreasing: row 0 = a (6), row 1 = c + b (5, in input order), padded to 6
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [10, 11, 7, 8, 9, 0]]
    assert [s.sample_id for s in p.samples] == [0, 2, 1]
    assert p.targets[p.response_positions].tolist() == [3, 4, 5, 6, 11, 8, 9]
    assert p.seq_index.tolist() == [0, 0, 0, 0, 1, 2, 2]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 2, 0]]  # each sample from 0, as alone
    assert p.attention_mask.blocks == [[6], [2, 3]] and p.pad_mask.tolist()[1] == [False] * 5 + [True]
    row1 = ~p.attention_mask.dense()[1, 0]
    assert row1[1].tolist() == [True, True, False, False, False, False]  # c sees only itself
    assert row1[4].tolist() == [False, False, True, True, True, False]  # b sees only itself
    assert row1[5].tolist() == [False] * 5 + [True]  # the pad token sees only itself


def test_per_token_broadcasts_scalars_and_keeps_lists():
    a, b = Sample([1], [2, 3], sample_id=0), Sample([1], [4], sample_id=1)
    assert per_token([a, b], {0: 0.5, 1: -1.0}).tolist() == [0.5, 0.5, -1.0]
    assert per_token([a, b], {0: [0.1, 0.2], 1: [0.3]}).tolist() == [torch.tensor(0.1).item(), torch.tensor(0.2).item(), torch.tensor(0.3).item()]



def test_block_causal_attention_equals_sdpa_under_the_dense_mask_values_and_gradients():
    """Ragged rows, one-token samples, a padded tail: each block alone (causal, no mask tensor) gives what one
    masked attention over the row gives, forward and backward, pads included (grouped keys and the model
    around it: the logits and parallel-parity tests)."""
    import pytest
    import torch.nn.functional as F

    from rlx.train.masks import BlockCausal, block_causal_attention

    mask = BlockCausal([[5, 1, 3], [2, 4], [9]], width=9)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 9, 8, generator=g, requires_grad=True) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask.dense(), scale=0.3)
    w = torch.randn(want.shape, generator=g)
    wants = torch.autograd.grad((want * w).sum(), (q, k, v))
    # lengths 9 | 5 4 | 3 | 2 | 1: five batches of blocks, one of them two blocks padded to 5
    assert [tuple(g.shape) for g, _, _ in mask.buckets("cpu")] == [(1, 9), (2, 5), (1, 3), (1, 2), (1, 1)]
    for ratio_mask in (mask, BlockCausal(mask.blocks, 9)):
        if ratio_mask is not mask:  # every block in one batch, padded to 9
            cpu = torch.device("cpu")  # the key block_causal_attention looks up (q.device)
            ratio_mask._buckets[cpu] = ratio_mask.buckets(cpu, ratio=0.0)
            assert [tuple(g.shape) for g, _, _ in ratio_mask.buckets(cpu)] == [(6, 9)]
        got = block_causal_attention(q, k, v, ratio_mask, scale=0.3)
        assert torch.allclose(got, want, atol=1e-6)
        grads = torch.autograd.grad((got * w).sum(), (q, k, v))
        for a, b in zip(grads, wants, strict=True):
            assert torch.allclose(a, b, atol=1e-5)
    other = BlockCausal([[9], [6], [9]], 9)
    assert not torch.allclose(block_causal_attention(q, k, v, other, 0.3), want)
    full = BlockCausal([[4, 5], [9], [9]], 9)  # no padding column
    want_full = F.scaled_dot_product_attention(q, k, v, attn_mask=~full.dense(), scale=0.3)
    assert torch.allclose(block_causal_attention(q, k, v, full, 0.3), want_full, atol=1e-6)
    with pytest.raises(ValueError, match="row 1"):
        BlockCausal([[4], [5, 5]], width=9)
    with pytest.raises(ValueError, match="no tokens"):
        BlockCausal([[4, 0]], width=9)
    with pytest.raises(ValueError, match="3 rows x 8 positions for a mask of 3 rows x 9"):
        block_causal_attention(q[:, :, :8], k, v, mask, scale=0.3)


def test_rows_are_dealt_evenly_because_every_row_is_padded_to_the_longest():
    from rlx.train.packing import balanced_rows, micro_batches

    lengths = [7, 7, 4, 4, 4, 4]
    # first-fit decreasing in rows of 14: 7+7 | 4+4+4 | 4 -> 3 rows padded to 14 = 42 positions
    assert micro_batches(lengths, 14) == [[0, 1], [2, 3, 4], [5]]
    # dealt longest first to the emptiest of the 3 rows: 7+4 | 7+4 | 4+4 -> padded to 11 = 33 positions
    assert balanced_rows(lengths, 14) == [[0, 4], [1, 5], [2, 3]]
    # dealing would overfill a row (3+2+2 > 6): first-fit's rows
    assert balanced_rows([3, 3, 2, 2, 2], 6) == micro_batches([3, 3, 2, 2, 2], 6) == [[0, 1], [2, 3, 4]]
    # a sample longer than a row still gets a row of its own, and one row or none stays as it is
    assert balanced_rows([9, 2, 2], 4) == [[0], [1, 2]] and balanced_rows([3], 4) == [[0]] and balanced_rows([], 4) == []
    p = pack([Sample([1] * 3, [2] * 4, sample_id=i) for i in range(2)] +
             [Sample([1] * 2, [2] * 2, sample_id=2 + i) for i in range(4)], row_tokens=14)
    assert p.input_ids.shape == (3, 11) and p.attention_mask.blocks == [[7, 4], [7, 4], [4, 4]]

