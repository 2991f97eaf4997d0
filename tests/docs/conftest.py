import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The documentation site as `make docs` builds it (strict: a broken link, a missing page or
    a reference generator out of step with the code fails the build), once per session."""
    site = tmp_path_factory.mktemp("site")
    runs = tmp_path_factory.mktemp("runs")  # where a run would record itself for `plan`
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                             "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1",
                                 "BATCHRUN_RUNS_DIR": str(runs)}, timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
    # the metrics page's job on the fake engine must not calibrate `batchrun plan`
    assert not any(runs.iterdir()), list(runs.iterdir())
    return site
