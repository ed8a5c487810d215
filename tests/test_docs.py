"""The README stays a five-minute page whose two commands are the ones CI runs, and no documentation link dangles.

The documentation site itself (``mkdocs build --strict``: pages, anchors, API pages from the docstrings) is built
by ``.ci/run`` with the ``docs`` extra; these checks need nothing beyond the standard library and PyYAML.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

README_MAX_LINES = 150
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def readme_problems(readme: str, ci_run: str) -> list[str]:
    """What is wrong with a README text, given the text of ``.ci/run`` (empty when nothing is)."""
    problems = []
    n_lines = len(readme.splitlines())
    if n_lines > README_MAX_LINES:
        problems.append(f"README.md has {n_lines} lines; at most {README_MAX_LINES} (reference goes to docs/)")
    blocks = FENCE.findall(readme)
    if len(blocks) < 2:
        return [*problems, f"README.md has {len(blocks)} fenced blocks; its first two are commands 1 and 2"]
    (lang1, command1), (lang2, command2) = blocks[0], blocks[1]
    command1, command2 = command1.strip(), command2.strip()
    if lang1 != "bash" or "\n" in command1 or "alpacafarm run recipes/quickstart.yaml" not in command1:
        problems.append(f"README.md's first fenced block is not command 1 (one bash line that sets up and runs "
                        f"recipes/quickstart.yaml): {command1[:120]!r}")
    if lang2 != "bash" or "\n" in command2 or "python -m pytest" not in command2:
        problems.append(f"README.md's second fenced block is not command 2 (one bash line that sets up and runs "
                        f"the test suite): {command2[:120]!r}")
    elif command2 not in ci_run:
        problems.append("README.md's command 2 does not appear verbatim in .ci/run")
    return problems


def relative_links(markdown: str) -> list[str]:
    """The link targets of a Markdown text that point into the repository (code blocks and spans left out)."""
    prose = INLINE_CODE.sub("", FENCE.sub("", markdown))
    return [target for target in LINK.findall(prose) if not EXTERNAL.match(target) and not target.startswith("#")]


def dangling_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file does not exist (an ``#anchor`` is checked by mkdocs, not here)."""
    return [target for target in relative_links(page.read_text(encoding="utf-8"))
            if not (page.parent / target.split("#", 1)[0]).exists()]


def nav_pages(entries: list) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_readme_is_short_and_starts_with_the_two_commands_ci_runs():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    ci_run = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert readme_problems(readme, ci_run) == []


def test_the_readme_check_catches_a_long_readme_and_a_command_ci_does_not_run():
    ci_run = "set -e\n.venv/bin/ruff check . && .venv/bin/python -m pytest\n"
    one = "```bash\npip install -e . && alpacafarm run recipes/quickstart.yaml\n```\n"
    good = f"# x\n\n{one}\n```bash\n.venv/bin/ruff check . && .venv/bin/python -m pytest\n```\n"
    assert readme_problems(good, ci_run) == []
    assert "lines" in readme_problems(good + "text\n" * README_MAX_LINES, ci_run)[0]
    other = good.replace("ruff check .", "ruff check alpacafarm")
    assert readme_problems(other, ci_run) == ["README.md's command 2 does not appear verbatim in .ci/run"]
    assert "first fenced block" in readme_problems(good.replace("recipes/quickstart.yaml", "x.yaml"), ci_run)[0]


PAGES = sorted([REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *(REPO_ROOT / "docs").rglob("*.md")])


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO_ROOT)) for p in PAGES])
def test_every_relative_link_points_at_an_existing_file(page: Path):
    assert dangling_links(page) == []


