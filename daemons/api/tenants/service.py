"""What an API server runs for tenants: the gate (keys, limits), the cluster
sync and the /metrics collector, built from its config. None of it exists
without a tenants file: the single-key and no-key paths stay as they were."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os

import zmq
from dpserve.daemons.api.tenants import Tenant
from dpserve.daemons.api.tenants.gate import TenantGate
from dpserve.daemons.api.tenants.keyfile import KeyBook, changes
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
        # The tenants (names and limits, no keys) as this node's API servers last read them: a
        # restarted API server (systemctl reload restarts them all) logs what changed since.
        self.seen_path = os.path.join(os.path.dirname(cfg.probe_path), "tenants-seen.json") if cfg.probe_path else None
        self.note_changes()

    def _send(self, data: bytes) -> None:
        sent = self.coordinator.send(data, zmq.NOBLOCK)
        if isinstance(sent, asyncio.Future):  # zmq.asyncio: a full queue fails the future; read it so asyncio never logs it
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    def cluster_usage(self, tenant_name: str) -> float:
        return self.sync.cluster_usage(tenant_name)

    def start(self) -> None:
        self._task = asyncio.create_task(self.sync.run(), name="tenant-sync")

    def note_changes(self, say: bool = True) -> None:
        """Log how the tenants differ from what this node's API servers read last, and record them."""
        if self.seen_path is None:
            return
        now = {name: dataclasses.asdict(t) for name, t in self.gate.book.tenants.items()}
        try:
            with open(self.seen_path) as f:
                before = {name: Tenant(**fields) for name, fields in json.load(f).items()}
        except (OSError, ValueError, TypeError):
            before = None
        if before is not None and say:
            for name, what, fields in changes(before, self.gate.book.tenants):
                self.log.info(f"tenant {what}", tenant=name, **fields)
        tmp = f"{self.seen_path}.{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(now, f)
            os.replace(tmp, self.seen_path)
        except OSError:
            pass  # only the journal's record of changes is lost

    def on_signal(self) -> None:
        """SIGHUP (from loop.add_signal_handler: already outside the signal's context)."""
        asyncio.get_running_loop().call_soon(self._reload)

    def _reload(self) -> None:
        if self.gate.reload():
            self.note_changes(say=False)  # the gate logged what changed for this server

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sync.flush()  # what this server's tenants used last, for the others
