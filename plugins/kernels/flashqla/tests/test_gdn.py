"""The gated delta rule kernels: the chunked torch form against its token-by-token recurrence and against
transformers' own torch reference (forward and gradients), with grouped value heads, ragged lengths, initial and
final states, and packed sequences (each equal to running alone; without cu_seqlens they provably leak state).
Kernel selection: auto on CPU, a named kernel that cannot run is an error saying why, FlashQLA's device/dtype rules
decided without importing it. The GPU kernels against the torch one: the gdn check of scripts/gpu-check."""

import sys

import pytest
import torch

from rlx.testing import KernelContract
from rlx_kernel_flashqla.torch_gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule


def inputs(b, t, h, hv, dk, dv, seed=0, unit_keys=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=g)
    k = torch.randn(b, t, h, dk, generator=g)
    if unit_keys:  # the delta rule is stable for |k| = 1 (models normalise keys, in or before the kernel)
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(b, t, hv, dv, generator=g)
    decay = -torch.rand(b, t, hv, generator=g) * 0.7
    beta = torch.rand(b, t, hv, generator=g)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


def run(fn, xs, **kw):
    for x in xs:
        x.grad = None
    o, state = fn(*xs, output_final_state=True, **kw)
    weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(7))
    ((o * weights).sum() + state.sum()).backward()
    return o.detach(), state.detach(), [x.grad.clone() for x in xs]


def close(a, b, tol):
    o1, s1, g1 = a
    o2, s2, g2 = b
    assert (o1 - o2).abs().max() < tol and (s1 - s2).abs().max() < tol
    assert max((x - y).abs().max() for x, y in zip(g1, g2)) < 10 * tol


@pytest.mark.parametrize("t,chunk", [(37, 16), (64, 64), (5, 64), (130, 32)])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["mha", "grouped"])
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_equals_the_recurrence(t, chunk, heads, l2norm):
    xs = inputs(2, t, *heads, 8, 6, unit_keys=not l2norm)
    state = torch.randn(2, heads[1], 8, 6)
    kw = dict(initial_state=state, use_qk_l2norm_in_kernel=l2norm)
    close(run(lambda *a, **k: chunk_gated_delta_rule(*a, chunk_size=chunk, **k), xs, **kw),
          run(recurrent_gated_delta_rule, xs, **kw), 1e-5)


def test_equals_transformers_torch_reference():
    import importlib.util

    if importlib.util.find_spec("fla") is not None:  # transformers would call fla's kernels in its place
        pytest.skip("flash-linear-attention is installed: transformers' torch reference is replaced by it")
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    xs = inputs(2, 45, 2, 4, 16, 8, seed=3)
    kw = dict(initial_state=torch.randn(2, 4, 16, 8), use_qk_l2norm_in_kernel=True)
    ours = run(chunk_gated_delta_rule, xs, **kw)
    close(ours, run(torch_chunk_gated_delta_rule, xs, **kw), 1e-5)
    close(ours, run(torch_recurrent_gated_delta_rule, xs, **kw), 1e-5)


def test_a_custom_scale_and_half_precision_inputs():
    xs = inputs(1, 20, 2, 2, 8, 8, unit_keys=True)
    a = chunk_gated_delta_rule(*xs, scale=0.5, chunk_size=8)[0]
    b = recurrent_gated_delta_rule(*xs, scale=0.5)[0]
    assert (a - b).abs().max() < 1e-5
    half = chunk_gated_delta_rule(*(x.detach().to(torch.bfloat16) for x in xs), scale=0.5)[0]
    assert half.dtype == torch.bfloat16 and (half.float() - b).abs().max() < 0.05


def test_packed_sequences_equal_each_alone_and_leak_without_cu_seqlens():
    lengths = [5, 23, 1, 40, 0, 7]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    xs = inputs(1, sum(lengths), 2, 4, 8, 6, seed=5)
    states = torch.randn(len(lengths), 4, 8, 6)
    packed = run(lambda *a, **k: chunk_gated_delta_rule(*a, chunk_size=16, **k), xs, initial_state=states,
                 cu_seqlens=cu, use_qk_l2norm_in_kernel=True)

    def alone(*a, output_final_state=True):
        outs, finals = [], []
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            o, f = recurrent_gated_delta_rule(*(x[:, s:e] for x in a), initial_state=states[i:i + 1],
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, 1), torch.cat(finals)

    close(packed, run(alone, xs), 1e-5)
    with torch.no_grad():  # from zero states both ways: one long sequence carries state across the boundaries
        separate = chunk_gated_delta_rule(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]
        leaked = chunk_gated_delta_rule(*xs, use_qk_l2norm_in_kernel=True)[0]
    first = slice(0, lengths[0])  # the first sequence sees nothing before it either way
    assert torch.allclose(leaked[:, first], separate[:, first], atol=1e-6)
    assert (leaked - separate).abs().max() > 0.1


