import torch


def test_serialized_views_carry_only_their_own_elements():
    import base64

    from rlx.transport.payloads import deserialize_named_tensors, serialize_named_tensors

    buffer = torch.arange(1_000_000, dtype=torch.float32)  # like megatron's one buffer for all parameters
    view = buffer[10:20]
    payload = serialize_named_tensors([("w", view)])
    assert len(base64.b64decode(payload)) < 10_000  # not the 4 MB storage behind the view
    (name, t), = deserialize_named_tensors(payload)
    assert name == "w" and t.tolist() == view.tolist()


def test_fused_experts_are_served_under_their_checkpoint_names(tmp_path):
    """transformers 5 fuses a layer's experts in memory and saves them per expert: the engine takes and reports
    them per expert (as trainers push them), writing through to the fused tensors."""
    from rlx.rollout.engines.embedded.weights import (
        WeightError,
        checksums,
        load_from_disk,
        load_named,
        served_state,
    )
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                                               moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1, head_dim=8, num_experts=3,
                                               num_experts_per_tok=2))
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    state = served_state(model)
    assert set(state) == set(saved) and not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in state)
    assert all(torch.equal(state[n], t) for n, t in saved.items())
    new = torch.randn(8, 16)
    load_named(model, [("model.layers.0.mlp.experts.2.up_proj.weight", new)])
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj[2, 8:], new)  # [gate; up] per expert
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj[2, :8],
                       saved["model.layers.0.mlp.experts.2.gate_proj.weight"])
    assert "model.layers.0.mlp.experts.1.down_proj.weight" in checksums(model, None)["checksums"]
    assert load_from_disk(model, str(tmp_path)) == len(saved)  # a per-expert checkpoint loads back
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj[2, 8:],
                       saved["model.layers.0.mlp.experts.2.up_proj.weight"])
    try:
        load_named(model, [("model.layers.0.mlp.experts.3.up_proj.weight", new)])
    except WeightError as e:
        assert "unknown weight 'model.layers.0.mlp.experts.3.up_proj.weight'" in str(e)
    else:
        raise AssertionError("an expert the model lacks was accepted")


def test_shared_memory_payloads_carry_handles_and_read_back_exactly(tmp_path, monkeypatch):
    """Same-host pushes: the payload holds names and offsets only; the engine side reads the exact values (any
    dtype, views and non-contiguous tensors included), and the segment is reused, then removed."""
    import base64

    from rlx.transport import shm
    from rlx.transport.payloads import deserialize_named_tensors, serialize_named_tensors

    monkeypatch.setattr(shm, "shm_dir", lambda: tmp_path)
    buffer = torch.randn(300_000)
    named = [("a", buffer[5:1005].view(10, 100)), ("b", torch.randn(7, 3).t()),
             ("c", torch.randn(33).to(torch.bfloat16)), ("d", torch.arange(5, dtype=torch.int64))]
    seg = shm.Segment()
    payload = serialize_named_tensors(named, seg)
    assert len(base64.b64decode(payload)) < 2_000  # handles, not the 4 KB of 'a' (nor 1.2 MB of its storage)
    got = deserialize_named_tensors(payload)
    assert [n for n, _ in got] == ["a", "b", "c", "d"]
    for (_, want), (_, t) in zip(named, got, strict=True):
        assert t.dtype == want.dtype and torch.equal(t, want)
    first = seg.path
    serialize_named_tensors([("e", torch.ones(4))], seg)  # fits: the same file
    assert seg.path == first and list(tmp_path.iterdir()) == [first]
    serialize_named_tensors([("big", torch.zeros(1 << 19))], seg)  # 2 MB: a larger file replaces it
    assert seg.path != first and list(tmp_path.iterdir()) == [seg.path]
    seg.close()
    assert list(tmp_path.iterdir()) == []


