"""Every command-line tool answers --help with a usage line and exit status 0."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "scripts"
SCRIPTS = sorted([*SCRIPTS_DIR.glob("*.py"), *SCRIPTS_DIR.glob("bench/*.py")])  # the user tools and the benchmarks


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.relative_to(SCRIPTS_DIR).as_posix() for s in SCRIPTS])
def test_help(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-1000:]
    assert result.stdout.startswith("usage:"), result.stdout[:200]
