"""The settings page is the table the code prints: a setting added or changed shows up in the docs."""

from pathlib import Path

from phaseserve.settings import markdown_table

ROOT = Path(__file__).resolve().parent.parent


def test_the_settings_page_is_the_settings_table():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert markdown_table() in page, "docs/settings.md is stale: paste the output of `phaseserve settings`"
