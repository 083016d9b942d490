"""`make serve` installs what serving needs and no more; `make test` adds the test extras (and
Ray and NIXL, for the tests of the Ray executor backend and the NIXL connector)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def planned_commands(target: str, venv: Path) -> str:
    """What `make` would run for `target` in a fresh clone (dry run, nothing executed)."""
    return subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=REPO_ROOT, check=True,
                          capture_output=True, text=True).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_serve_installs_no_test_extras(tmp_path):
    serve = planned_commands("serve", tmp_path / "venv")
    assert "pip install -q -e ." in serve and "[test" not in serve
    assert "muse serve" in serve
    test = planned_commands("test", tmp_path / "venv")
    assert "-e '.[test,ray,nixl]'" in test and "pytest" in test
