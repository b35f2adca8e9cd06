"""`dpserve drain` / `undrain` / `retire`: a local rank taken out of service on purpose.

Two halves. The health port's POST /drain, /undrain and /retire (handlers
below) check who asks and post a DrainRequested; the loop applies it (stop /
undrain, the loop's verbs, writing the child record) and answers through the
event's future. This module never touches a child outside those verbs.

Drain: the engine gets DRAIN_SIGNAL and stops at once, announcing EngineDead
(clean, "drained (dpserve drain)") to its API servers, which move its
requests, and RankDown to the coordinator, so every view shows it drained
within milliseconds. Its child then stays DRAINED: the restart policy does
not apply, /health does not count it as unhealthy, and only undrain (or a
restart of the node) starts it again. Retire is a drain whose end also takes
the rank out of the cluster's membership (the supervisor's RankDown, reason
RETIRED_REASON, once the engine is gone), so that the node can be stopped and
removed; a new engine registering for the rank (a replacement node, or
undrain) makes it a member again.

Who may ask: with a data-parallel key file (multi-node), a bearer token
derived from that key (admin_token); without one, only a loopback peer
(the health port listens on 127.0.0.1 by default).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from dpserve.daemons.supervisor import rolling
from dpserve.daemons.supervisor.children import Child, ChildState
from dpserve.daemons.supervisor.events import DrainRequested
from dpserve.engine.rank.process import DRAIN_SIGNAL, DRAINED_REASON

if TYPE_CHECKING:
    from dpserve.daemons.supervisor.core import Supervisor

REPLY_TIMEOUT_S = 5.0
RETIRED_REASON = "retired (dpserve retire)"  # cluster.RETIRED_PREFIX, the coordinator's RETIRED_PREFIX
VERBS = ("drain", "undrain", "retire", "rolling-restart")
_encode = msgspec.json.Encoder().encode


def admin_token(key_file: str) -> str:
    """The bearer token of the health port's mutating verbs: HMAC-SHA256 of a fixed
    label under the deployment's shared secret (never the secret itself)."""
    with open(key_file, "rb") as f:
        secret = f.read().strip()
    return hmac.new(secret, b"dpserve-supervisor-admin", hashlib.sha256).hexdigest()


def _is_loopback(peer: str | None) -> bool:
    try:
        return peer is not None and ipaddress.ip_address(peer.split("%")[0]).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------- the loop's verbs


def apply(sup: Supervisor, event: DrainRequested) -> None:
    """The loop's verb for a DrainRequested: answer it, changing children if it must."""
    if event.verb == "rolling-restart":
        status, body = rolling_restart(sup)
    elif event.rank is None:  # retire the whole node: every local rank
        answers = [stop(sup, rank, RETIRED_REASON) for rank in sup.cfg.local_ranks]
        status = max(code for code, _ in answers)
        body = {"ranks": [a for _, a in answers]} if status < 400 else next(a for code, a in answers if code == status)
    elif event.verb == "undrain":
        status, body = undrain(sup, event.rank)
    else:
        status, body = stop(sup, event.rank, RETIRED_REASON if event.verb == "retire" else DRAINED_REASON)
    if not event.reply.done():
        event.reply.set_result((status, body))


def rolling_restart(sup: Supervisor) -> tuple[int, dict]:
    """Restart this node's ranks one at a time (rolling.py); each one's requests move."""
    if sup.phase != "serving":
        return 409, {"error": f"the node is {sup.phase}; a rolling restart acts on a serving node"}
    if sup.cfg.uses_ray:
        return 409, {"error": "ranks placed by Ray (--data-parallel-backend ray) are restarted by Ray"}
    if sup.rolling is not None:
        return 409, {"error": "a rolling restart is already in progress"}
    sup.rolling = rolling.begin(sup, "engine")
    return 202, {"state": "restarting", "ranks": [c.rank for c in sup.children.values() if c.kind == "engine" and not c.drained]}


def _engine(sup: Supervisor, rank: int) -> tuple[Child | None, tuple[int, dict] | None]:
    if sup.phase != "serving":
        return None, (409, {"error": f"the node is {sup.phase}; drain, undrain and retire act on a serving node"})
    if sup.cfg.uses_ray:
        return None, (409, {"error": "ranks placed by Ray (--data-parallel-backend ray) cannot be drained"})
    child = sup.children.get(f"engine-dp{rank}")
    if child is None:
        local = list(sup.cfg.local_ranks)
        return None, (404, {"error": f"rank {rank} is not on this node (its ranks: {local[0]}-{local[-1]}); ask the rank's node"})
    return child, None


