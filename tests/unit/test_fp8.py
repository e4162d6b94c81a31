"""FP8 checkpoints (DeepSeek's block format): values by hand, ragged edge blocks, tensor-parallel slices that cut
through blocks, transformers' own dequantisation as the oracle, and re-quantising what was read giving the stored
bytes back."""

import json

import pytest
import torch
from safetensors.torch import save_file

from rlx.models.fp8 import SCALE, dequantize, quantize, quantized
from rlx.train.spec import HFCheckpoint


def test_scales_by_hand():
    """Blocks of 2 x 2 over a 3 x 5 weight: a 2 x 3 grid, ragged at the bottom and right. Each block's largest
    magnitude maps to e4m3's 448; an all-zero block keeps scale 1."""
    w = torch.tensor([[1.0, -2.0, 0.0, 0.0, 4.0],
                      [0.5, 0.0, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 8.0]])
    q, scale = quantize(w, (2, 2))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert torch.equal(scale, torch.tensor([[2 / 448, 1.0, 4 / 448], [1.0, 1.0, 8 / 448]]))
    assert q.float()[0].tolist() == [224.0, -448.0, 0.0, 0.0, 448.0] and q.float()[1, 0] == 112.0
    assert torch.equal(dequantize(q, scale, (2, 2)), w)  # every value here is exact in e4m3


def folder_with(tmp_path, tensors, block):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "x", "quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}))
    return HFCheckpoint(tmp_path)


@pytest.mark.parametrize("shape,block", [((8, 10), (3, 3)), ((128, 200), (128, 128)), ((6, 4), (4, 4))])
def test_slices_cut_through_blocks_and_read_the_whole_s_values(tmp_path, shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, scale = quantize(w, block)
    ckpt = folder_with(tmp_path, {"w.weight": q, "w.weight_scale_inv": scale}, block)
    whole = ckpt.get("w.weight")
    assert whole.dtype == torch.float32 and torch.equal(whole, dequantize(q, scale, block))
    assert (whole - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 mantissa bits
    for dim in (0, 1):
        parts = [ckpt.shard("w.weight", dim, r, 2) for r in range(2)]
        assert torch.equal(torch.cat(parts, dim), whole)


def test_requantising_what_was_read_gives_the_stored_bytes(tmp_path):
    """What export (``model.export_weights: fp8``) writes for a weight that did not change is what was stored."""
    w = torch.randn(130, 260, generator=torch.Generator().manual_seed(1)) * 3
    q, scale = quantize(w, (128, 128))
    ckpt = folder_with(tmp_path, {"w.weight": q, "w.weight_scale_inv": scale, "n.weight": torch.ones(4)}, (128, 128))
    named = [("w.weight", ckpt.get("w.weight")), ("n.weight", ckpt.get("n.weight"))]
    out = dict(quantized(named, ckpt.fp8_block, lambda n: n + SCALE in ckpt))
    assert set(out) == {"w.weight", "w.weight_scale_inv", "n.weight"}
    assert torch.equal(out["w.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out["w.weight_scale_inv"], scale) and torch.equal(out["n.weight"], torch.ones(4))


def test_transformers_reads_an_fp8_checkpoint_as_rlx_does(tiny_model_path, tmp_path):
    """transformers' FP8 loader (dequantising on a CPU) is the oracle: every weight it holds equals rlx's reading."""
    from transformers import AutoModelForCausalLM

    from rlx.models.fp8 import write_quantized

    folder = write_quantized(tiny_model_path, tmp_path / "fp8", (16, 16))
    ckpt = HFCheckpoint(folder)
    quantised = [n for n in ckpt.names() if n.endswith("_scale_inv")]
    assert len(quantised) >= 7 * 2  # every layer's q, k, v, o, gate, up and down projections
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = model.state_dict()
    for name in ckpt.names():
        if not name.endswith("_scale_inv"):
            assert torch.equal(ckpt.get(name), state[name]), name
