"""The node's daemons: supervisor, API servers, coordinator, launcher, CLI, config.

daemons/ may import dpserve.engine's protocol, config types and common/
plumbing, never its model code (torch stays out of API servers). What is about
HTTP lives in the API-server modules; routing and load bookkeeping are plain
data structures that know nothing of HTTP.
"""
