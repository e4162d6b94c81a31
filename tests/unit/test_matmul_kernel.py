"""The ``matmul`` kernels: oneDNN in place of torch's CPU ``aten::mm``/``aten::addmm``, forward and backward, and
how ``model.kernels.matmul`` chooses between it and torch's own."""

import pytest
import torch

from rlx.builtins import kernels as K
from rlx.errors import RLXError
from rlx.plugins import build_plugins
from rlx.train.kernels import use_matmul


@pytest.fixture
def onednn(monkeypatch):
    """oneDNN installed for the test (torch's own back afterwards); counts the products it runs."""
    calls = []
    real = K._onednn_mm

    def counted(a, b, bias=None):
        calls.append((tuple(a.shape), tuple(b.shape), bias is not None))
        return real(a, b, bias)

    monkeypatch.setattr(K, "_onednn_mm", counted)
    K.install_matmul(K.OneDNNMatmul())
    try:
        yield calls
    finally:
        K.install_matmul(K.TorchMatmul())


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def test_a_linear_layer_runs_its_forward_and_both_backward_products_through_onednn_at_fp32_accuracy(onednn):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 100, 96, generator=g, requires_grad=True)  # [batch, sequence, in]: 400 rows
    w = torch.randn(160, 96, generator=g, requires_grad=True)
    b = torch.randn(160, generator=g, requires_grad=True)
    probe = torch.randn(4, 100, 160, generator=g)
    (torch.nn.functional.linear(x, w, b) * probe).sum().backward()
    # forward x @ w.t() + b (addmm with the bias), backward: d x = probe @ w, d w = probe.t() @ x (mm each)
    assert sorted(onednn) == sorted([((400, 96), (96, 160), True), ((400, 160), (160, 96), False),
                                     ((160, 400), (400, 96), False)])
    xd, wd, bd, pd = (t.detach().double() for t in (x, w, b, probe))
    out = (xd.reshape(400, 96) @ wd.t() + bd).reshape(4, 100, 160)
    assert rel_err(torch.nn.functional.linear(x, w, b).detach(), out) < 1e-5
    assert rel_err(x.grad, pd @ wd) < 1e-5
    assert rel_err(w.grad, pd.reshape(400, 160).t() @ xd.reshape(400, 96)) < 1e-5
    assert rel_err(b.grad, pd.sum((0, 1))) < 1e-5


def test_small_products_and_other_dtypes_keep_torchs_kernel(onednn):
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    assert torch.equal(a @ b, torch.mm(a, b, out=torch.empty(16, 16)))  # 4k multiply-adds: torch's own
    big_a, big_b = torch.randn(256, 256, dtype=torch.float64), torch.randn(256, 256, dtype=torch.float64)
    assert torch.equal(big_a @ big_b, torch.mm(big_a, big_b, out=torch.empty(256, 256, dtype=torch.float64)))
    bias = torch.randn(256)  # beta != 1: torch's addmm
    assert torch.allclose(torch.addmm(bias, big_a.float(), big_b.float(), beta=0.5), 0.5 * bias + big_a.float()
                          @ big_b.float(), rtol=1e-5, atol=1e-4)
    assert len(onednn) == 1  # only the last product (fp32, 16.7M multiply-adds), and not its addmm


def test_matmul_torch_puts_torchs_own_kernel_back():
    a, b = torch.randn(300, 200), torch.randn(200, 100)
    before = a @ b
    K.install_matmul(K.OneDNNMatmul())
    try:
        assert K.installed_matmul() == "matmul-onednn"
    finally:
        K.install_matmul(K.TorchMatmul())
    assert K.installed_matmul() == "matmul-torch"
    assert torch.equal(a @ b, before)


def test_auto_takes_onednn_only_where_it_measures_faster(monkeypatch, capsys):
    plugins = build_plugins()
    try:
        monkeypatch.setattr(K, "onednn_speedup", lambda: (200.0, 450.0))
        assert use_matmul(plugins, "auto", "cpu", torch.float32).name == "matmul-onednn"
        monkeypatch.setattr(K, "onednn_speedup", lambda: (300.0, 330.0))
        assert use_matmul(plugins, "auto", "cpu", torch.float32).name == "matmul-torch"
        assert "not 1.3x faster than torch's own on this CPU (330 against 300 GFLOP/s)" in capsys.readouterr().err
        assert K.installed_matmul() == "matmul-torch"
        # chosen by name: taken as chosen, nothing measured
        monkeypatch.setattr(K, "onednn_speedup", lambda: pytest.fail("measured a kernel chosen by name"))
        assert use_matmul(plugins, "onednn", "cpu", torch.float32).name == "matmul-onednn"
        # GPU and bf16 models keep torch's own; a name that cannot run is an error, or gives way in an engine
        assert use_matmul(plugins, "auto", "cuda:0", torch.bfloat16).name == "matmul-torch"
        with pytest.raises(RLXError, match=r"model.kernels.matmul: 'onednn' cannot run here: runs on CPU"):
            use_matmul(plugins, "onednn", "cuda:0", torch.bfloat16)
        assert use_matmul(plugins, "onednn", "cpu", torch.bfloat16, fallback=True).name == "matmul-torch"
        assert "this process uses auto" in capsys.readouterr().err
    finally:
        K.install_matmul(K.TorchMatmul())


def test_an_unknown_matmul_kernel_is_a_config_error(tmp_path):
    from rlx.config import load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: builtin://tiny-qwen3\n  kernels:\n    matmul: mkl\n")
    with pytest.raises(RLXError, match=r"c.yaml:4: model.kernels.matmul: unknown matmul kernel 'mkl'; installed: "
                                       r"onednn, torch"):
        load_config(cfg, plugins=build_plugins())