def test_shared_memory_handles_are_checked(tmp_path, monkeypatch):
    """The engine opens only weight-sync segments in the shared-memory folder, in bounds, and says when the
    segment is not on its host; it opens no links or other special files; segments no live trainer holds are
    removed."""
    import base64
    import os
    import pickle

    import pytest

    from rlx.transport import shm
    from rlx.transport.payloads import WireError, deserialize_named_tensors

    monkeypatch.setattr(shm, "shm_dir", lambda: tmp_path)

    def payload(*handle):
        return base64.b64encode(pickle.dumps([("w", shm.SharedTensor(*handle))])).decode()

    with pytest.raises(WireError, match="not a weight-sync segment"):
        deserialize_named_tensors(payload("../../etc/passwd", 0, "float32", (1,)))
    with pytest.raises(WireError, match="not on this engine's host"):
        deserialize_named_tensors(payload(f"{shm.PREFIX}1-abcd", 0, "float32", (1,)))
    seg = shm.Segment()
    (_, h), = seg.pack([("w", torch.ones(4))])
    with pytest.raises(WireError, match="outside"):
        deserialize_named_tensors(payload(h.file, seg.size - 4, "float32", (2,)))
    with pytest.raises(WireError, match="unknown dtype"):
        deserialize_named_tensors(payload(h.file, 0, "Tensor", (1,)))
    fifo, link = f"{shm.PREFIX}7-aa", f"{shm.PREFIX}7-bb"
    os.mkfifo(tmp_path / fifo)
    (tmp_path / link).symlink_to("/etc/hostname")
    with pytest.raises(WireError, match="not a regular file"):  # and does not block on it
        deserialize_named_tensors(payload(fifo, 0, "float32", (1,)))
    with pytest.raises(WireError, match="links"):
        deserialize_named_tensors(payload(link, 0, "float32", (1,)))
    (tmp_path / fifo).unlink()
    (tmp_path / link).unlink()
    stale = tmp_path / f"{shm.PREFIX}{os.getpid() + 1}-0f"  # a file no live trainer holds a lock on
    stale.write_bytes(b"x")
    assert shm.remove_stale(tmp_path) == [stale] and seg.path.exists()  # ours is held
    seg.close()


def test_a_full_shared_memory_folder_is_a_clear_error(tmp_path, monkeypatch):
    import os

    import pytest
    from rlx.transport import shm

    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(shm.SharedMemoryError, match="--shm-size.*bucket_mb.*shared_memory: false"):
        shm.Segment(tmp_path).pack([("w", torch.ones(4))])
    assert list(tmp_path.iterdir()) == []


