"""The coordinator: one per cluster, on the head. It keeps the registry of every rank
(registration, liveness, load) and publishes the load table the API servers route by.
It never sees a request."""
