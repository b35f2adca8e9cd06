"""Nodes in network namespaces on one host: one OpenMP thread per rank unless a test says otherwise."""

from __future__ import annotations

import os

# A node with one local rank gives it every core (plan.rank_threads); two or
# three such nodes on one 2-core host would oversubscribe it, and OpenMP barriers across contended cores
# made forwards up to 100x slower (tests/unit/conftest.py). The nodes inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")
