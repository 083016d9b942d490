import os

import numpy as np
import torch

# TRITON_INTERPRET is set for CPU machines by tests/conftest.py, before anything imports triton.


def _patch_interpreter() -> None:
    """Three gaps of Triton 3.6's interpreter that compiled kernels do not have.

    * It holds scalars as 1-element arrays and makes loop bounds of them with int(array),
      which NumPy >= 2.4 refuses (triton-lang/triton#9171): `range(lo, hi)` with bounds
      computed in the kernel fails.
    * It stores bfloat16 as raw uint16 bits and `tl.dot` multiplies those bits
      (triton-lang/triton#11584); widen bfloat16 operands to float32 first, which is exact.
    * Its float -> FP8 E4M3 cast rounds half up and drops the carry into the exponent (124.4
      becomes 64, not 128); the GPU converts in hardware, rounding to nearest even with
      saturation. FP8 casts go through torch's, which rounds as the hardware does.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if getattr(interpreter, "_muse_patched", False):
        return
    interpreter._muse_patched = True

    patch_lang_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_lang_tensor is not None:
        def patched_lang_tensor(tensor, scope) -> None:
            patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

        interpreter._patch_lang_tensor = patched_lang_tensor

    builder = getattr(interpreter, "InterpreterBuilder", None)
    create_dot = getattr(builder, "create_dot", None)
    if create_dot is not None:
        def widen(handle):
            if handle.dtype != tl.bfloat16:
                return handle
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

        def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return create_dot(self, widen(a), widen(b), d, input_precision,
                              max_num_imprecise_acc)

        builder.create_dot = patched_dot

    create_fp_to_fp = getattr(builder, "create_fp_to_fp", None)
    if create_fp_to_fp is not None:
        # Each dtype as the interpreter holds it (bfloat16 as raw bits) and as torch names it.
        as_torch = {tl.float8e4nv: (torch.uint8, torch.float8_e4m3fn),
                    tl.bfloat16: (torch.uint16, torch.bfloat16),
                    tl.float16: (torch.float16, torch.float16),
                    tl.float32: (torch.float32, torch.float32)}

        def patched_fp_to_fp(self, src, dst_type, rounding_mode):
            source, target = src.dtype.scalar, dst_type.scalar
            if tl.float8e4nv not in (source, target) or not {source, target} <= as_torch.keys():
                return create_fp_to_fp(self, src, dst_type, rounding_mode)
            value = torch.from_numpy(np.ascontiguousarray(src.data)).view(as_torch[source][1])
            data = value.to(as_torch[target][1]).view(as_torch[target][0]).numpy()
            return interpreter.TensorHandle(data, target)

        builder.create_fp_to_fp = patched_fp_to_fp


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()
