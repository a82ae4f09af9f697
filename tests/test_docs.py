"""The settings page is the table the code prints: a setting added or changed shows up in the docs."""

from pathlib import Path

from phaseserve.settings import markdown_table

ROOT = Path(__file__).resolve().parent.parent


def test_the_settings_page_is_the_settings_table():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert markdown_table() in page, "docs/settings.md is stale: paste the output of `phaseserve settings`"


def test_the_request_limits_are_one_table_in_the_docs_and_the_openapi_document():
    from dataclasses import replace

    from gateway import limits
    from gateway.openapi import openapi_document
    from gateway.structured import GrammarBudgets

    page = (ROOT / "docs" / "settings.md").read_text()
    assert limits.markdown_table() in page, "docs/settings.md's Request limits are stale: paste limits.markdown_table()"
    budgets = replace(GrammarBudgets.defaults(), max_choices=7, max_grammar_bytes=99)
    schemas = openapi_document(budgets)["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == limits.MAX_MESSAGES
    assert {"type": "array", "maxItems": limits.MAX_TOOLS}.items() <= chat["tools"]["anyOf"][0].items()
    assert chat["n"]["maximum"] == limits.MAX_N
    assert chat["guided_choice"]["anyOf"][0]["maxItems"] == 7  # the server's budgets, not the defaults
    assert chat["guided_regex"]["anyOf"][0]["maxLength"] == 99
    assert "x-guidance" in chat["response_format"]["description"]
