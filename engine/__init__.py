"""One data-parallel rank: model, scheduler, engine process. Never imports dpserve.daemons."""
