"""The ``matmul`` kernels: oneDNN in place of torch's CPU ``aten::mm``/``aten::addmm``, forward and backward, and
how ``model.kernels.matmul`` chooses between it and torch's own."""

import pytest
import torch

from rlx.builtins import matmul as K
from rlx.train import kernel_choice as TK
from rlx.errors import RLXError
from rlx.plugins import build_plugins
from rlx.train.kernel_choice import use_matmul


@pytest.fixture
def onednn(monkeypatch):
    """oneDNN installed for the test (torch's own back afterwards); counts the products it runs."""
    calls = []
    real = K._onednn_mm

    def counted(a, b, bias=None):
        calls.append((tuple(a.shape), tuple(b.shape), bias is not None))
        return real(a, b, bias)

    monkeypatch.setattr(K, "_onednn_mm", counted)
    TK.install_matmul(K.OneDNNMatmul())
    try:
        yield calls
    finally:
        TK.install_matmul(K.TorchMatmul())


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def test_a_linear_layer_runs_its_forward_and_both_backward_products_through_onednn_at_fp32_accuracy(onednn):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 200, 300, generator=g, requires_grad=True)  # [batch, sequence, in]: 800 rows
    w = torch.randn(400, 300, generator=g, requires_grad=True)
    b = torch.randn(400, generator=g, requires_grad=True)
    probe = torch.randn(4, 200, 400, generator=g)
    (torch.nn.functional.linear(x, w, b) * probe).sum().backward()
    # forward x @ w.t() + b (addmm with the bias), backward: d x = probe @ w, d w = probe.t() @ x (mm each); each
    # is 96M multiply-adds, large enough for oneDNN the first time
    assert sorted(onednn) == sorted([((800, 300), (300, 400), True), ((800, 400), (400, 300), False),
                                     ((400, 800), (800, 300), False)])
    xd, wd, bd, pd = (t.detach().double() for t in (x, w, b, probe))
    out = (xd.reshape(800, 300) @ wd.t() + bd).reshape(4, 200, 400)
    assert rel_err(torch.nn.functional.linear(x, w, b).detach(), out) < 1e-5
    assert rel_err(x.grad, pd @ wd) < 1e-5
    assert rel_err(w.grad, pd.reshape(800, 400).t() @ xd.reshape(800, 300)) < 1e-5
    assert rel_err(b.grad, pd.sum((0, 1))) < 1e-5


def test_small_products_and_other_dtypes_keep_torchs_kernel(onednn):
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    assert torch.equal(a @ b, torch.mm(a, b, out=torch.empty(16, 16)))  # 4k multiply-adds: torch's own
    big_a, big_b = torch.randn(512, 512, dtype=torch.float64), torch.randn(512, 512, dtype=torch.float64)
    assert torch.equal(big_a @ big_b, torch.mm(big_a, big_b, out=torch.empty(512, 512, dtype=torch.float64)))
    bias = torch.randn(512)  # beta != 1: torch's addmm
    assert torch.allclose(torch.addmm(bias, big_a.float(), big_b.float(), beta=0.5), 0.5 * bias + big_a.float()
                          @ big_b.float(), rtol=1e-5, atol=1e-3)
    assert len(onednn) == 1  # only the last product (fp32, 134M multiply-adds), and not its addmm


def test_a_mid_sized_product_goes_to_onednn_once_its_shape_repeats(onednn):
    """oneDNN builds a primitive per new shape (longer than a product of 4M multiply-adds takes): such a product
    (a decode step's, at one batch size) goes to torch's kernel until its shape has come 8 times."""
    K._seen.clear()
    a, b = torch.randn(64, 256), torch.randn(256, 256)  # 4.2M multiply-adds
    ref = a.double() @ b.double()
    for i in range(10):
        assert rel_err(a @ b, ref) < 1e-5
        assert len(onednn) == max(0, i + 1 - 8)
    torch.randn(65, 256) @ b  # another shape counts afresh
    assert len(onednn) == 2


def test_matmul_torch_puts_torchs_own_kernel_back():
    a, b = torch.randn(300, 200), torch.randn(200, 100)
    before = a @ b
    TK.install_matmul(K.OneDNNMatmul())
    try:
        assert TK._installed["kernel"].name == "matmul-onednn"
    finally:
        TK.install_matmul(K.TorchMatmul())
    assert TK._installed["kernel"].name == "matmul-torch"
    assert torch.equal(a @ b, before)


def test_auto_takes_onednn_only_where_it_measures_faster(monkeypatch, capsys):
    plugins = build_plugins()
    try:
        monkeypatch.setattr(K, "onednn_speedup", lambda hidden: (200.0, 450.0))
        assert use_matmul(plugins, "auto", "cpu", torch.float32).name == "matmul-onednn"
        monkeypatch.setattr(K, "onednn_speedup", lambda hidden: (300.0, 330.0))
        assert use_matmul(plugins, "auto", "cpu", torch.float32, hidden=576).name == "matmul-torch"
        assert ("not 1.3x faster than torch's own on this CPU for a layer 576 wide (330 against 300 GFLOP/s)"
                in capsys.readouterr().err)
        assert TK._installed["kernel"].name == "matmul-torch"
        # chosen by name: taken as chosen, nothing measured
        monkeypatch.setattr(K, "onednn_speedup", lambda hidden: pytest.fail("measured a kernel chosen by name"))
        assert use_matmul(plugins, "onednn", "cpu", torch.float32).name == "matmul-onednn"
        # GPU and bf16 models keep torch's own; a name that cannot run is an error, or gives way in an engine
        assert use_matmul(plugins, "auto", "cuda:0", torch.bfloat16).name == "matmul-torch"
        with pytest.raises(RLXError, match=r"model.kernels.matmul: 'onednn' cannot run here: runs on CPU"):
            use_matmul(plugins, "onednn", "cuda:0", torch.bfloat16)
        assert use_matmul(plugins, "onednn", "cpu", torch.bfloat16, fallback=True).name == "matmul-torch"
        assert "this process uses auto" in capsys.readouterr().err
    finally:
        TK.install_matmul(K.TorchMatmul())


def test_an_unknown_matmul_kernel_is_a_config_error(tmp_path):
    from rlx.config import load_config
    from rlx.preflight import config_checks

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: builtin://tiny-qwen3\n  kernels:\n    matmul: mkl\n")
    with pytest.raises(RLXError, match=r"c.yaml:4: model.kernels.matmul: unknown matmul kernel 'mkl'; installed: "
                                       r"onednn, torch"):
        load_config(cfg, checks=config_checks(build_plugins()))


def test_auto_keeps_torchs_kernel_for_a_model_too_narrow_to_gain():
    """A layer 64 wide: ``[1024, 64] @ [64, 64]`` is under the size oneDNN takes before a shape repeats, so the
    replacement would run torch's own kernel behind its own dispatch, never faster (whatever the CPU)."""
    reason = K.OneDNNMatmul().supports(device="cpu", dtype=torch.float32, hidden=64)
    assert reason is not None and reason.startswith("not 1.3x faster than torch's own on this CPU for a layer 64 wide")
