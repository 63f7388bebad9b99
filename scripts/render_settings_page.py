#!/usr/bin/env python
"""Render docs/settings.md's tables and counts again from qeff_evs/vllm/settings/table.py's rows, after changing a row.

    .venv/bin/python scripts/render_settings_page.py

tests/test_vllm_settings.py fails while the page and the rows differ.
"""

from pathlib import Path

from qeff_evs.vllm.settings.table import settings_page

PAGE = Path(__file__).resolve().parent.parent / "docs" / "settings.md"

if __name__ == "__main__":
    before = PAGE.read_text()
    after = settings_page(before)
    PAGE.write_text(after)
    print(f"{PAGE}: {'rendered again' if after != before else 'already equal to the rows'}")
