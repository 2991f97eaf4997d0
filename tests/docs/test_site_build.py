"""`mkdocs build --strict` passes, and the generated reference pages hold what the code has:
every option of every command, every error code the source gives, every exit code."""

import html
import re
import sys

import click

from batchrun.cli import main
from batchrun.commandkit import EXIT_CRASH, EXIT_EXPIRED, EXIT_INTERRUPTED, EXIT_USAGE

from tests.docs.conftest import ROOT


def page_text(site, uri: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", (site / uri).read_text()))


def every_option(group: click.Group, ctx: click.Context):
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            yield from every_option(command, click.Context(command, parent=ctx, info_name=name))
            continue
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                yield name, param.opts[0]


def test_the_site_builds_strictly_with_every_nav_page(built_site):
    nav = re.findall(r":\s+(\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert len(nav) > 25
    for uri in nav:
        assert (built_site / uri.replace(".md", ".html")).is_file(), uri
    assert (built_site / "search" / "search_index.json").is_file()


def test_the_cli_reference_lists_every_option_of_every_command(built_site):
    text = page_text(built_site, "reference/cli.html")
    options = list(every_option(main, click.Context(main, info_name="batchrun")))
    assert len(options) > 100
    for command, flag in options:
        assert flag in text, (command, flag)
    # the run options' sections, in the --help order
    for heading in ("Input and output", "Model", "Engine", "Precision", "Sampling defaults",
                    "Reliability", "Scale-out"):
        assert heading in text


def test_the_error_and_exit_code_references_follow_the_code(built_site):
    sys.path.insert(0, str(ROOT / "docs" / "gen"))
    from codes_scan import scan

    errors = page_text(built_site, "reference/errors.html")
    for code in scan(ROOT / "batchrun"):
        assert code in errors, code
    exits = page_text(built_site, "reference/exit-codes.html")
    for code, name in ((EXIT_CRASH, "EXIT_CRASH"), (EXIT_USAGE, "EXIT_USAGE"),
                       (EXIT_EXPIRED, "EXIT_EXPIRED"), (EXIT_INTERRUPTED, "EXIT_INTERRUPTED")):
        assert name in exits and str(code) in exits


def test_the_architecture_and_changelog_pages_include_the_repository_files(built_site):
    design = page_text(built_site, "architecture.html")
    first_heading = re.search(r"^## (.+)$", (ROOT / "DESIGN.md").read_text(), re.M).group(1)
    assert first_heading in design
    changelog = page_text(built_site, "changelog.html")
    assert re.search(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1) in changelog
