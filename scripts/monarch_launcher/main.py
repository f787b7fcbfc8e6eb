"""The launcher's entry: check the command line and that Monarch is there, then supervise."""

import importlib.metadata
import os
import sys

from configs import UserError
from scripts.monarch_launcher.command_line import parse

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MONARCH = "torchmonarch==0.7.0"


def main(argv: list[str]) -> int:
    try:
        launch = parse(argv)
        require_monarch()
        # The mesh's processes import the trainer actor from this repository (a local mesh inherits
        # this environment; remote workers get the same path: schedulers.py).
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
        from scripts.monarch_launcher.supervisor import Supervisor

        return Supervisor(launch).run()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


def require_monarch() -> None:
    """torchmonarch is optional for training: only this launcher needs it."""
    try:
        import monarch.actor  # noqa: F401
    except ImportError as e:
        raise UserError(f"the Monarch launcher needs torchmonarch: pip install {MONARCH} ({e})") from e
    # torchmonarch 0.7.0 declares cloudpickle without a version but needs 3.x (its pickler reads
    # cloudpickle.cloudpickle._function_getstate); with 2.x every actor spawn fails in its Rust core.
    cloudpickle = importlib.metadata.version("cloudpickle")
    if int(cloudpickle.split(".")[0]) < 3:
        raise UserError(
            f"torchmonarch needs cloudpickle 3 or later, found {cloudpickle}: pip install 'cloudpickle>=3'"
        )
