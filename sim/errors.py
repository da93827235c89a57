"""The one exception type for bad user input, so the CLI can print one line and exit 2."""


class GpipeInputError(ValueError):
    """Bad input from the user: the message names the offending value and how to fix it."""


def require_positive(name: str, value: int, hint: str = "") -> int:
    """Return ``value`` if it is a positive integer, else raise a one-line error naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        fix = f"; {hint}" if hint else ""
        raise GpipeInputError(f"{name} must be a positive integer, got {value!r}{fix}")
    return value
