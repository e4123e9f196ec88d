"""Errors a user can fix: the CLI prints them as one line (kept import-light so that the CLI answers fast)."""


class SpesError(Exception):
    """Base of the errors that end a command with one clear line and a non-zero exit."""

    exit_code = 2
    """2 for what the user gave (click's convention for bad input); 1 for a fault met while running."""


def error_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
