"""The performance docs stay short enough to read: at most 500 lines each (tighten wording, never drop figures;
split a topic into its own file, as docs/performance-cpu.md was)."""

from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("name", ["performance.md", "performance-cpu.md"])
def test_performance_doc_fits_500_lines(name: str) -> None:
    assert len((DOCS / name).read_text().splitlines()) <= 500
