"""Authenticated inter-node ZeroMQ traffic: CURVE keys derived from one shared secret.

Every node of a deployment reads the same key file. From it we derive a
server key pair (held by every binding socket: coordinator, API servers) and
a client key pair (held by every connecting socket). A process without the
file cannot connect (it does not know the server key), cannot pass ZAP (its
client key is not the derived one), and cannot read traffic (CURVE encrypts).
Single-node ipc:// sockets need none of this.
"""

from __future__ import annotations

import hashlib
import os
import stat

import zmq
from zmq.utils import z85

MIN_SECRET_BYTES = 16


class CurveKeys:
    __slots__ = ("server_public", "server_secret", "client_public", "client_secret")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the data-parallel key must hold at least {MIN_SECRET_BYTES} bytes of secret")
        self.server_secret = z85.encode(hashlib.sha256(b"dpserve-curve-server\0" + secret).digest())
        self.client_secret = z85.encode(hashlib.sha256(b"dpserve-curve-client\0" + secret).digest())
        self.server_public = zmq.curve_public(self.server_secret)
        self.client_public = zmq.curve_public(self.client_secret)

    @classmethod
    def from_file(cls, path: str, log=None) -> CurveKeys:
        with open(path, "rb") as f:
            secret = f.read().strip()
        mode = os.stat(path).st_mode
        if log is not None and mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("the data-parallel key file is readable by others; chmod 600 it", path=path)
        return cls(secret)


def make_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Before bind: only holders of the shared secret may connect."""
    if keys is None:
        return
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Before connect: prove we hold the shared secret, and check the server does."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class _AllowOnly:
    def __init__(self, client_public: bytes, log) -> None:
        self.client_public = client_public
        self.log = log

    def callback(self, domain: str, key: bytes) -> bool:
        ok = z85.encode(key) == self.client_public if len(key) == 32 else key == self.client_public
        if not ok and self.log is not None:
            self.log.warning("refused a ZeroMQ peer without the deployment key")
        return ok


def start_authenticator(ctx: zmq.Context, keys: CurveKeys | None, log=None):
    """A ZAP handler for `ctx` that admits only the deployment's client key.

    Returns the authenticator (stop it at shutdown) or None without keys.
    Works for zmq.asyncio contexts too (the handler thread uses a shadow).
    """
    if keys is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    sync_ctx = zmq.Context.shadow(ctx.underlying)
    auth = ThreadAuthenticator(sync_ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowOnly(keys.client_public, log))
    return auth


# Monitor events that tell a CURVE handshake's fate (zmq_socket_monitor). A peer
# with another key fails the handshake: the binding side sees a cryptographic
# protocol error, the connecting side only "failed, no detail", then retries.
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def describe_handshake_failure(event: int, value: int) -> str:
    """Why a monitored handshake failed, in words ('' for any other event)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value in (zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC, zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE):
            return "CURVE handshake failed: the peer holds another key"
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "handshake failed: the peer does not use the deployment key (no CURVE)"
        return f"handshake failed: ZeroMQ protocol error {value:#x}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"handshake refused by authentication (status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "handshake failed (another key, no key, or not a dpserve peer)"
    return ""
