"""Run train.py's main() for many command lines in one process (imports paid once) and report,
per case, the exit code and what went to stderr. Used by tests/test_bad_inputs.py.

    python tests/catalog_runner.py CASES.json RESULTS.json    # CASES: [[arg, ...], ...]
"""

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402


def run(argv: list[str]) -> dict:
    stderr = io.StringIO()
    sys.argv = ["train.py", *argv]
    try:
        with contextlib.redirect_stderr(stderr):
            code = train.main()
    except BaseException:  # an unhandled failure is a result to report, not a crash of the runner
        code = "exception"
        stderr.write(traceback.format_exc())
    return {"argv": argv, "code": code, "stderr": stderr.getvalue()}


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([run(argv) for argv in cases], indent=1))