def stop(sup: Supervisor, rank: int, reason: str) -> tuple[int, dict]:
    """Drain (reason DRAINED_REASON) or retire (RETIRED_REASON) a local rank."""
    child, refused = _engine(sup, rank)
    if refused:
        return refused
    word = "retired" if reason == RETIRED_REASON else "drained"
    if child.drained == reason:
        return 200, {"rank": rank, "state": child.state.value, "detail": f"already {word}"}
    child.drained = reason
    sup.log.info("retiring rank" if word == "retired" else "draining rank", child=child.name, pid=child.pid, state=child.state.value)
    if child.proc is not None and child.proc.returncode is None:
        if child.state != ChildState.STOPPING:
            child.state = ChildState.STOPPING
            child.deadline = sup.clock() + sup.cfg.kill_grace_s
            sup.signal_child(child, DRAIN_SIGNAL)
        if reason == RETIRED_REASON:
            # Out of membership now (within the second), not after the engine's exit; settle()
            # says it again once no engine of it can report any more (a late report's re-registration).
            sup.take_out_of_routing(child, reason)
        return 202, {"rank": rank, "state": "retiring" if word == "retired" else "draining"}
    settle(sup, child)  # not running (drained, waiting to restart, or given up on): done now
    return 200, {"rank": rank, "state": word}


def undrain(sup: Supervisor, rank: int) -> tuple[int, dict]:
    child, refused = _engine(sup, rank)
    if refused:
        return refused
    if not child.drained:
        return 200, {"rank": rank, "state": child.state.value, "detail": "not drained"}
    child.drained = ""
    sup.log.info("undraining rank", child=child.name)
    if child.state == ChildState.DRAINED:
        child.state = ChildState.BACKOFF  # the next tick starts it
        child.next_start_at = sup.clock()
        child.gave_up = ""
    else:
        child.restart_requested = True  # still stopping: its exit restarts it whatever the policy
    return 202, {"rank": rank, "state": "starting"}


def settle(sup: Supervisor, child: Child) -> None:
    """A drained (or retired) child's process is gone: it stays down until undrain. A
    retired rank's RankDown, sent only now that no engine can report for it any more,
    takes it out of the cluster's membership as well."""
    child.state = ChildState.DRAINED
    child.proc = None
    sup.take_out_of_routing(child, child.drained)
    word = "retired" if child.drained == RETIRED_REASON else "drained"
    sup.log.info(f"rank {word}; it stays stopped until `dpserve undrain`", child=child.name)


# ---------------------------------------------------------------- the health port's handlers


class DrainEndpoints:
    """POST /drain, /undrain and /retire with {"rank": R} (/retire also {"node": true}:
    every rank of this node), /rolling-restart with {"ranks": true}: checked here,
    applied by the loop."""

    def __init__(self, post, key_file: str) -> None:
        self.post = post
        self.token = admin_token(key_file) if key_file else ""

    def add_routes(self, app: web.Application) -> None:
        for verb in VERBS:
            app.router.add_post(f"/{verb}", self._handler(verb))

    def _handler(self, verb: str):
        async def handle(request: web.Request) -> web.Response:
            return await self._ask(request, verb)

        return handle

    def _refusal(self, request: web.Request) -> web.Response | None:
        if self.token:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return _json({"error": "a valid admin token is required (dpserve drain --data-parallel-key-file KEY)"}, 401)
            return None
        if not _is_loopback(request.remote):
            return _json({"error": "drain, undrain and retire are accepted from this machine only (or with a data-parallel key file)"}, 403)
        return None

    async def _ask(self, request: web.Request, verb: str) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        try:
            body = await request.json()
            if verb == "rolling-restart":
                if body.get("ranks") is not True:
                    raise ValueError  # the ranks are all it restarts (API servers: SIGHUP)
                rank = None
            elif verb == "retire" and body.get("node") is True and "rank" not in body:
                rank = None
            else:
                rank = body["rank"]
                if type(rank) is not int or rank < 0:
                    raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError):
            shape = {"retire": '{"rank": R} or {"node": true}', "rolling-restart": '{"ranks": true}'}.get(verb, '{"rank": R}')
            return _json({"error": f"the body must be JSON {shape} (a rank >= 0)", "param": "ranks" if verb == "rolling-restart" else "rank"}, 400)
        reply = asyncio.get_running_loop().create_future()
        self.post(DrainRequested(verb, rank, reply))
        try:
            status, answer = await asyncio.wait_for(reply, REPLY_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _json({"error": "the supervisor's loop did not answer in time"}, 503)
        return _json(answer, status)


def _json(obj, status: int) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")
