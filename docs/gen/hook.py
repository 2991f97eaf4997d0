"""MkDocs hook (mkdocs.yml `hooks:`): the reference pages, generated from batchrun's code at
every build, so they cannot drift from it. Each generator is its own module in this folder."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

# MkDocs puts this folder on sys.path only while it loads the hook: the generators are
# imported now.
import ref_cli
import ref_codes
import ref_lines
import ref_metrics
import ref_specs

ROOT = Path(__file__).resolve().parents[2]


def _pages() -> dict[str, str]:
    return {
        "reference/cli.md": ref_cli.render(),
        "reference/lines.md": ref_lines.render(),
        "reference/errors.md": ref_codes.errors(ROOT / "batchrun"),
        "reference/exit-codes.md": ref_codes.exit_codes(),
        "reference/metrics.md": ref_metrics.render(ROOT),
        "reference/job-spec.md": ref_specs.job_spec(),
        "reference/sweep-spec.md": ref_specs.sweep_spec(),
    }


def on_files(files, config):
    for uri, content in _pages().items():
        files.append(File.generated(config, uri, content=content))
    return files
