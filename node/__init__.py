"""The node daemon: config, identity, services, the control API and the CLI."""
