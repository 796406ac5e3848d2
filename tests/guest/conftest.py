from guest_helpers import TIMES


def pytest_terminal_summary(terminalreporter):
    if TIMES:
        terminalreporter.section("QEMU guest stages (TCG)")
        for line in TIMES:
            terminalreporter.write_line(line)
