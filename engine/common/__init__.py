"""Plumbing every dpserve process shares, engines and daemons alike.

The wire protocol (protocol), the config structs a child is started with
(config), process helpers and exit codes (procutil), logging (logs), the
CURVE keys of inter-node traffic (auth) and the one ZeroMQ socket helper
(sockets). It lives under engine/ because the dependency arrow points one
way: daemons import engine, engine never imports daemons, and engines need
these too; the top level (engine/, daemons/) is fixed, so there is no third
home. Rules for this folder: nothing about one DP rank (that is engine/) or
about the node's daemons (that is daemons/); no torch, no transformers, so API
servers and the supervisor stay small and start fast.
"""
