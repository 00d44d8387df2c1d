"""Counts in words (ciuic.words): the messages say '1 snapshot' and '3 snapshots', never
'snapshot(s)' (issue 30), and no '(s)' comes back into a string of the source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ciuic.words import counted, listed

SRC = Path(__file__).resolve().parent.parent / "src"
#: a noun with its plural ending in parentheses: 'snapshot(s)', 'body(ies)', 'box(es)'
PLURAL = re.compile(r"\w+\((?:s|es|ies)\)")
#: (file under src/, what it may say): where '(s)' is right
ALLOWED = {
    ("ciuic/store/http.py", "http(s)"),  # an http or https URL
    ("ciuic/words.py", "chunk(s)"),  # its docstring says what it is for
}


def test_counted_and_listed_say_one_or_many() -> None:
    assert counted(1, "snapshot") == "1 snapshot"
    assert counted(0, "snapshot") == "0 snapshots"
    assert counted(2, "body", "bodies") == "2 bodies"
    assert listed([3], "rank") == "rank 3"
    assert listed([1, 3], "rank") == "ranks 1, 3"
    assert listed(list(range(12)), "step", most=10) == \
        "steps 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 2 more"


def test_no_string_in_the_source_says_a_plural_in_parentheses() -> None:
    """Every string constant of src/ (messages, f-strings' text, help, docstrings): a count is
    known where a message is written, so is its word (ciuic.words.counted)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{name}:{node.lineno}: {m[0]}" for m in PLURAL.finditer(node.value)
                          if (name, m[0]) not in ALLOWED]
    assert not found, "\n".join(found)
