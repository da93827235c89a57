"""The one exception type for bad user input, so the CLI can print one line and exit 2."""


class GpipeInputError(ValueError):
    """Bad input from the user: the message names the offending value and how to fix it."""


def require_at_least(name: str, value: int, minimum: int, hint: str = "") -> int:
    """Return ``value`` if it is an integer of at least ``minimum``, else raise a one-line error naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        fix = f"; {hint}" if hint else ""
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise GpipeInputError(f"{name} must be {what}, got {value!r}{fix}")
    return value


def require_positive(name: str, value: int, hint: str = "") -> int:
    """Return ``value`` if it is a positive integer, else raise a one-line error naming it."""
    return require_at_least(name, value, 1, hint)