def test_the_link_check_sees_links_and_skips_code_and_urls(tmp_path: Path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text("[a](there.md#anchor) [b](gone.md) ![c](img/gone.png) [d](https://example.org/x.md) [e](#top)\n"
                    "`[f](code.md)`\n```\n[g](fenced.md)\n```\n")
    assert dangling_links(page) == ["gone.md", "img/gone.png"]


def test_every_page_of_the_site_is_in_the_nav_and_exists():
    config = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = REPO_ROOT / config.get("docs_dir", "docs")
    nav = nav_pages(config["nav"])
    assert [page for page in nav if not (docs / page).is_file()] == []
    pages = {str(p.relative_to(docs)) for p in docs.rglob("*.md")}
    assert sorted(pages - set(nav)) == []


# ---------------------------------------------------------------------- docs/architecture.md: the map stays true

MAP_ROW = re.compile(r"^\| `?([^|`]+?)`? \| ([^|]*) \|", re.M)
CODE = re.compile(r"`([^`]+)`")
COMMAND = re.compile(r"`alpacafarm ([a-z][a-z-]*)")


def map_problems(text: str, layers: dict[str, set[str]], is_command, plugins_dir: Path) -> list[str]:
    """What ``docs/architecture.md``'s text says that is not so: a layer whose modules differ from ``layers``
    (``tests/test_architecture.py``'s LAYERS), a command ``alpacafarm X`` that ``is_command(X)`` denies, a plugin
    or a file of a plugin that does not exist."""
    problems = []
    core, _, built_in = text.partition("## The built-in plugins")
    rows = {layer.strip(): set(CODE.findall(modules)) for layer, modules in MAP_ROW.findall(core)}
    for layer, modules in layers.items():
        named = {m.removeprefix("alpacafarm.") for m in modules
                 if m != "alpacafarm" and not m.startswith("alpacafarm.testing.")}
        if layer not in rows:
            problems.append(f"layer {layer!r} is missing from the map")
        elif rows[layer] != named:
            problems.append(f"layer {layer!r}: the map names {sorted(rows[layer] - named)} that it does not hold "
                            f"and misses {sorted(named - rows[layer])}")
    problems += [f"layer {layer!r} is not in LAYERS" for layer in rows if layer not in layers and layer != "Layer"]
    problems += [f"the command `alpacafarm {c}` does not exist" for c in dict.fromkeys(COMMAND.findall(text))
                 if not is_command(c)]
    for plugin, what in MAP_ROW.findall(built_in):
        folder = plugins_dir / plugin.strip()
        if plugin.strip() == "Plugin":
            continue
        if not folder.is_dir():
            problems.append(f"plugin {plugin.strip()!r} does not exist")
            continue
        for name in CODE.findall(what):
            if (name.endswith(".py") or name.endswith("/")) and not list(folder.rglob(name.rstrip("/"))):
                problems.append(f"plugin {plugin.strip()!r} has no {name}")
    return problems


def is_cli_command(name: str) -> bool:
    """Whether ``alpacafarm NAME`` is a command: the CLI's parser with every registered plugin command."""
    import contextlib
    import io

    from alpacafarm.cli import build_parser
    from alpacafarm.plugins import get_registry

    registry = get_registry()
    parser = build_parser({e.name: e.description for e in registry.entries("command")})
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            parser.parse_known_args([name, "-h"])
        except SystemExit as exit_:
            return exit_.code == 0  # -h of a known command; an unknown one is a usage error (2)
    return True  # a plugin command parses its own arguments: argparse left ``-h`` to it


def test_the_architecture_map_names_what_exists():
    from test_architecture import LAYERS

    text = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert map_problems(text, LAYERS, is_cli_command, REPO_ROOT / "plugins") == []


def test_the_map_check_catches_a_wrong_layer_a_missing_command_and_a_missing_plugin_file(tmp_path: Path):
    (tmp_path / "alpacafarm_x" / "sub").mkdir(parents=True)
    (tmp_path / "alpacafarm_x" / "here.py").write_text("")
    layers = {"foundation": {"alpacafarm", "alpacafarm.errors", "alpacafarm.types"}}
    text = ("| Layer | Modules | What |\n|---|---|---|\n| foundation | `errors`, `types` | x |\n\n"
            "Run `alpacafarm run` or `alpacafarm models`.\n## The built-in plugins\n\n| Plugin | What |\n|---|---|\n"
            "| `alpacafarm_x` | `here.py`, `sub/` and `gone.py` |\n| `alpacafarm_y` | y |\n")
    commands = {"run"}.__contains__
    assert map_problems(text, layers, commands, tmp_path) == [
        "the command `alpacafarm models` does not exist", "plugin 'alpacafarm_x' has no gone.py",
        "plugin 'alpacafarm_y' does not exist"]
    moved = text.replace("`errors`, `types`", "`errors`, `helpers`")
    assert map_problems(moved, layers, commands, tmp_path)[0] == (
        "layer 'foundation': the map names ['helpers'] that it does not hold and misses ['types']")


def test_every_step_of_ci_run_can_fail_it(tmp_path: Path):
    """Under ``set -e`` a failure inside an ``a && b && c`` list does not stop the script: only the list's last
    command counts, so .ci/run's test line could fail and CI still end 0 on the docs build. Each of .ci/run's
    lines is run here with every command replaced by one that fails, and the script must exit non-zero for each."""
    import re
    import subprocess

    lines = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    steps = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))
             and not line.startswith("command -v")]
    assert len(steps) >= 3  # the set-up and tests, the slow tiers and the gate, the docs
    for index in steps:
        script = ["set -euo pipefail"]
        for i in steps:
            # every command of this line fails; the other lines succeed
            script.append(re.sub(r"[^&|;]+", " false " if i == index else " true ", lines[i].split(" || exit")[0])
                          + (" || exit 1" if " || exit" in lines[i] else ""))
        script.append("exit 0")
        path = tmp_path / f"ci{index}.sh"
        path.write_text("\n".join(script) + "\n", encoding="utf-8")
        result = subprocess.run(["bash", str(path)], capture_output=True, text=True)
        assert result.returncode != 0, f".ci/run line {index + 1} can fail and CI still pass: {lines[index][:80]}"


def test_every_recipe_is_in_the_recipes_table():
    """docs/recipes.md's tables name every recipe under recipes/ by its path, and name no recipe that is gone."""
    import re

    text = (REPO_ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    tables = text[text.index("## The recipes"):text.index("## Command line")]
    named = set(re.findall(r"`(recipes/[\w./-]+\.yaml)`", tables))
    present = {str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "recipes").rglob("*.yaml")}
    assert sorted(present - named) == [] and sorted(named - present) == []


def test_no_docs_page_is_over_300_lines():
    """A manual, not an experiment log: a page that grows past 300 lines moves its dated results to docs/reports/."""
    sizes = {str(p.relative_to(REPO_ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in (REPO_ROOT / "docs").rglob("*.md")}
    assert len(sizes) >= 20 and {page: n for page, n in sizes.items() if n > 300} == {}
