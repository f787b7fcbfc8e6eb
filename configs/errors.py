"""The one error type for a mistake a user can make and fix: a config key, a layout, missing or
damaged data, a checkpoint that does not fit. train.py prints it as one `error: ...` line and exits
with code 2; anything else is a bug (or a failure of the machine) and keeps its traceback."""


class UserError(Exception):
    """A mistake the user can fix; the message names the cause (the key, file or checkpoint)."""


def first_line(error: Exception) -> str:
    """A library's error message, cut to fit in one `error:` line."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
