"""The one exception type users see: a problem with their input, with the fix in the message."""

import math


class UserError(Exception):
    """Bad input (paths, checkpoints, plans, languages...).

    The CLI prints it as one line and exits non-zero; the app shows it as ``gr.Error``.
    Messages say what is wrong and what to do about it.
    """


def whole_number(value: object, what: str, lo: int, hi: int) -> int:
    """`value` (an int, a float from a slider, or text) as a whole number in [lo, hi]; anything else
    (NaN, infinity, a fraction, text that is not a number, out of range) is refused with the range."""
    try:
        x = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError, OverflowError):
        x = math.nan
    if not (math.isfinite(x) and x == int(x) and lo <= x <= hi):
        raise UserError(f"{what} must be a whole number from {lo:,} to {hi:,} (got {str(value)[:40]!r}).")
    return int(x)
