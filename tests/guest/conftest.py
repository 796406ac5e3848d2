import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from guest_helpers import TIMES  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    if TIMES:
        terminalreporter.section("QEMU guest stages (TCG)")
        for line in TIMES:
            terminalreporter.write_line(line)
