"""The fp32 stand-in for 16-bit matrix products on CPUs without native bf16/fp16 GEMM (``measure.half_gemm``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memcalc_gui.measure import half_gemm  # noqa: E402
from memcalc_gui.measure.tracker import LiveStorageTracker  # noqa: E402


@pytest.fixture
def slow_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behave as on a CPU without native bf16 GEMM, whatever this one has."""
    monkeypatch.setattr(half_gemm, "slow_half_dtypes", lambda: (torch.bfloat16, torch.float16))


def _products(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> list[torch.Tensor]:
    return [a @ b, torch.addmm(bias, a, b, beta=0.5, alpha=2.0), torch.bmm(a[None], b[None]),
            torch.baddbmm(bias[None, None], a[None], b[None], alpha=3.0)]


@pytest.mark.usefixtures("slow_bf16")
def test_half_products_are_fp32_arithmetic_rounded_once_and_others_unchanged() -> None:
    torch.manual_seed(0)
    a32, b32, bias32 = torch.randn(16, 8), torch.randn(8, 12), torch.randn(12)
    native32 = _products(a32, b32, bias32)
    a, b, bias = a32.bfloat16(), b32.bfloat16(), bias32.bfloat16()
    wide = _products(a.float(), b.float(), bias.float())
    with half_gemm.fast_half_gemm():
        fast = _products(a, b, bias)
        again32 = _products(a32, b32, bias32)
    for got, want in zip(fast, wide, strict=True):
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
        assert torch.equal(got, want.bfloat16())
    for got, want in zip(again32, native32, strict=True):
        assert torch.equal(got, want)  # fp32 runs the native kernel


@pytest.mark.usefixtures("slow_bf16")
def test_the_registration_is_shared_and_removed_by_the_last_user() -> None:
    a = torch.randn(4, 4).bfloat16()
    with half_gemm.fast_half_gemm():
        with half_gemm.fast_half_gemm():
            assert half_gemm._library is not None
        assert half_gemm._library is not None  # the outer user still holds it
        x = torch.randn(6, 4, requires_grad=True)
        (x.bfloat16() @ a).float().sum().backward()  # autograd runs above the replaced kernel
        assert x.grad is not None and x.grad.shape == (6, 4)
    assert half_gemm._library is None and half_gemm._users == 0


@pytest.mark.usefixtures("slow_bf16")
def test_the_tracker_sees_what_the_native_kernel_allocates() -> None:
    """The fp32 copies inside the kernel are not the step's memory: the tracker logs one bf16 output per product."""
    a, b = torch.randn(32, 16).bfloat16(), torch.randn(16, 24).bfloat16()

    def logged() -> list[tuple[str, int]]:
        tracker = LiveStorageTracker()
        with tracker:
            out = a @ b
            del out
        tracker.close()
        return [(e.op, e.delta) for e in tracker.events if e.kind == "alloc"]

    native = logged()
    with half_gemm.fast_half_gemm():
        fast = logged()
    assert fast == native == [("aten.mm.default", 32 * 24 * 2)]


def test_only_the_dtypes_this_cpu_lacks_are_replaced() -> None:
    slow = half_gemm.slow_half_dtypes()
    assert set(slow) <= {torch.bfloat16, torch.float16}
    assert (torch.bfloat16 in slow) == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())
