"""Build every Triton kernel of dcomm for an H100 (sm_90) on a machine without a GPU.

CI has no GPU, so the kernels' arithmetic is tested on GPUs only; this catches, in CI, a kernel
that Triton can no longer build (a syntax or typing error, a changed Triton API) for each
combination of its compile-time arguments (int8/fp8, with and without the error memory). It
compiles to a cubin with the pinned Triton and exits 1, naming the kernel, on any failure.

Example::

    hatch run kernels:check
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["builds", "main"]

TARGET = ("cuda", 90, 32)  # H100 / H200
POINTERS = {"codes_ptr": "*u8", "received_ptr": "*u8", "row_ptr": "*u8"}  # others: float32
INTEGERS: dict[str, str] = {}  # every integer argument is int32


def _signature(kernel: Any, constants: dict[str, Any]) -> dict[str, str]:
    """Each argument's Triton type: the constants, float32/uint8 pointers, int32 sizes."""
    types = {}
    for name in kernel.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = POINTERS.get(name, "*fp32")
        else:
            types[name] = INTEGERS.get(name, "i32")
    return types


def builds() -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(label, kernel, compile-time arguments) for every variant the wrappers launch."""
    from dcomm.core import _quantization_kernels as kernels

    for fmt, limit in (("int8", 127.0), ("fp8", 448.0)):
        fp8 = fmt == "fp8"
        common = {"LIMIT": limit, "INV_LIMIT": 1.0 / limit, "BLOCK": 256, "GROUP": 8, "FP8": fp8}
        yield f"quantize {fmt}", kernels._quantize, common
        yield f"quantize_with_error {fmt}", kernels._quantize_with_error, common
        for error in (False, True):
            average = {**common, "INV_WORLD": 0.25, "ERROR": error}
            yield f"average_rows {fmt} error={error}", kernels._average_rows, average
        yield f"dequantize {fmt}", kernels._dequantize, {"BLOCK": 256, "GROUP": 8, "FP8": fp8}


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget(*TARGET)
    failed = 0
    for label, kernel, constants in builds():
        source = ASTSource(fn=kernel, signature=_signature(kernel, constants), constexprs=constants)
        try:
            triton.compile(source, target=target)
        except Exception as exc:  # every failure is reported, then the run fails
            failed += 1
            print(f"FAILED {label}: {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"built {label} for sm_{TARGET[1]} (triton {triton.__version__})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
