"""The one error type for a mistake a user can make and fix: a config key, a layout, missing or
damaged data, a checkpoint that does not fit. train.py prints it as one `error: ...` line and exits
with code 2; anything else is a bug (or a failure of the machine) and keeps its traceback."""


class UserError(Exception):
    """A mistake the user can fix; the message names the cause (the key, file or checkpoint)."""


def claims_error_line() -> bool:
    """Whether this process prints the run's `error:` line: a lone process always; under torchrun the
    first process of a node to get there (a marker file per run and node). Not local rank 0 alone:
    when another rank fails first, torchrun kills rank 0 before it prints, and a failure of one
    rank only (a lost peer) would not be said at all."""
    import os
    import tempfile

    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if "WORLD_SIZE" not in os.environ or not run:
        return True
    # A launch: its run id (unique with --standalone and scripts/launch_monarch.py; "none" unless
    # torchrun is given --rdzv-id, then the workers' shared parent, torchrun's agent, tells it),
    # the restart count, and the node.
    owner = os.getppid() if run == "none" else ""
    restart, node = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ.get("GROUP_RANK", "0")
    launch = f"{run}-{owner}-{restart}-{node}"
    marker = os.path.join(tempfile.gettempdir(), f"recipe-error-{os.getuid()}-{launch}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:  # no writable temporary folder: one line per node as before
        return os.environ.get("LOCAL_RANK", "0") == "0"


def first_line(error: Exception) -> str:
    """A library's error message, cut to fit in one `error:` line."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
