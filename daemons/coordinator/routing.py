"""Which API servers route to which ranks, by load-balancing mode: the one rule.

The coordinator applies it (the API servers an engine connects to) and the
supervisor's /status describes it (a rank's `routed_by`). Plain functions of
plain values: no sockets, no imports from the rest of dpserve, so both
daemons import it without a cycle. It must never learn about processes.
"""

from __future__ import annotations

# hybrid: API servers on every node, each routing to its node's ranks;
# external: one API server per rank, on the rank's node.
NODE_LOCAL_MODES = ("hybrid", "external")


def is_node_local(lb_mode: str) -> bool:
    """True when an API server routes only to ranks on its own node."""
    return lb_mode in NODE_LOCAL_MODES


def routes_to(lb_mode: str, api_node_rank: int, rank_node_rank: int) -> bool:
    """Whether an API server on node `api_node_rank` may send requests to a
    rank on node `rank_node_rank` (nodes are named by their first rank)."""
    return not is_node_local(lb_mode) or api_node_rank == rank_node_rank


def routed_by(lb_mode: str, rank: int, node_rank: int) -> str:
    """The API servers that route to `rank`, in words (/status `routed_by`;
    README "Seeing the cluster" lists every value)."""
    if lb_mode == "internal":
        return "head"  # every API server runs on the head, a one-node `serve` included
    if not is_node_local(lb_mode):
        return "all nodes"
    if node_rank < 0:
        return "-"  # never registered: its node is not known yet
    if lb_mode == "external":
        return f"node {node_rank} api-{rank - node_rank}"
    return f"node {node_rank}"
