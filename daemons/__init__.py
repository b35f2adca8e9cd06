"""The node's programs, one folder each: api/ (the API servers), supervisor/ (the
per-node supervisor and the children it starts), coordinator/ (the cluster's rank
registry and load table), cli/ (the `dpserve` command). config.py holds the
configs these programs are started with.

daemons/ may import dpserve.engine.common (protocol, config structs, plumbing),
never engine model code (torch stays out of API servers). What is about HTTP
lives in api/; routing and load bookkeeping are plain data structures that know
nothing of HTTP.
"""
