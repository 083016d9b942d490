"""Compiling Triton kernels for sm_90 on a machine without a GPU: Triton's NVIDIA back end and
ptxas need none, and they reject what the interpreter accepts (non-constexpr globals, operand
shapes tl.dot refuses, ...). Unit strides are constants, as Triton specialises them at
launch; other integers and pointers are taken as 16-aligned. The compiles run in a fresh
process, without the interpreter the kernel tests set."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


def compile_for_hopper(fn, pointers: dict[str, str], constants: dict, unit_strides: set[str],
                       num_warps: int = 4, num_stages: int | None = None) -> None:
    """Compile `fn` with these pointer types and constexprs (and `unit_strides` set to 1)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = dict(constants, **{n: 1 for n in unit_strides if n in fn.arg_names})
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        signature[name] = "constexpr" if name in constants else pointers.get(name, "i32")
        if name not in constants:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    source = ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def assert_script_compiles(script: str) -> None:
    """Run `script` (which calls `compile_for_hopper` and prints "compiled") in a fresh
    process; skip where Triton's NVIDIA back end is not installed."""
    pytest.importorskip("triton")
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("Triton's NVIDIA back end is not installed")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
