"""`dpserve install-units`: put the systemd units, the example env file and the GPU drop-in in place.

Owns copying the canonical files of units/ (ExecStart rewritten to the
dpserve being installed) and creating the `dpserve` system user. Idempotent:
a file is rewritten only when its content differs. It never writes an
instance's own env file, and never starts, stops or enables a unit.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click

UNIT_FILES = ("dpserve-head@.service", "dpserve-worker@.service")
ENV_EXAMPLE = "dpserve.env.example"
GPU_DROPIN = "gpu-access.conf"
# The path the canonical units name in ExecStart; replaced by --dpserve-bin.
CANONICAL_BIN = "/usr/local/bin/dpserve"
SERVICE_USER = "dpserve"
_EXEC_LINE = re.compile(r"^(ExecStart=|ExecReload=|ExecStop=|ExecStartPre=|ExecStartPost=)(.*)$", re.M)


def units_source_dir() -> Path:
    """Where the canonical unit files are: the checkout's units/ beside daemons/ (editable
    install; it wins, so edits apply at once), else a wheel's data files in PREFIX/share/dpserve/units."""
    candidates = [
        Path(__file__).resolve().parents[2] / "units",
        Path(sys.prefix) / "share" / "dpserve" / "units",
    ]
    for path in candidates:
        if all((path / name).is_file() for name in (*UNIT_FILES, ENV_EXAMPLE, GPU_DROPIN)):
            return path
    raise click.ClickException(
        "cannot find the dpserve unit files; looked in " + ", ".join(str(p) for p in candidates)
        + ". Install dpserve from a checkout (pip install -e .) or a wheel that ships share/dpserve/units."
    )


def default_dpserve_bin() -> str:
    """The dpserve script of the running interpreter's environment, else the one on PATH."""
    own = Path(sys.prefix) / "bin" / "dpserve"
    if own.is_file() and os.access(own, os.X_OK):
        return str(own)
    found = shutil.which("dpserve")
    if found:
        return os.path.abspath(found)
    return CANONICAL_BIN


def render_unit(text: str, dpserve_bin: str) -> str:
    """The canonical unit with every Exec line's dpserve path replaced by `dpserve_bin`."""
    if not os.path.isabs(dpserve_bin):
        raise click.BadParameter(f"{dpserve_bin!r} is not an absolute path", param_hint="--dpserve-bin")
    if any(c.isspace() for c in dpserve_bin) or '"' in dpserve_bin or "\\" in dpserve_bin:
        raise click.BadParameter(f"{dpserve_bin!r}: whitespace, quotes and backslashes are not supported", param_hint="--dpserve-bin")
    escaped = dpserve_bin.replace("%", "%%")  # systemd would expand %-specifiers
    return _EXEC_LINE.sub(lambda m: m.group(1) + m.group(2).replace(CANONICAL_BIN, escaped), text)


def _write(path: Path, content: str, mode: int = 0o644) -> bool:
    """Write `content` when it differs; returns whether anything changed."""
    try:
        if path.read_text() == content and (path.stat().st_mode & 0o777) == mode:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(content)
    tmp.chmod(mode)
    os.replace(tmp, path)
    return True


def _ensure_user() -> str:
    try:
        pwd.getpwnam(SERVICE_USER)
        return "exists"
    except KeyError:
        pass
    nologin = next((p for p in ("/usr/sbin/nologin", "/sbin/nologin") if os.path.exists(p)), "/bin/false")
    subprocess.run(
        ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/var/lib/dpserve",
         "--shell", nologin, "--comment", "dpserve daemon", SERVICE_USER],
        check=True, capture_output=True, text=True,
    )
    return "created"


@click.command("install-units")
@click.option("--prefix", default="/", show_default=True, type=click.Path(file_okay=False),
              help="Root to install under: PREFIX/etc/systemd/system and PREFIX/etc/dpserve.")
@click.option("--dpserve-bin", default=None, help="dpserve executable written into ExecStart  [default: this environment's dpserve]")
@click.option("--create-user/--no-create-user", default=True, show_default=True,
              help=f"Create the '{SERVICE_USER}' system user (only as root with --prefix /).")
@click.option("--gpu", is_flag=True, help="Also enable the GPU drop-in (device access to /dev/nvidia*) for both units.")
@click.option("--no-reload", is_flag=True, help="Skip `systemctl daemon-reload` after changing units.")
def install_units(prefix: str, dpserve_bin: str | None, create_user: bool, gpu: bool, no_reload: bool) -> None:
    """Install the systemd units, /etc/dpserve/example.env and the GPU drop-in (idempotent)."""
    src = units_source_dir()
    dpserve_bin = dpserve_bin or default_dpserve_bin()
    root = Path(prefix)
    unit_dir = root / "etc" / "systemd" / "system"
    conf_dir = root / "etc" / "dpserve"
    changed_units = False
    for name in UNIT_FILES:
        path = unit_dir / name
        changed = _write(path, render_unit((src / name).read_text(), dpserve_bin))
        changed_units |= changed
        click.echo(f"{'installed' if changed else 'unchanged'} {path}")
    extras = [(conf_dir / "example.env", ENV_EXAMPLE), (conf_dir / GPU_DROPIN, GPU_DROPIN)]
    if gpu:
        extras += [(unit_dir / f"{name}.d" / GPU_DROPIN, GPU_DROPIN) for name in UNIT_FILES]
    for path, name in extras:
        changed = _write(path, (src / name).read_text())
        changed_units |= changed and path.suffix == ".conf" and path.parent != conf_dir
        click.echo(f"{'installed' if changed else 'unchanged'} {path}")
    is_root_fs = os.path.realpath(prefix) == "/"
    if create_user:
        if is_root_fs and os.geteuid() == 0:
            click.echo(f"user {SERVICE_USER}: {_ensure_user()}")
        else:
            click.echo(f"user {SERVICE_USER}: not created (needs root and --prefix /)")
    if changed_units and is_root_fs and not no_reload and os.path.isdir("/run/systemd/system"):
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        click.echo("systemd: daemon-reload done")
    click.echo(f"next: cp {conf_dir / 'example.env'} {conf_dir / 'NAME.env'}, edit it, then "
               "systemctl enable --now dpserve-head@NAME")
