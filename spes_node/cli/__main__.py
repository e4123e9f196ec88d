from spes_node.cli.main import run

run()