def test_an_fp8_engine_holds_what_it_is_pushed_and_computes_with_it_dequantised(tiny_model_path, tmp_path):
    """The embedded engine under ``--quantization fp8`` (`serve_quantized`): the FP8 checkpoint's quantised weights are held
    as stored and served by name; a push of a weight and its scales is held as sent and its parameter becomes their
    dequantised value; an unquantised push to a quantised weight, or the reverse, is refused."""
    import pytest

    from rlx.models.fp8 import BLOCK, SCALE, dequantize, quantize, write_quantized
    from rlx.models.load import load_lm
    from rlx.rollout.engines.embedded.weights import (WeightError, load_named, name_as_checkpoint, serve_quantized,
                                                      served_state)

    folder = write_quantized(tiny_model_path, tmp_path / "fp8")
    model = load_lm(folder, torch.float32)
    name_as_checkpoint(model, folder)
    serve_quantized(model, "fp8", folder)
    name = "model.layers.1.mlp.up_proj.weight"
    state = served_state(model)
    assert state[name].dtype == torch.float8_e4m3fn and state[name + SCALE].dtype == torch.float32
    param = dict(model.named_parameters())[name]
    assert torch.equal(param, dequantize(state[name], state[name + SCALE], BLOCK))
    w = torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale = quantize(w, BLOCK)
    load_named(model, [(name, q), (name + SCALE, scale)])
    assert torch.equal(served_state(model)[name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(param, dequantize(q, scale, BLOCK)) and 0 < (param - w).abs().max() < 0.01
    with pytest.raises(WeightError, match="served as torch.float8_e4m3fn, pushed as torch.float32"):
        load_named(model, [(name, w)])
    with pytest.raises(WeightError, match="served as torch.float32, pushed as torch.float8_e4m3fn"):
        load_named(model, [("model.embed_tokens.weight", state["model.embed_tokens.weight"].to(torch.float8_e4m3fn))])


class Fleet:
    """One engine, whose client records the adapters unloaded into `unloaded` (`Weights`' adapter tests)."""

    health = None
    weight_targets = [type("Engine", (), {"url": "http://e"})()]

    def __init__(self, unloaded: list[str]):
        self.unloaded = unloaded

    async def for_each(self, fn, engines=None):
        unloaded = self.unloaded

        class Client:
            async def unload_lora_adapter(self, name):
                unloaded.append(name)

        return [await fn(Client()) for _ in engines]


def test_after_each_adapter_push_requests_name_it_and_engines_unload_the_one_before_once_unused():
    """`Weights` with adapter pushes: each push loads an adapter of a new name, which requests name from then on; the
    one before is unloaded once no request in flight names it; a push that failed has its adapter unloaded too."""
    import asyncio

    from rlx.orchestrate.weights import Weights
    from rlx.rollout.context import ServedAdapter

    unloaded: list[str] = []
    pushed: list[tuple[int, str]] = []

    class Trainer:
        fail = False

        def setup_transport(self, urls, out):
            pass

        def push_weights(self, version, adapters=None, again=False):
            pushed.append((version, adapters[None]))
            if self.fail:
                raise RuntimeError("engine refused")
            return 100

    served = ServedAdapter(on=True)
    trainer = Trainer()
    weights = Weights(trainer, Fleet(unloaded), "out", adapters={None: served})  # type: ignore[arg-type]

    async def run():
        assert await weights.push(1) == 100 and served.version == 1
        first = served.name
        served.hold(first)  # a request in flight with it
        assert await weights.push(2) == 100 and served.name != first and served.version == 2
        await asyncio.sleep(0)
        assert unloaded == []  # still in use
        served.release(first)
        await asyncio.gather(*weights.unloads)
        assert unloaded == [first]
        trainer.fail = True
        try:
            await weights.push(3)
        except RuntimeError:
            pass
        await asyncio.gather(*weights.unloads)
        return first

    first = asyncio.run(run())
    assert [v for v, _ in pushed] == [1, 2, 3] and all(name.startswith(f"actor-v{v}-") for v, name in pushed)
    assert len({name for _, name in pushed}) == 3 and unloaded == [first, pushed[2][1]]
    assert served.version == 2  # the failed push changed nothing requests name


def test_a_multi_lora_push_sends_every_adapter_under_its_own_name_and_unloads_each_old_one_by_its_own_requests():
    """``train.lora.adapters``: one push sends each adapter of the version under a name of its own (``<name>-vN-<hex>``),
    which that adapter's requests name from then on; an adapter's older one is unloaded once its own requests are done,
    whatever the other adapter's requests hold."""
    import asyncio

    from rlx.orchestrate.weights import Weights
    from rlx.rollout.context import ServedAdapter

    unloaded: list[str] = []
    pushed: list[dict] = []

    class Trainer:
        def setup_transport(self, urls, out):
            pass

        def push_weights(self, version, adapters=None, again=False):
            pushed.append(dict(adapters))
            return 100

    add, sub = ServedAdapter(on=True), ServedAdapter(on=True)
    weights = Weights(Trainer(), Fleet(unloaded), "out", adapters={"add": add, "sub": sub})  # type: ignore[arg-type]

    async def run():
        await weights.push(1)
        old_add, old_sub = add.name, sub.name
        add.hold(old_add)  # a request of adapter add in flight
        await weights.push(2)
        done, waiting = await asyncio.wait(set(weights.unloads), return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == len(waiting) == 1 and unloaded == [old_sub]  # sub's old one: no request names it; add's is still in use
        add.release(old_add)
        await asyncio.gather(*weights.unloads)
        assert sorted(unloaded) == sorted([old_add, old_sub])

    asyncio.run(run())
    assert [sorted(p) for p in pushed] == [["add", "sub"]] * 2
    assert all(p[k].startswith(f"{k}-v{v}-") for v, p in enumerate(pushed, 1) for k in p)
    assert (add.name, sub.name) == (pushed[1]["add"], pushed[1]["sub"]) and add.version == sub.version == 2
