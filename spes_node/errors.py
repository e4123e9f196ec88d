"""Errors a user can fix: the CLI prints them as one line (kept import-light so that the CLI answers fast)."""


class SpesError(Exception):
    """Base of the errors that end a command with one clear line and a non-zero exit."""


def error_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
