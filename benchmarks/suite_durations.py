"""The CPU suite's durations as docs/validation.md's tables: seconds per file and per test (setup,
call and teardown together), each test's tier (slow: marked @pytest.mark.slow), from the output of

    python -m pytest -q tests --durations=0 > suite.log 2>&1
    python benchmarks/suite_durations.py suite.log [--min-seconds 1.0]
"""

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown) +(tests/[^:]+\.py)::(.+)$")


def slow_tests() -> set[str]:
    """The ids of the tests the fast tier leaves out (-m 'not slow'), by collecting both tiers."""

    def collect(*marker: str) -> set[str]:
        command = [sys.executable, "-m", "pytest", "-q", "--collect-only", "tests", *marker]
        out = subprocess.run(command, cwd=REPO, capture_output=True, text=True).stdout
        return {line.strip() for line in out.splitlines() if "::" in line}

    return collect("-m", "slow")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("log", type=Path)
    parser.add_argument("--min-seconds", type=float, default=1.0)
    args = parser.parse_args()
    text = args.log.read_text()
    per_test: dict[tuple[str, str], float] = defaultdict(float)
    for line in text.splitlines():
        if match := LINE.match(line.strip()):
            per_test[match[2], match[3]] += float(match[1])
    per_file: dict[str, float] = defaultdict(float)
    for (file, _), seconds in per_test.items():
        per_file[file] += seconds
    slow = slow_tests()
    print(re.findall(r"^=*\s*(\d+ (?:passed|failed).*)$", text, re.MULTILINE)[-1].strip("= "))
    print("\n| file | seconds |\n| --- | --- |")
    for file, seconds in sorted(per_file.items(), key=lambda item: -item[1]):
        print(f"| `{file}` | {seconds:.1f} |")
    print("\n| test | seconds | tier |\n| --- | --- | --- |")
    rest = []
    for (file, test), seconds in sorted(per_test.items(), key=lambda item: -item[1]):
        if seconds < args.min_seconds:
            rest.append(seconds)
            continue
        tier = "slow" if f"{file}::{test}" in slow else "fast"
        print(f"| `{file.removeprefix('tests/')}::{test}` | {seconds:.1f} | {tier} |")
    total = sum(per_test.values())
    print(f"\nThe other {len(rest)} timed entries take under {args.min_seconds:g} s each, "
          f"{sum(rest):.1f} s together; {total:.0f} s in all.")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
