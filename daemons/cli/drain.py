"""`dpserve drain`, `undrain` and `retire`: ask a node's supervisor, on its health port,
to take one of its ranks out of service (its requests move to other ranks), to
start it again, or to take it (or all of the node's) out of the cluster.

Owns only the HTTP call and its answer in words; the supervisor decides
(daemons/supervisor/draining.py). It never signals a process itself.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import click
from dpserve.daemons.cli.options import DEFAULTS

DEFAULT_URL = f"http://{DEFAULTS['supervisor_host']}:{DEFAULTS['supervisor_port']}"
_KEY_HELP = (
    "The deployment's --data-parallel-key-file: the admin token of a node that has one is derived from it"
    " (a node without one accepts these verbs from its own machine only)."
)


def ask(url: str, verb: str, rank: int | None, key_file: str | None) -> tuple[int, dict]:
    """POST /{verb} {"rank": rank} ({"node": true} for None) to the supervisor at `url`:
    (HTTP status, JSON answer)."""
    from dpserve.daemons.supervisor.draining import admin_token

    headers = {"Content-Type": "application/json"}
    if key_file:
        headers["Authorization"] = f"Bearer {admin_token(key_file)}"
    body = {"rank": rank} if rank is not None else {"ranks": True} if verb == "rolling-restart" else {"node": True}
    req = urllib.request.Request(f"{url.rstrip('/')}/{verb}", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.load(exc)
        except ValueError:
            return exc.code, {"error": exc.reason}


def _run(verb: str, rank: int | None, url: str, key_file: str | None) -> None:
    what = f"rank {rank}" if rank is not None else "the node"
    try:
        status, body = ask(url, verb, rank, key_file)
    except (urllib.error.URLError, OSError) as exc:
        click.echo(f"cannot reach the supervisor at {url}: {exc}", err=True)
        sys.exit(1)
    if status >= 400:
        click.echo(f"{verb} {what}: refused ({status}): {body.get('error', body)}", err=True)
        sys.exit(1)
    if verb == "rolling-restart":
        click.echo(f"restarting ranks {', '.join(map(str, body['ranks']))} one at a time (see dpserve status)")
        return
    for one in body.get("ranks", [body]):
        detail = f" ({one['detail']})" if one.get("detail") else ""
        click.echo(f"rank {one.get('rank')}: {one.get('state')}{detail}")


_url = click.argument("url", required=False, default=DEFAULT_URL)
_rank = click.option("--rank", required=True, type=click.IntRange(0), help="The DP rank (on the node at URL).")
_key = click.option("--data-parallel-key-file", "key_file", envvar="DPSERVE_DATA_PARALLEL_KEY_FILE", type=click.Path(exists=True, dir_okay=False), help=_KEY_HELP)


@click.command("drain")
@_url
@_rank
@_key
def drain(url: str, rank: int, key_file: str | None) -> None:
    """Stop a rank now: its in-flight requests move to other ranks, and it stays
    stopped (not restarted) until `dpserve undrain` or a restart of its node."""
    _run("drain", rank, url, key_file)


@click.command("undrain")
@_url
@_rank
@_key
def undrain(url: str, rank: int, key_file: str | None) -> None:
    """Start a drained rank again; it is routed to once it is ready."""
    _run("undrain", rank, url, key_file)


@click.command("retire")
@_url
@click.option("--rank", type=click.IntRange(0), default=None, help="The DP rank to retire (on the node at URL).")
@click.option("--node", is_flag=True, help="Retire every rank of the node at URL (before it is stopped and removed).")
@_key
def retire(url: str, rank: int | None, node: bool, key_file: str | None) -> None:
    """Take a rank (or every rank of a node) out of the cluster: drained as by `dpserve
    drain`, then out of every node's membership, so the node can be stopped and removed.
    A new worker with the same ranks (or `dpserve undrain`) brings them back."""
    if (rank is None) == (not node):
        raise click.UsageError("give exactly one of --rank R and --node")
    _run("retire", rank, url, key_file)


@click.command("rolling-restart")
@_url
@click.option("--ranks", is_flag=True, required=True, help="Restart the node's ranks (API servers: systemctl reload, SIGHUP).")
@_key
def rolling_restart(url: str, ranks: bool, key_file: str | None) -> None:
    """Restart the node's ranks one at a time: each stops at once, its requests move to the
    other ranks, and the next stops once it serves again."""
    _run("rolling-restart", None, url, key_file)
