"""The preamble every benchmark script shares, and the plain-text table it prints.

Run a benchmark with the venv's Python (`make setup` builds it), from the
repository root: `.venv/bin/python benchmarks/NAME.py --help`. A script does
`args, run = begin(parser(__doc__, ...), argv)`: its --help is its docstring,
SIGTERM (e.g. from `timeout`) unwinds through `finally` so every server it
started is stopped (benchmarks/nodes.py), and `run.log` / `run.info()` say
what ran where. The demo model is built once into a cache folder
(`ensure_demo_model`); vLLM's interpreter comes from its own venv
(`vllm_python`). Nothing here starts a server or imports dpserve's heavy parts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what `make setup-vllm` builds (benchmarks/setup_vllm.sh)
DEFAULT_VLLM_VENV = str(ROOT / ".venv-vllm")


# ----------------------------------------------------------------- arguments


def parser(doc: str | None, *, model_dir: bool = False, json: bool = False, vllm_venv: bool = False, prog: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser whose --help shows the script's docstring, with the
    options most benchmarks share, each only when asked for."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if model_dir:
        p.add_argument("--model-dir", default=None, help="demo model dir (default: a cache dir; built if missing)")
    if vllm_venv:
        p.add_argument("--vllm-venv", default=None, help=f"vLLM's venv (default: $DPSERVE_VLLM_VENV or {DEFAULT_VLLM_VENV})")
    if json:
        p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    return p


@dataclass
class Run:
    """One benchmark run: its arguments, where its progress goes, what it ran on."""

    args: argparse.Namespace
    date: str

    def log(self, msg: str) -> None:
        """Progress: to stderr when stdout is kept for --json."""
        print(msg, file=sys.stderr if getattr(self.args, "json", False) else sys.stdout, flush=True)

    def info(self, **extra) -> dict:
        """The header every JSON result starts with: date, machine, argv, and `extra`."""
        return {"date": self.date, "machine": machine_info(), "argv": sys.argv[1:], **extra}


def begin(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Run]:
    """Parse the arguments (--help exits here), then make SIGTERM a clean exit."""
    args = p.parse_args(argv)
    exit_on_sigterm()
    return args, Run(args, datetime.datetime.now().astimezone().isoformat(timespec="seconds"))


def exit_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from `timeout`) into SystemExit, so that `finally`
    blocks and the atexit hook stop every server this process started."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


# ----------------------------------------------------------------- models and interpreters


def ensure_demo_model(directory: str | None = None) -> str:
    """The demo model via `dpserve demo-model DIR` (a no-op once it is complete)."""
    if directory is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "dpserve-bench", "demo-model")
    if not os.path.isfile(os.path.join(directory, "model.safetensors")):
        subprocess.run([sys.executable, "-m", "dpserve.daemons.cli.main", "demo-model", directory],
                       check=True, stdout=subprocess.DEVNULL)
    return os.path.abspath(directory)


def vllm_python(venv: str | None) -> str | None:
    """The vLLM venv's python if vLLM is installed there, else None."""
    venv = venv or os.environ.get("DPSERVE_VLLM_VENV") or DEFAULT_VLLM_VENV
    py = os.path.join(venv, "bin", "python")
    if not os.path.isfile(os.path.join(venv, "bin", "vllm")) or not os.access(py, os.X_OK):
        return None
    probe = subprocess.run([py, "-c", "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('vllm') else 1)"],
                           capture_output=True, timeout=60)
    return py if probe.returncode == 0 else None


def vllm_venv_or_say_why(venv: str | None) -> str | None:
    """The folder of a venv with vLLM installed (--vllm-venv, else $DPSERVE_VLLM_VENV,
    else DEFAULT_VLLM_VENV), or None after printing why there is none and how to get one."""
    py = vllm_python(venv)
    if py is None:
        shown = venv or os.environ.get("DPSERVE_VLLM_VENV") or DEFAULT_VLLM_VENV
        print(f"vLLM is not installed in {shown} (no bin/vllm, or `import vllm` fails): skipping. "
              f"Install it with benchmarks/setup_vllm.sh {shown}, or pass --vllm-venv.")
        return None
    return str(Path(py).parents[1])


# ----------------------------------------------------------------- the machine


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def machine_info() -> dict:
    import psutil

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu_model": model,
            "mem_gib": round(psutil.virtual_memory().total / 2**30, 1), "loadavg": load_average()}


# ----------------------------------------------------------------- tables


def fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    table = [list(header)] + [list(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    out = []
    for j, line in enumerate(table):
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


if __name__ == "__main__":
    parser(__doc__, prog="benchmarks/common.py").parse_args()
    print(__doc__)
