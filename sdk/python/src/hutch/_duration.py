"""Durations as the SDK takes them: seconds, a `timedelta`, or a string such as
"90s", "10m", "1h30m", "2d". The API takes whole seconds; a fraction is
rounded up (a lifetime is never shortened by rounding)."""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Union

Duration = Union[int, float, str, timedelta]

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(value: Duration, what: str = "duration") -> float:
    """Seconds in `value`; raises ValueError for anything else or a negative."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected seconds or a string like '10m', got {value!r}")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if re.fullmatch(r"\d+(?:\.\d+)?", text):
            seconds = float(text)
        else:
            pos, seconds = 0, 0.0
            for m in _PART.finditer(text):
                if m.start() != pos:
                    break
                seconds += float(m.group(1)) * _UNITS[m.group(2)]
                pos = m.end()
            if pos != len(text) or not text:
                raise ValueError(f"{what}: {value!r} is not a duration (examples: 30, '90s', '10m', '1h30m', '2d')")
    else:
        raise ValueError(f"{what}: expected seconds or a string like '10m', got {type(value).__name__}")
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{what}: {value!r} is negative")
    return seconds


def whole_seconds(value: Duration, what: str = "duration") -> int:
    """`parse_duration`, rounded up to whole seconds."""
    return int(math.ceil(parse_duration(value, what)))
