"""Weight-only INT4 (`rlx.models.int4`) against values computed by hand, and its quantisation-aware training's
straight-through gradient (`rlx.train.qat`)."""

import torch

from rlx.models import int4


def test_groups_scales_and_levels_by_hand():
    # one row of 130 columns: a group of 128 (largest magnitude 7.0: scale 1) and a ragged one of 2 (0.35: scale 0.05)
    w = torch.zeros(1, 130)
    w[0, :4] = torch.tensor([7.0, -3.4, 2.5, -7.0])
    w[0, 128:] = torch.tensor([0.35, -0.1])
    scale = int4.scales(w)
    assert torch.allclose(scale, torch.tensor([[1.0, 0.05]]))
    q = int4.levels(w, scale)
    assert q[0, :4].tolist() == [7, -3, 2, -7] and q[0, 128:].tolist() == [7, -2]  # round half to even: 2.5 -> 2
    assert torch.equal(int4.fake_quantize(w), q * scale.repeat_interleave(128, 1)[:, :130])
    zero = torch.zeros(2, 3)
    assert torch.equal(int4.scales(zero), torch.ones(2, 1)) and torch.equal(int4.fake_quantize(zero), zero)


def test_packing_is_two_values_a_byte_and_round_trips():
    w = torch.randn(5, 257, generator=torch.Generator().manual_seed(0))
    packed, scale = int4.quantize(w)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 129) and scale.shape == (5, 3)
    q = int4.levels(w, scale)
    assert int(packed[0, 0]) == (int(q[0, 0]) + 8) | ((int(q[0, 1]) + 8) << 4)  # even column in the low nibble
    assert torch.equal(int4.dequantize(packed, scale, 257), int4.fake_quantize(w))
    assert (int4.fake_quantize(w) - w).abs().max() <= scale.max() / 2 + 1e-6


def test_quantised_stream_names_and_bytes():
    named = [("model.layers.0.mlp.up_proj.weight", torch.randn(4, 256)), ("model.norm.weight", torch.ones(4)),
             ("model.embed_tokens.weight", torch.randn(8, 4))]
    out = dict(int4.quantized(iter(named)))
    assert list(out) == ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale",
                         "model.norm.weight", "model.embed_tokens.weight"]
    assert out["model.layers.0.mlp.up_proj.weight"].numel() == 4 * 256 // 2  # a byte per two weights


def test_qat_forward_is_the_served_weight_and_its_gradient_passes_straight_through():
    from rlx.train.qat import _FakeQuantize

    w = torch.randn(3, 200, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(2))
    y = x @ _FakeQuantize.apply(w).T
    assert torch.equal(y, x @ int4.fake_quantize(w.detach()).T)
    g = torch.randn(2, 3, generator=torch.Generator().manual_seed(3))
    y.backward(g)
    assert torch.equal(w.grad, g.T @ x)  # as if the weight were used unquantised
