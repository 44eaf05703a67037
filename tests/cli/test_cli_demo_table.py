"""The README's `diloco demo` table has the columns the demo prints, and the demo's table fits
100 columns when written to a file (no training: the table is built from the README's rows)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from diloco.commands.demo import Where, demo_table

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_demo_table() -> tuple[list[str], list[list[str]]]:
    """The header and rows of the README's demo table (the one whose rows start "DiLoCo (")."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| DiLoCo (")) - 2
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, rule, *rows = table
    assert set("".join(rule)) <= set("-:"), rule
    return header, rows


def test_the_readme_demo_table_has_the_columns_the_demo_prints():
    header, rows = readme_demo_table()
    table = demo_table(1000, 136_960, rows)
    assert [str(column.header) for column in table.columns] == header
    assert len(rows) == 3 and all(len(row) == len(header) for row in rows)


def test_the_demo_table_fits_100_columns_in_a_file():
    _header, rows = readme_demo_table()
    wide = [["DiLoCo (streaming), 16 workers, H=100", *rows[0][1:]], *rows[1:]]
    console = Console(width=140, file=io.StringIO(), record=True)  # as `out` writes to a file
    console.print(demo_table(1000, 136_960, wide))
    assert max(len(line) for line in console.export_text().splitlines()) <= 100


def test_the_demo_table_names_a_device_and_dtype_that_are_not_the_defaults_and_fits():
    assert Where("cpu", "fp32").label() == ""  # the README's table: no label
    assert Where("cpu", "bf16").label() == "bf16 "
    assert Where("cuda:1", "fp32").label() == "on cuda:1 "
    assert Where("cuda", "bf16").label() == "on cuda, bf16 "
    _header, rows = readme_demo_table()
    console = Console(width=140, file=io.StringIO(), record=True)
    console.print(demo_table(1000, 136_960, rows, Where("cuda:1", "bf16")))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "on cuda:1, bf16" in " ".join(text.split())  # (the title may wrap)
