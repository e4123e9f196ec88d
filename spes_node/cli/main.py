"""The `spes-node` command group: every command lives in its own module of this package."""

from __future__ import annotations

import sys

import click

from spes_node import __version__
from spes_node.cli.dht import dht
from spes_node.cli.evaluate import eval_, generate
from spes_node.cli.export import export
from spes_node.cli.init import init
from spes_node.cli.join import join
from spes_node.cli.plan import plan
from spes_node.cli.simulate import simulate
from spes_node.cli.status import status
from spes_node.cli.support import UserError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="spes-node")
def main() -> None:
    """spes-node: train a mixture-of-experts model with peers over the internet (SPES)."""


for command in (join, simulate, dht, status, export, init, eval_, generate, plan):
    main.add_command(command)


def run() -> None:
    """The console entry point: click's own usage errors also become one line."""
    try:
        code = main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("spes-node: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        message = e.format_message().splitlines()[0] if e.format_message() else type(e).__name__
        if isinstance(e, UserError):
            message = e.message
        click.echo(f"spes-node: error: {message}", err=True)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)
