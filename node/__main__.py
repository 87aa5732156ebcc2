from node.cli import entry_point

entry_point()
