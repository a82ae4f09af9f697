"""The settings page is the table the code prints: a setting added or changed shows up in the docs."""

from pathlib import Path

from phaseserve.settings import markdown_table

ROOT = Path(__file__).resolve().parent.parent


def test_the_settings_page_is_the_settings_table():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert markdown_table() in page, "docs/settings.md is stale: paste the output of `phaseserve settings`"


def test_the_request_limits_are_one_table_in_the_docs_and_the_openapi_document():
    from dataclasses import replace

    from phaseserve.gateway import limits
    from phaseserve.gateway.openapi import openapi_document
    from phaseserve.gateway.structured import GrammarBudgets

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


README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


def test_the_readme_is_for_users_and_short():
    """Performance, API detail and deployment live in docs/; the README stays a page a user reads."""
    size = README.stat().st_size
    assert size <= 15_000, f"README.md is {size} bytes: move detail to a docs page (limit 15,000)"
    for page in ("api.md", "deployment.md", "performance.md", "contributing.md"):
        assert f"(docs/{page})" in README.read_text(), f"the README links docs/{page}"


def test_ci_runs_the_readmes_test_command_word_for_word():
    readme, ci = README.read_text(), (ROOT / ".ci" / "run").read_text()
    block = readme[readme.index("```bash", readme.index("## Quickstart")):]
    command = next(line for line in block.splitlines() if "pytest" in line)
    assert command in ci, f".ci/run must run the README's test command: {command}"
    assert "phaseserve up" in block.split("```")[1]


def test_the_readmes_settings_table_names_real_settings_with_their_defaults():
    from phaseserve.settings import BY_NAME, SETTINGS

    text = README.read_text()
    table = text[text.index("## Settings"):text.index("## Limits")]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| `--")]
    assert len(rows) >= 8
    by_flag = {s.flag: s for s in SETTINGS}
    for flag, env, default, _ in (map(str.strip, row) for row in rows):
        setting = by_flag.get(flag.strip("`"))
        assert setting is not None, f"the README names {flag}, which is no setting"
        assert env.strip("`") == setting.env, f"{flag}: the README says {env}, the code {setting.env}"
        shown = default.split(" ")[0]
        if shown.startswith("`"):  # a literal default must be the code's
            assert shown.strip("`") == str(setting.default), f"{flag}: README {shown}, code {setting.default!r}"
    assert BY_NAME  # the table of all settings is docs/settings.md (checked above)


def test_every_relative_link_and_python_module_the_docs_name_exists():
    import importlib.util
    import re
    import sys

    sys.path.insert(0, str(ROOT))  # bench/ runs from a clone, not installed
    missing = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: link {target}")
        for module in set(re.findall(r"python -m ((?:bench|phaseserve|kernels|workers)(?:\.\w+)*)", text)):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{page.relative_to(ROOT)}: python -m {module}")
        for path in set(re.findall(r"`((?:bench|phaseserve|scripts|gateway|scheduler|workers|kernels)/[\w/.-]+\.(?:py|sh|md))`",
                                   text)):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "the docs name what is not there:\n" + "\n".join(missing)


def test_the_performance_page_is_one_table_with_its_machine_date_and_commands():
    import re

    text = (ROOT / "docs" / "performance.md").read_text()
    headers = [line for line in text.splitlines() if line.startswith("| ---")]
    assert len(headers) == 1, "docs/performance.md holds one table"
    assert "**Machine and date.**" in text and re.search(r"\b20\d\d-\d\d-\d\d\b", text)
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| figure")]
    rows = [r for r in rows if not r.startswith("| ---")]
    assert rows and all("bench/results/" in r and "`" in r for r in rows), "each row: its command and record"


def test_the_structure_command_runs_and_reports_the_readme():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "structure.py")], capture_output=True, text=True,
                         check=True).stdout
    for title in ("largest class and function per part", "files over 400 lines", "mixin classes",
                  "imports running back up the layers", "comment and docstring lines with a machine figure"):
        assert title in out
    assert f"README.md: {README.stat().st_size / 1000:.1f} KB" in out
