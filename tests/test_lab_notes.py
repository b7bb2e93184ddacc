"""No lab notes in trainer/: issue numbers, commit ids and dates go stale where they stand.

A comment says why the code is as it is; the history of how it got there is in git, and a figure with
the machine and the day it was measured on belongs in bench/README.md, where it can be re-measured
beside the others. What this test looks for, in every file of the package (code, comments,
docstrings, YAML): ``issue 21`` (or ``issue #21``), ``commit 7c93630`` (an abbreviated id or longer),
and an ISO date such as ``2026-11-27``.

``NOT_YET_CLEANED`` names the files that still hold such notes, each to be cleaned and then removed
from it; a file listed there that no longer has any fails too, so the list only shrinks.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "trainer"
SUFFIXES = {".py", ".yaml", ".yml", ".md", ".txt"}

LAB_NOTE = re.compile(
    r"\b[Ii]ssue #?\d+"  # issue 21, Issue #41
    r"|\b[Cc]ommit [0-9a-f]{7,40}\b"  # commit 7c93630
    r"|\b20\d\d-\d\d-\d\d\b"  # 2026-11-27
)

# Files under trainer/ that still carry lab notes, as paths relative to the repository.
NOT_YET_CLEANED: set[str] = set()


def lab_notes(text: str) -> list[tuple[int, str]]:
    """``(line number, the note)`` for each lab note in ``text``."""
    return [
        (number, match.group(0))
        for number, line in enumerate(text.splitlines(), start=1)
        for match in LAB_NOTE.finditer(line)
    ]


def test_should_find_each_kind_of_lab_note_when_given_one_and_none_in_plain_prose():
    text = "x = 1  # issue 21: bold looks like a box\nCommit 7c93630 took 25:21\n(2026-11-27, after\nok\n"
    assert lab_notes(text) == [(1, "issue 21"), (2, "Commit 7c93630"), (3, "2026-11-27")]
    assert lab_notes("issues its all-gather; commit the checkpoint; 1.33.2-gke.4655000; 0x40000000") == []


def test_should_find_no_lab_note_in_trainer_when_outside_the_files_not_yet_cleaned():
    found: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix in SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
            notes = lab_notes(path.read_text(encoding="utf-8"))
            if notes:
                found[path.relative_to(REPO).as_posix()] = notes

    new = {name: notes for name, notes in found.items() if name not in NOT_YET_CLEANED}
    assert not new, "lab notes in trainer/ (say why in the comment; history in git, figures in " + (
        "bench/README.md): "
        + "; ".join(f"{name}:{n} {note!r}" for name, notes in new.items() for n, note in notes)
    )
    cleaned = sorted(NOT_YET_CLEANED - set(found))
    assert not cleaned, (
        f"no lab notes left in {', '.join(cleaned)}: remove it from NOT_YET_CLEANED in {__file__}"
    )
