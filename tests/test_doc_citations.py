"""Every citation of a page's section in the tree (`docs/architecture.md, "Shared memory"`) names a section that page
has, so that code comments, docstrings, help texts and the docs themselves keep pointing somewhere true.

A section is a heading of the page, or the bold title that opens one of its paragraphs or bullets (the notebooks,
benchmarks.md, name their points so). A cited name matches a title equal to it, or one that goes on after it with
": ...", " (...)" or ", ..." (`"Fills"` names "Fills: the miss read by the process that needs it (issue 36)").
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = re.compile(r"\.(py|pyi|cpp|h|md|toml|txt)$")
SKIPPED = {"build", "dist", "venv", "node_modules", "__pycache__"}
# A page's name, optionally as a markdown link, then its section names in quotes: `docs/x.md, "A"`,
# `[x.md](x.md), "A", "B"`, `docs/x.md ("A")`, `x.md "A" and "B"`. The separator must not be empty, so that a
# page named at the end of a string ('... docs/x.md")') is not read as a citation of what follows.
CITATION = re.compile(r'(?<![\w/.-])(?:docs/)?(?P<page>[\w-]+\.md)(?:\]\((?:docs/)?[\w-]+\.md\))?\)?'
                      r'(?:,?\s+|\s*\()\(?(?P<names>"[^"\n]{1,100}"(?:\s*(?:,|and)\s*"[^"\n]{1,100}")*)')


def joined(text: str) -> str:
    """The text with its line breaks undone: adjacent string literals joined, escaped quotes plain, and each line
    break with the next line's indentation and comment marker (#, //, a lone *) read as one space."""
    text = re.sub(r'"\s*\n\s*[fbr]?"', "", text)
    text = text.replace('\\"', '"')
    return re.sub(r"[ \t]*\n[ \t]*(?:#+(?!#)|//|\*(?!\*))?[ \t]*", " ", text)


def source_files() -> list[Path]:
    """The checkout's source and documentation files: not build outputs, virtual environments or hidden folders."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in SKIPPED
                         and not d.endswith(".egg-info")]
        found += [Path(folder, f) for f in files if SOURCES.search(f)]
    return sorted(found)


def citations() -> list[tuple[str, str, str]]:
    """(file, page, section name) for every citation in the checkout's source and documentation files."""
    found = []
    for path in source_files():
        if path == Path(__file__).resolve():  # this file's examples of the spellings are not citations
            continue
        name = str(path.relative_to(ROOT))
        for match in CITATION.finditer(joined(path.read_text(errors="replace"))):
            found += [(name, match["page"], section) for section in re.findall(r'"([^"]+)"', match["names"])]
    return found


@functools.cache
def sections(page: Path) -> tuple[str, ...]:
    """A page's headings and the bold titles that open its paragraphs and bullets, without markdown's marks."""
    titles = []
    for line in page.read_text().splitlines():
        if heading := re.match(r"#+\s+(.*)", line):
            titles.append(heading[1])
        elif bold := re.match(r"\s*(?:[-*]\s+|\d+\.\s+)?\*\*(.+?)\*\*", line):
            titles.append(bold[1])
    return tuple(t.replace("`", "").strip() for t in titles)


def names_section(name: str, titles: tuple[str, ...]) -> bool:
    name = name.replace("`", "")
    return any(t == name or t.startswith((name + ":", name + " (", name + ",")) for t in titles)


def page_path(page: str) -> Path | None:
    for folder in ("docs", "."):
        if (ROOT / folder / page).is_file():
            return ROOT / folder / page
    return None


def test_every_cited_section_exists():
    wrong = []
    for name, page, section in citations():
        path = page_path(page)
        if path is None:  # a page outside the repository (the original DESIGN.md): nothing to check
            continue
        if not names_section(section, sections(path)):
            wrong.append(f'{name}: {page}, "{section}" is not a section of {path.relative_to(ROOT)}')
    assert not wrong, "\n".join(wrong)


def test_the_reader_finds_citations_in_every_spelling():
    """Guards the reader itself: each way the tree spells a citation, wrapped comments and split strings included."""
    text = joined('x = 1  # as docs/architecture.md, "Shared\n    # memory" says; [formats.md](formats.md),'
                  ' "Checksums" and "GGUF"\nhelp=("see (docs/decisions.md, \\"The "\n      f"tree\\")")\n'
                  'raise Error(f"see docs/security.md")\nfoo("bar")')
    cited = [(m["page"], re.findall(r'"([^"]+)"', m["names"])) for m in CITATION.finditer(text)]
    assert cited == [("architecture.md", ["Shared memory"]), ("formats.md", ["Checksums", "GGUF"]),
                     ("decisions.md", ["The tree"])]
    assert names_section("Fills", ("Fills: the miss read by the process that needs it (issue 36)",))
    assert not names_section("Fill", ("Fills",))
