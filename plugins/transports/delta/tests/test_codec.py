"""The delta encodings: exact round trips, the smaller encoding chosen, corrupt data refused."""

import numpy as np
import pytest
import torch
import zstandard
from rlx_transport_delta import codec
from rlx_transport_delta.codec import DeltaError


def raw(t):
    return codec.to_bytes(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_changes_travel_in_the_smaller_encoding_and_round_trip_exactly(dtype):
    old = torch.randn(10_000).to(dtype)
    new = old.clone()
    new[[3, 4000, 9999]] += 1.0
    encoding, blob = codec.encode(raw(new), raw(old), new.element_size())
    assert len(blob) < 200  # of 10_000 elements, three changed
    z = zstandard.ZstdCompressor(level=3)
    xor = z.compress(np.bitwise_xor(raw(new), raw(old)).tobytes())
    idx = np.array([3, 4000, 9999])
    elems = raw(new).reshape(-1, new.element_size())
    sparse = z.compress(np.uint64(3).tobytes() + np.diff(idx, prepend=0).astype(np.uint32).tobytes()
                        + elems[idx].tobytes())
    assert (encoding, blob) == (("sparse", sparse) if len(sparse) < len(xor) else ("xor", xor))
    out = codec.decode(encoding, blob, raw(old), raw(new).size, new.element_size())
    assert np.array_equal(out, raw(new))
    assert torch.equal(codec.from_bytes(out, str(dtype).removeprefix("torch."), [10_000]), new)


def test_the_sparse_layout_by_hand():
    old = np.zeros(8, np.uint8)  # four 2-byte elements
    new = old.copy()
    new[2:4] = [7, 8]  # element 1
    new[6:8] = [9, 1]  # element 3
    encoding, blob = codec.encode(new, old, 2)
    body = zstandard.ZstdDecompressor().decompress(blob)
    if encoding == "sparse":  # count, gaps between positions, then the new elements
        assert body == np.uint64(2).tobytes() + np.array([1, 2], np.uint32).tobytes() + bytes([7, 8, 9, 1])
    else:
        assert body == np.bitwise_xor(new, old).tobytes()


def test_dense_changes_travel_as_xor():
    old = torch.randn(4096)
    new = old + 1e-3  # every element changes a little: XOR leaves the sign and exponent bytes at zero
    encoding, blob = codec.encode(raw(new), raw(old), 4)
    assert encoding == "xor"
    assert np.array_equal(codec.decode(encoding, blob, raw(old), raw(new).size, 4), raw(new))


def test_no_base_is_a_full_encoding_and_no_change_is_tiny():
    t = torch.randn(1000)
    encoding, blob = codec.encode(raw(t), None, 4)
    assert encoding == "full" and np.array_equal(codec.decode("full", blob, None, raw(t).size, 4), raw(t))
    encoding, blob = codec.encode(raw(t), raw(t), 4)
    assert len(blob) < 64 and np.array_equal(codec.decode(encoding, blob, raw(t), raw(t).size, 4), raw(t))


def test_bad_input_is_refused():
    old, new = torch.zeros(100), torch.ones(100)
    encoding, blob = codec.encode(raw(new), raw(old), 4)
    with pytest.raises(DeltaError, match="corrupt data"):
        codec.decode(encoding, blob[:-3] + b"xyz", raw(old), 400, 4)
    with pytest.raises(DeltaError, match="needs the base"):
        codec.decode(encoding, blob, None, 400, 4)
    with pytest.raises(DeltaError, match="changed size"):
        codec.encode(raw(torch.zeros(3)), raw(old), 4)
    with pytest.raises(DeltaError, match="unknown encoding"):
        codec.decode("rle", blob, raw(old), 400, 4)


def test_a_folder_appears_complete_or_not_at_all(tmp_path):
    tmp = tmp_path / (codec.folder_name(3) + ".tmp")
    tmp.mkdir()
    (tmp / "t.zst").write_bytes(b"x")
    assert codec.published(tmp_path) == {}
    codec.finish_folder(tmp, tmp_path / codec.folder_name(3), {"format": codec.FORMAT, "version": 3})
    assert list(codec.published(tmp_path)) == [3] and not tmp.exists()
    assert codec.read_manifest(tmp_path / "weight_v000003")["version"] == 3
    with pytest.raises(DeltaError, match="no manifest.json"):
        codec.read_manifest(tmp_path / "weight_v000004")


def test_a_sparse_delta_built_by_hand_decodes():
    old = np.arange(8, dtype=np.uint8)  # four 2-byte elements
    body = np.uint64(2).tobytes() + np.array([1, 2], np.uint32).tobytes() + bytes([70, 80, 90, 10])
    blob = zstandard.ZstdCompressor().compress(body)
    out = codec.decode("sparse", blob, old, 8, 2)
    assert out.tolist() == [0, 1, 70, 80, 4, 5, 90, 10]  # elements 1 and 3 replaced
    bad = zstandard.ZstdCompressor().compress(np.uint64(1).tobytes() + np.array([9], np.uint32).tobytes()
                                              + bytes([1, 2]))
    with pytest.raises(DeltaError, match="past the tensor"):
        codec.decode("sparse", bad, old, 8, 2)
