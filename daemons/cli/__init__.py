"""The `dpserve` command: serve/head/worker start a supervisor; status, install-units
and demo-model are tools for a person. Nothing here runs once the supervisor is up."""

from dpserve.daemons.cli.main import main

__all__ = ["main"]
