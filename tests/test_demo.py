"""The README's main job (scripts/demo.py) runs end to end and reports success."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the demo sets its own devices
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--workdir", str(tmp_path / "demo")],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "on mesh {'fsdp': 2, 'sp': 4}" in result.stdout
    assert "bit-identical: True" in result.stdout
    assert (tmp_path / "demo" / "scores.npz").is_file()
