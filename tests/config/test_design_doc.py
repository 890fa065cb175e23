"""docs/design.md names real files: every repository path it mentions exists (a move that forgets the page fails)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_path_in_the_design_page_exists():
    text = (ROOT / "docs" / "design.md").read_text()
    paths = set(re.findall(r"`((?:relax|conf|tests|docs|bench|launch)/[\w./-]*)`", text))
    assert len(paths) > 30  # the page walks the code file by file
    missing = sorted(p for p in paths if not (ROOT / p.split("`")[0]).exists())
    assert missing == [], f"docs/design.md names paths that do not exist: {missing}"


def test_the_readme_links_the_design_page():
    assert "docs/design.md" in (ROOT / "README.md").read_text()
