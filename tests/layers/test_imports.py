"""The layers sit below the engine: importing them must not import `muse.engine`."""

from __future__ import annotations

import subprocess
import sys


def test_layers_do_not_import_the_engine() -> None:
    code = ("import sys, muse.layers.linear, muse.layers.embedding, muse.layers.fused_moe, "
            "muse.layers.quantization, muse.layers.lazy_slice; "
            "print(sorted(m for m in sys.modules if m.startswith('muse.engine')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
