"""What an API server runs for tenants: the gate (keys, limits), the cluster
sync and the /metrics collector, built from its config. None of it exists
without a tenants file: the single-key and no-key paths stay as they were."""

from __future__ import annotations

import asyncio

import zmq
from dpserve.daemons.api.tenants import Tenant
from dpserve.daemons.api.tenants.gate import TenantGate
from dpserve.daemons.api.tenants.keyfile import KeyBook
from dpserve.daemons.api.tenants.metrics import TenantCollector
from dpserve.daemons.api.tenants.sync import TenantSync


def fallback_book(entries: list[tuple[str, Tenant]] | None) -> KeyBook | None:
    """The reading the node started with (digests only), as the config carries it."""
    if not entries:
        return None
    return KeyBook({t.name: t for _, t in entries}, [bytes.fromhex(d) for d, _ in entries], [t for _, t in entries])


class TenantService:
    def __init__(self, cfg, log, coordinator: zmq.Socket, registry, origin: str) -> None:
        self.log = log
        self.gate = TenantGate.open(cfg.tenants_file, fallback_book(cfg.tenant_keys), log)
        self.coordinator = coordinator
        self.sync = TenantSync(lambda: self.gate.limits, origin, self._send)
        registry.register(TenantCollector(self.gate, self.sync, cfg.index))
        self._task: asyncio.Task | None = None
        log.info("tenants loaded", tenants=len(self.gate.book.tenants), key_file=cfg.tenants_file)

    def _send(self, data: bytes) -> None:
        sent = self.coordinator.send(data, zmq.NOBLOCK)
        if isinstance(sent, asyncio.Future):  # zmq.asyncio: a full queue fails the future; read it so asyncio never logs it
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    def cluster_usage(self, tenant_name: str) -> float:
        return self.sync.cluster_usage(tenant_name)

    def start(self) -> None:
        self._task = asyncio.create_task(self.sync.run(), name="tenant-sync")

    def on_signal(self) -> None:
        """SIGHUP (from loop.add_signal_handler: already outside the signal's context)."""
        asyncio.get_running_loop().call_soon(self.gate.reload)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sync.flush()  # what this server's tenants used last, for the others
