"""The README's measured figures, each backed by its record: a number with no record behind it fails here.

Two rules. Each row of the performance table links a file under ``docs/records/`` that exists, and every figure in
the row (the card, the model's size and shape, the budget, the seconds, the date) is in that file. Anywhere else in
the README, a line with a measured figure (seconds, milliseconds, a bandwidth, a ratio) must link such a record,
and the record must hold each of those figures.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
RECORDS = REPO / "docs" / "records"

#: A link to a record, as the README writes it.
RECORD_LINK = re.compile(r"\]\((docs/records/[^)#\s]+)")
#: A figure in a table cell: a date, or a word holding a digit (``0.244``, ``H100``, ``12B``, ``1024x1024``), with
#: its unit where it has one (``16 GiB``, ``33 frames``).
FIGURE = re.compile(r"\d{4}-\d{2}-\d{2}|[A-Za-z]*\d[\w.]*(?<!\.)(?: (?:GiB|GB|frames|steps)\b)?")
#: A measured figure in prose: a number with a unit of time, speed or ratio.
MEASURED = re.compile(r"(\d+(?:\.\d+)?)\s?(?:ms|s|GB/s|GiB/s|x)(?![\w/])")
PERFORMANCE = "## Performance"


def sections(text: str) -> dict[str, str]:
    """The README's ``## `` sections by heading (what comes before the first under ""), fenced code left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    parts = re.split(r"^(## .*)$", text, flags=re.MULTILINE)
    return dict(zip(["", *parts[1::2]], parts[::2], strict=True))


def table_rows(section: str) -> list[str]:
    """The body rows of the section's tables (header and rule rows left out)."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [line for i, line in enumerate(lines) if i and not set(line) <= set("|-: ") and lines[i - 1][:1] == "|"]


def records_of(line: str) -> list[Path]:
    paths = [REPO / link for link in RECORD_LINK.findall(line)]
    assert paths, f"no link to docs/records/ in: {line}"
    for path in paths:
        assert path.is_file() and RECORDS in path.parents, f"{path} is not a file under docs/records/"
    return paths


def in_record(figure: str, records: list[Path]) -> bool:
    """Whether the figure stands in one of the records as a whole figure (``0.24`` is not in ``0.244``)."""
    pattern = re.compile(rf"(?<![\w.]){re.escape(figure)}(?!\w|\.\d)")
    return any(pattern.search(path.read_text()) for path in records)


def test_every_figure_of_the_performance_table_is_in_the_record_its_row_links() -> None:
    rows = table_rows(sections(README.read_text())[PERFORMANCE])
    assert rows, "the README has no performance table"
    for row in rows:
        records = records_of(row)
        cells = [cell for cell in row.split("|") if cell.strip() and not RECORD_LINK.search(cell)]
        figures = [figure for cell in cells for figure in FIGURE.findall(cell)]
        assert figures, row
        missing = [figure for figure in figures if not in_record(figure, records)]
        assert not missing, f"{missing} of the row {row!r} are not in {[str(p.relative_to(REPO)) for p in records]}"


def test_every_other_measured_figure_links_a_record_that_holds_it() -> None:
    for heading, section in sections(README.read_text()).items():
        rows = set(table_rows(section)) if heading == PERFORMANCE else set()
        for line in section.splitlines():
            figures = MEASURED.findall(line)
            if line in rows or not figures:
                continue
            records = records_of(line)
            missing = [figure for figure in figures if not in_record(figure, records)]
            assert not missing, f"{missing} in {heading!r} are not in the record its line links: {line}"


def test_the_checks_catch_an_edited_figure() -> None:
    """The rules are live: a figure changed by one digit, or a seconds figure with no record, fails them."""
    row = next(row for row in table_rows(sections(README.read_text())[PERFORMANCE]) if "13.79" in row)
    assert in_record("13.79", records_of(row)) and not in_record("13.78", records_of(row))
    assert MEASURED.findall("the first step took 6.3 s") == ["6.3"]
    assert not RECORD_LINK.findall("the first step took 6.3 s")
