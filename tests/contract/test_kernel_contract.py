"""The kernel contract suite, on a small kernel registered by a test plugin: it passes for a correct
kernel, and fails for one whose output is wrong or whose `supports` raises."""

import types

import pytest
import torch

from rlx import hookimpl
from rlx.testing import KernelContract


class RMSNorm:
    """A fused-looking RMSNorm: the kind of op a kernels plugin provides (here plain torch)."""

    name = "test-rmsnorm"
    op = "rmsnorm"

    def supports(self, device="cpu", dtype="float32", **shape):
        if device != "cpu":
            return f"runs on CPU only, not {device}"
        return None if dtype in ("float32", "bfloat16") else f"no {dtype} version"

    def __call__(self, x, weight, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class OffByOne(RMSNorm):
    name = "test-rmsnorm-wrong"

    def __call__(self, x, weight, eps=1e-6):
        return super().__call__(x, weight, eps) + 1e-3


class Raising(RMSNorm):
    name = "test-rmsnorm-raising"

    def supports(self, device="cpu", dtype="float32", **shape):
        raise ImportError("no triton here")


plugin = types.ModuleType("test_kernels")
plugin.register_kernels = hookimpl(lambda register: [register(c) for c in (RMSNorm, OffByOne, Raising)])


class TestRMSNormKernel(KernelContract):
    kernel_name = "test-rmsnorm"
    plugin = plugin
    queries = [{"device": "cpu", "dtype": "float32"}, {"device": "cuda", "dtype": "bfloat16"},
               {"device": "cpu", "dtype": "float16"}]

    def example(self):
        g = torch.Generator().manual_seed(0)
        return (torch.randn(3, 8, generator=g), torch.rand(8, generator=g)), {}

    def reference(self, x, weight, eps=1e-6):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def test_the_suite_fails_a_wrong_kernel_and_a_raising_supports():
    wrong = type("W", (TestRMSNormKernel,), {"kernel_name": "test-rmsnorm-wrong"})()
    with pytest.raises(AssertionError, match="max difference"):
        wrong.test_matches_reference_where_supported()
    raising = type("R", (TestRMSNormKernel,), {"kernel_name": "test-rmsnorm-raising"})()
    with pytest.raises(ImportError):
        raising.test_supports_answers_without_raising()
