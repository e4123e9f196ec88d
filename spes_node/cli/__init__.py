"""The command line: `spes-node` and its commands, one module each (parse flags, build the config, call the
library). Every flag also reads SPES_<FLAG> from the environment."""

from spes_node.cli.main import main, run

__all__ = ["main", "run"]
