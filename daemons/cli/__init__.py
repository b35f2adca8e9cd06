"""The `dpserve` command: serve/head/worker start a supervisor; status, install-units
and demo-model are tools for a person. Nothing here runs once the supervisor is up.

The package imports nothing itself: `python -m dpserve.daemons.cli.main` (how the
tests and benchmarks start a node) would otherwise find its module imported twice
and say so on stderr before a one-line error."""
