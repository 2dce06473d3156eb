"""Fast 16-bit matrix products on CPUs without native bf16/fp16 GEMM, for the CPU stand-in of a GPU step.

Why this module exists: PyTorch's CPU matrix products in bf16 and fp16 use oneDNN only where the CPU has the
instructions for them (AVX-512 BF16/FP16 or AMX, ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``); elsewhere
they fall back to a far slower path. Measured 2026-12-06 on a 2-core AMD EPYC with AVX2 only (torch 2.13): a
1024×256 by 256×1024 product takes 480 ms in bf16 against 5 ms in fp32, and a mixed-precision step of the
3-layer Llama test model spent 83 % of its time in ``aten::mm``, so the test suite ran twice as long as on a
CPU with those instructions.

Inside :func:`fast_half_gemm`, on such a CPU, ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` of 16-bit tensors compute
in fp32 and round once to the inputs' dtype, as a GPU's tensor cores accumulate in fp32. The kernels are registered
at the CPU dispatch key (``torch.library``), below autograd and below the tracker's dispatch mode: the tracker
sees the same op with an output of the same dtype, shape and size as the native kernel's, and the fp32 copies
inside the kernel are invisible to it, like a GPU GEMM's workspace. Other dtypes run the native kernels through
their ``out=`` overloads, so their values are unchanged. What a step holds, not its values to the last bit, is what
the measurement is about.

``torch`` is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

#: The products replaced (each has an ``out=`` overload, through which the other dtypes reach torch's own kernel).
_OPS = ("mm", "addmm", "bmm", "baddbmm")

_lock = threading.Lock()
_users = 0
_library: Any = None


def slow_half_dtypes() -> tuple[Any, ...]:
    """The 16-bit dtypes this CPU multiplies without native instructions (oneDNN's own test)."""
    import torch

    mkldnn = torch.ops.mkldnn
    onednn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    slow = []
    if not (onednn and mkldnn._is_mkldnn_bf16_supported()):
        slow.append(torch.bfloat16)
    if not (onednn and mkldnn._is_mkldnn_fp16_supported()):
        slow.append(torch.float16)
    return tuple(slow)


def _kernel(name: str, half: tuple[Any, ...]) -> Callable[..., Any]:
    """The CPU kernel of ``aten::<name>``: fp32 arithmetic for the ``half`` dtypes, the native ``out=`` kernel
    otherwise."""
    import torch

    out_op = getattr(torch.ops.aten, name).out

    def run(*args: Any, **kwargs: Any) -> Any:
        dtype = args[0].dtype
        if dtype in half and all(a.dtype == dtype for a in args if isinstance(a, torch.Tensor)):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            out = torch.empty(0, dtype=torch.float32)
            out_op(*wide, **kwargs, out=out)
            return out.to(dtype)
        out = torch.empty(0, dtype=dtype)
        return out_op(*args, **kwargs, out=out)

    return run


@contextlib.contextmanager
def fast_half_gemm() -> Iterator[None]:
    """While inside, 16-bit matrix products on the CPU run in fp32 where the CPU lacks native 16-bit GEMM (nothing
    changes on a CPU that has it). Nested and concurrent uses share one registration, removed by the last to leave."""
    global _users, _library
    import torch

    with _lock:
        if _users == 0:
            half = slow_half_dtypes()
            if half:
                library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
                with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point
                    warnings.simplefilter("ignore", UserWarning)
                    for name in _OPS:
                        library.impl(name, _kernel(name, half), "CPU")  # type: ignore[no-untyped-call]
                _library = library
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _library is not None:
                _library._destroy()
                _library = None
