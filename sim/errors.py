"""The one exception type for bad user input, so the CLI can print one line and exit 2."""

from __future__ import annotations

from typing import Iterable


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


def did_you_mean(name: object, choices: Iterable[str], limit: int = 3) -> str:
    """`` (did you mean X or Y?)`` naming the ``choices`` a mistyped ``name`` most likely meant, or
    ``""``: first those it begins (``h100`` for ``h100-nvlink``), then the closest spellings by
    difflib's ratio."""
    import difflib

    text = str(name).strip().lower()
    choices = list(choices)
    if not text:
        return ""
    begun = [c for c in choices if c.lower().startswith(text)]
    ratios = {c: difflib.SequenceMatcher(None, text, c.lower()).ratio() for c in choices}
    best = max(ratios.values(), default=0.0)
    # difflib's cutoff, and only the spellings about as close as the closest (lama3-70b: llama3-70b alone)
    spelled = sorted((c for c, r in ratios.items() if r >= max(0.6, best - 0.05)), key=lambda c: -ratios[c])
    picked = list(dict.fromkeys(begun + spelled))[:limit]
    if not picked:
        return ""
    named = picked[0] if len(picked) == 1 else f"{', '.join(picked[:-1])} or {picked[-1]}"
    return f" (did you mean {named}?)"
