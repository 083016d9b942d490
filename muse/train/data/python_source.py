"""Python source found on this machine: the standard library and permissively licensed
installed packages, split by file into train and held-out.

A file's key is its path relative to its root, prefixed with `stdlib/` or the distribution's
name, so the split of a file is the same on every machine that has it. What was found
depends on the machine's Python and packages; `manifest()` records it next to a run.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib.metadata
import platform
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muse.chat_format import BOS_ID, EOS_ID
from muse.tokenizer import MuseTokenizer
from muse.train.data.split import in_split

PERMISSIVE = ("MIT", "BSD", "APACHE", "PSF", "PYTHON SOFTWARE FOUNDATION", "ISC", "ZLIB")
# Any of these anywhere in the license metadata excludes the package, even next to a
# permissive name ("MPL-2.0 AND MIT"): only wholly permissive code is used.
RESTRICTIVE = ("GPL", "MPL", "MOZILLA", "EUPL", "CDDL", "EPL-", "PROPRIETARY", "COMMERCIAL")
MIN_FILE_BYTES = 64
MAX_FILE_BYTES = 256_000
# Longer average lines mean generated tables or minified code, not source people write.
MAX_MEAN_LINE_LENGTH = 160
PACKAGE_BYTE_CAP = 4_000_000
# All packages together; a machine with hundreds of them would otherwise spend its start-up
# reading source it never needs (a run of minutes trains on well under this).
PACKAGES_TOTAL_BYTE_CAP = 128_000_000
# Characters of text read per token wanted when cutting a chunk (code averages ~3.7).
CHARS_PER_TOKEN_MARGIN = 6


@dataclass(frozen=True)
class SourceFile:
    key: str
    path: Path


def license_text(distribution: importlib.metadata.Distribution) -> str:
    """The license a distribution declares: its SPDX expression, else its license
    classifiers, else the first line of its free-text License field."""
    metadata = distribution.metadata
    expression = metadata.get("License-Expression")
    if expression:
        return expression
    classifiers = [c for c in metadata.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    return (metadata.get("License") or "").strip().split("\n", 1)[0]


def is_permissive(license: str) -> bool:
    upper = license.upper()
    return any(name in upper for name in PERMISSIVE) and not any(
        name in upper for name in RESTRICTIVE)


def _stable_order(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()


def _usable(path: Path) -> bool:
    try:
        size = path.stat().st_size
    except OSError:
        return False
    return MIN_FILE_BYTES <= size <= MAX_FILE_BYTES


def stdlib_files() -> list[SourceFile]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if {"site-packages", "dist-packages"} & set(relative.parts) or not _usable(path):
            continue
        files.append(SourceFile(f"stdlib/{relative.as_posix()}", path))
    return sorted(files, key=lambda f: f.key)


def package_files(byte_cap: int = PACKAGE_BYTE_CAP, total_cap: int = PACKAGES_TOTAL_BYTE_CAP
                  ) -> tuple[list[SourceFile], list[dict]]:
    """Files of permissively licensed installed distributions, at most `byte_cap` bytes from
    each and `total_cap` from all, and a record of every distribution used. Files and
    distributions are taken in a hash order, so the caps keep a spread of modules rather
    than the alphabetically first."""
    files: list[SourceFile] = []
    used: list[dict[str, Any]] = []
    seen: set[str] = set()
    total = 0
    for distribution in sorted(importlib.metadata.distributions(), key=lambda d: _stable_order(
            (d.metadata.get("Name") or "").lower())):
        name = (distribution.metadata.get("Name") or "").lower()
        license = license_text(distribution)
        if not name or name in seen or not is_permissive(license) or total >= total_cap:
            continue
        seen.add(name)
        candidates = []
        for relative in distribution.files or []:
            if relative.suffix == ".py" and ".." not in relative.parts:
                path = Path(distribution.locate_file(relative))
                if _usable(path):
                    candidates.append(SourceFile(f"{name}/{relative.as_posix()}", path))
        taken, size = [], 0
        for file in sorted(candidates, key=lambda f: _stable_order(f.key)):
            file_size = file.path.stat().st_size
            if size + file_size > byte_cap:
                continue
            taken.append(file)
            size += file_size
        if taken:
            files.extend(taken)
            total += size
            used.append({"name": name, "version": distribution.version, "license": license,
                         "files": len(taken), "bytes": size})
    return sorted(files, key=lambda f: f.key), sorted(used, key=lambda p: p["name"])


def discover_files(include_packages: bool = True, package_byte_cap: int = PACKAGE_BYTE_CAP
                   ) -> tuple[list[SourceFile], list[dict]]:
    """The standard library's files, then (optionally) the packages' files, and the record
    of the packages used."""
    files = stdlib_files()
    if not include_packages:
        return files, []
    extra, packages = package_files(package_byte_cap)
    return files + extra, packages


def read_source(path: Path) -> str | None:
    """The file's text, or None when it is not UTF-8 or looks generated."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    lines = text.count("\n") + 1
    return text if len(text) / lines <= MAX_MEAN_LINE_LENGTH else None


class PythonCorpus:
    """The texts of one split, and random token chunks cut from them."""

    def __init__(self, files: list[SourceFile], split: str) -> None:
        self.keys: list[str] = []
        self.texts: list[str] = []
        for file in files:
            if not in_split(file.key, split):
                continue
            text = read_source(file.path)
            if text is not None:
                self.keys.append(file.key)
                self.texts.append(text)
        self.split = split
        self._ends = []
        total = 0
        for text in self.texts:
            total += len(text)
            self._ends.append(total)

    @classmethod
    def discover(cls, split: str, include_packages: bool = True,
                 package_byte_cap: int = PACKAGE_BYTE_CAP) -> tuple[PythonCorpus, dict]:
        """The corpus of `split` on this machine, and its manifest."""
        files, packages = discover_files(include_packages, package_byte_cap)
        corpus = cls(files, split)
        return corpus, corpus.manifest(packages)

    @property
    def num_chars(self) -> int:
        return self._ends[-1] if self._ends else 0

    def manifest(self, packages: list[dict]) -> dict[str, Any]:
        return {"split": self.split, "python": platform.python_version(),
                "stdlib": sysconfig.get_paths()["stdlib"], "files": len(self.texts),
                "chars": self.num_chars,
                "stdlib_files": sum(k.startswith("stdlib/") for k in self.keys),
                "packages": packages}

    def sample_tokens(self, rng: random.Random, count: int, tokenizer: MuseTokenizer
                      ) -> list[int]:
        """`count` tokens from a random place (files weighted by length), starting at a line
        boundary; a file's start gets `<|bos|>`, its end `<|eos|>`, and a chunk that runs off
        the end of one file continues at the start of another."""
        if not self.texts:
            raise ValueError("the Python corpus is empty: no usable source files were found")
        index = bisect.bisect_right(self._ends, rng.randrange(self.num_chars))
        text = self.texts[index]
        start = text.rfind("\n", 0, rng.randrange(len(text))) + 1
        tokens: list[int] = []
        while len(tokens) < count:
            if start == 0:
                tokens.append(BOS_ID)
            stop = start + (count - len(tokens)) * CHARS_PER_TOKEN_MARGIN
            tokens += tokenizer.encode(text[start:stop])
            if stop >= len(text):
                tokens.append(EOS_ID)
                text, start = self.texts[rng.randrange(len(self.texts))], 0
            else:
                start = stop
        return tokens[:count]
