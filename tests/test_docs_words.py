"""The docs speak to users: no words about how the project is worked on (issue numbers, who was lent what,
other engineers, sessions), in the README or any page under docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INTERNAL = re.compile(r"\bissues?[- ]#?\d+|\bnot lent\b|\blent (?:one|to)\b|\bengineers'|\bthis task\b|"
                      r"\bclosing note|\bthe CEO\b", re.IGNORECASE)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_internal_words(page: Path) -> None:
    hits = [f"{page.name}:{n}: {line.strip()}" for n, line in enumerate(page.read_text().splitlines(), 1)
            if INTERNAL.search(line)]
    assert not hits, "\n".join(hits)


def test_the_pattern_catches_what_it_should() -> None:
    for text in ("as issue 24 asked", "the issue-13 sections", "this task was not lent one", "other engineers' builds"):
        assert INTERNAL.search(text), text
    assert not INTERNAL.search("PyTorch's issue tracker; a lent machine; tasks per node")
