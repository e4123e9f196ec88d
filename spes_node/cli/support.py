"""What every command shares: one-line user errors, options that read SPES_<FLAG>, loading a config."""

from __future__ import annotations

import functools
import sys

import click

from spes_node.errors import SpesError


class UserError(click.ClickException):
    """One line on stderr, exit code 2 (click's usage-error convention for bad input)."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"spes-node: error: {self.message}", err=True, file=file)


def user_errors(fn):
    """Turn the errors a user can fix into one clear line and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            sys.exit(130)
        except (ValueError, SpesError, FileNotFoundError, PermissionError) as e:
            error = UserError(str(e).splitlines()[0] if str(e) else type(e).__name__)
            error.exit_code = getattr(e, "exit_code", UserError.exit_code)
            raise error from None

    return wrapper


def option(*names, **kwargs):
    """A click option that also reads SPES_<FLAG> from the environment."""
    flag = next(n for n in names if n.startswith("--"))
    kwargs.setdefault("envvar", "SPES_" + flag[2:].upper().replace("-", "_"))
    kwargs.setdefault("show_envvar", True)
    return click.option(*names, **kwargs)


def load_cfg(config: str | None, preset: str | None):
    from spes_node.config import load_config, load_preset

    if config and preset:
        raise ValueError("pass either --config or --preset, not both")
    if config:
        return load_config(config)
    if preset:
        return load_preset(preset)
    return None
