import torch


def test_serialized_views_carry_only_their_own_elements():
    import base64

    from rlx.transport.wire import deserialize_named_tensors, serialize_named_tensors

    buffer = torch.arange(1_000_000, dtype=torch.float32)  # like megatron's one buffer for all parameters
    view = buffer[10:20]
    payload = serialize_named_tensors([("w", view)])
    assert len(base64.b64decode(payload)) < 10_000  # not the 4 MB storage behind the view
    (name, t), = deserialize_named_tensors(payload)
    assert name == "w" and t.tolist() == view.tolist()
