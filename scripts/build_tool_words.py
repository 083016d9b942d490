"""Write muse/assets/tool_words.txt: the everyday English words tool names are built from in
training (`muse.train.data.unseen_tools`), so that the model learns to copy names spelled with
any letters and any of the tokenizer's word pieces, not only made-up syllables.

The words are the most widespread lowercase words of the Python standard library's source
(identifiers split at underscores and case changes, comments and docstrings), 3 to 11 letters,
found in at least MIN_FILES files, minus every word the held-out evaluation uses in names.

    python scripts/build_tool_words.py [STDLIB_DIR]
"""

from __future__ import annotations

import re
import sys
import sysconfig
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse.train.data import unseen_tools  # noqa: E402
from muse.train.data.split import HELD_OUT, split_items  # noqa: E402

MIN_FILES = 12
MAX_WORDS = 3000
OUT = Path(__file__).resolve().parents[1] / "muse" / "assets" / "tool_words.txt"


def held_out_words() -> set[str]:
    lists = (unseen_tools.VERBS, unseen_tools.NOUNS, unseen_tools.QUALIFIERS,
             unseen_tools.ARGUMENT_WORDS)
    return {word for items in lists for word in split_items(items, HELD_OUT)}


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else sysconfig.get_paths()["stdlib"])
    files: Counter[str] = Counter()
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="ignore")
        text = re.sub(r"([a-z])([A-Z])", r"\1 \2", text).replace("_", " ")
        files.update({word for word in re.findall(r"\b[a-z]{3,11}\b", text)})
    excluded = held_out_words()
    common = [word for word, count in files.most_common()
              if count >= MIN_FILES and word not in excluded and re.search("[aeiou]", word)
              and not re.fullmatch("x[0-9a-f]+", word)]
    OUT.write_text("\n".join(sorted(common[:MAX_WORDS])) + "\n")
    print(f"{min(len(common), MAX_WORDS)} words -> {OUT}")


if __name__ == "__main__":
    main()
