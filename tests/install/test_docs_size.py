"""docs/performance.md stays short enough to read: at most 500 lines (tighten wording, never drop figures)."""

from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "performance.md"


def test_performance_doc_fits_500_lines():
    assert len(DOC.read_text().splitlines()) <= 500
