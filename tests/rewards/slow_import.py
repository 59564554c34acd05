"""A grading function whose module takes SLOW_IMPORT_S seconds to import (0 unless set), as math-verify's sympy
and torch take seconds on a loaded machine."""

import os
import time

time.sleep(float(os.environ.get("SLOW_IMPORT_S", "0")))


def length(text: str) -> int:
    return len(text)
