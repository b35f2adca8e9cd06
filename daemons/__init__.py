"""Node daemons: supervisor, API server, coordinator, CLI, config."""
