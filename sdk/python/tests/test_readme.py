"""The README's examples run as they are: each ```python block in a
process of its own, with HUTCH_URL and HUTCH_API_KEY naming the session's
daemon."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_examples():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_a_readme_example_runs(code: str, daemon, admin_key, tmp_path: Path):
    env = {**os.environ, "HUTCH_URL": daemon.base, "HUTCH_API_KEY": admin_key}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=110)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-3000:]}"
