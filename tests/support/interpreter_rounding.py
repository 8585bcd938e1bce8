"""The Triton interpreter made to round fp32 -> bf16 casts like the GPU (and torch).

The interpreter's fp32 -> bf16 cast truncates where the GPU rounds to nearest even; the kernel
checks run in the interpreter (``tests/kernel_interpreter_*.py``) patch it with
:func:`round_casts_to_nearest_even` before launching anything. Importing this module changes
nothing.
"""

from __future__ import annotations

import torch


def round_casts_to_nearest_even() -> None:
    """Patch the interpreter's cast so fp32 -> bf16 rounds to nearest even."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            bits = x.view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_rne
