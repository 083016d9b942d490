"""Finding Python source: licenses, the standard library, and the split by file."""

from __future__ import annotations

import pytest

from muse.train.data.python_source import is_permissive, read_source, stdlib_files
from muse.train.data.split import is_held_out


@pytest.mark.parametrize("license, allowed", [
    ("MIT", True), ("BSD-3-Clause", True), ("Apache-2.0", True), ("PSF-2.0", True),
    ("License :: OSI Approved :: BSD License", True), ("MIT OR Apache-2.0", True),
    ("GPL-3.0-or-later", False), ("LGPL-2.1", False), ("MPL-2.0 AND MIT", False),
    ("", False), ("Proprietary", False)])
def test_only_wholly_permissive_licenses_are_used(license: str, allowed: bool) -> None:
    assert is_permissive(license) == allowed


def test_stdlib_is_found_and_split_by_file() -> None:
    files = stdlib_files()
    assert len(files) > 200
    assert all(f.key.startswith("stdlib/") for f in files)
    assert any(f.key == "stdlib/json/decoder.py" for f in files)
    held_out = sum(is_held_out(f.key) for f in files) / len(files)
    assert 0.02 < held_out < 0.09


def test_read_source_skips_generated_looking_files(tmp_path) -> None:
    normal = tmp_path / "normal.py"
    normal.write_text("x = 1\n" * 50)
    wide = tmp_path / "table.py"
    wide.write_text("DATA = [" + "1, " * 2000 + "]\n")
    assert read_source(normal) == "x = 1\n" * 50
    assert read_source(wide) is None
