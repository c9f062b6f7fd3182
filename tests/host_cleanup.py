"""Host cleanup shared by the test suites' daemons: what a stopped daemon
may leave mounted under its root."""

from __future__ import annotations

import subprocess
from pathlib import Path


def unmount_under(root: Path) -> None:
    """Lazily unmounts every mount at or below `root` (deepest first)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split(" ")[4].encode().decode("unicode_escape")
        if point == str(root) or point.startswith(str(root) + "/"):
            points.append(point)
    for point in sorted(set(points), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)
