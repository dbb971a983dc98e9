"""The one exception type users see: a problem with their input, with the fix in the message."""


class UserError(Exception):
    """Bad input (paths, checkpoints, plans, languages...).

    The CLI prints it as one line and exits non-zero; the app shows it as ``gr.Error``.
    Messages say what is wrong and what to do about it.
    """