def test_no_tokens_and_a_wrong_state_shape():
    xs = inputs(1, 0, 1, 1, 4, 4)
    o, state = chunk_gated_delta_rule(*xs, output_final_state=True)
    assert o.shape == (1, 0, 1, 4) and state.shape == (1, 1, 4, 4) and not state.any()
    xs = inputs(1, 9, 1, 2, 4, 4)
    with pytest.raises(ValueError, match=r"initial_state has shape \(1, 2, 4, 4\), not \(2, 2, 4, 4\)"):
        chunk_gated_delta_rule(*xs, initial_state=torch.zeros(1, 2, 4, 4), cu_seqlens=torch.tensor([0, 4, 9]))


@pytest.mark.parametrize("cu,message", [([0, 3, 9], "batch size 1"), ([0, 5, 4, 9], "must rise"),
                                        ([0, 4, 8], "must rise")])
def test_bad_cu_seqlens_are_refused(cu, message):
    xs = inputs(2 if message == "batch size 1" else 1, 9, 1, 1, 4, 4)
    with pytest.raises(ValueError, match=message):
        chunk_gated_delta_rule(*xs, cu_seqlens=torch.tensor(cu))


# -- the kernel contract ---------------------------------------------------------------------------------------


class TestTorchKernelContract(KernelContract):
    kernel_name = "gdn-torch"

    def example(self):
        xs = [x.detach() for x in inputs(1, 40, 2, 4, 8, 8, unit_keys=True)]
        return xs, dict(cu_seqlens=torch.tensor([0, 15, 40]), output_final_state=True)

    def reference(self, *args, **kwargs):
        return recurrent_gated_delta_rule(*args, **kwargs)


class TestFlashQLAKernelContract(TestTorchKernelContract):
    kernel_name = "gdn-flashqla"
    queries = [{"device": "cuda", "dtype": torch.bfloat16}, {"device": "cpu", "dtype": torch.float32}]
    atol = 0.05

    def example(self):  # where it runs: a CUDA device, bf16 q/k/v
        args, kwargs = super().example()
        args = [x.cuda().to(torch.bfloat16) if x.dim() == 4 else x.cuda() for x in args]
        return args, {**kwargs, "cu_seqlens": kwargs["cu_seqlens"].cuda()}


class TestFlaKernelContract(TestFlashQLAKernelContract):
    kernel_name = "gdn-fla"


# -- selection -----------------------------------------------------------------------------------------------


def test_auto_on_cpu_is_torch_logged_once_and_imports_no_gpu_package(capsys):
    from rlx.plugins import build_plugins
    from rlx.train import kernel_choice as kernels

    kernels._logged.clear()
    plugins = build_plugins()
    assert [k.name for k in kernels.candidates(plugins, "gdn")] == ["gdn-flashqla", "gdn-fla", "gdn-torch"]
    for _ in range(2):
        assert kernels.select(plugins, "gdn", device="cpu", dtype=torch.float32).name == "gdn-torch"
    err = capsys.readouterr().err
    assert err.count("kernel for gdn: gdn-torch") == 1 and "flashqla: " in err
    assert not {"flash_qla", "tilelang", "fla", "triton"} & set(sys.modules)


def test_a_named_kernel_that_cannot_run_is_an_error_saying_why():
    from rlx.errors import RLXError
    from rlx.plugins import build_plugins
    from rlx.train.kernel_choice import select

    plugins = build_plugins()
    with pytest.raises(RLXError, match=r"model.kernels.gdn: 'flashqla' cannot run here: FlashQLA .* not installed"):
        select(plugins, "gdn", "flashqla", where="model.kernels", device="cpu", dtype=torch.float32)
    with pytest.raises(RLXError, match=r"unknown kernel 'triton'; installed: flashqla, fla, torch"):
        select(plugins, "gdn", "triton", device="cpu")
    with pytest.raises(RLXError, match="kernels.conv: no kernel for 'conv' is installed"):
        select(plugins, "conv", device="cpu")


@pytest.mark.parametrize("capability,dtype,reason", [
    ((8, 0), torch.bfloat16, "this GPU is 8.0"),
    ((9, 0), torch.float32, "runs bf16 or fp16"),
    ((9, 0), torch.bfloat16, None),
    ((12, 1), torch.float16, None),
])
def test_flashqla_decides_from_device_and_dtype_before_importing(monkeypatch, capability, dtype, reason):
    import rlx_kernel_flashqla as plugin

    monkeypatch.setattr(plugin, "_installed", lambda module: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    got = plugin.FlashQLAGDN().supports(device="cuda:0", dtype=dtype)
    assert got is None if reason is None else reason in got
    assert "on CUDA devices" in plugin.FlashQLAGDN().supports(device="cpu", dtype=dtype)
    assert "flash_qla" not in sys.modules
