"""The `dpserve` command line (click).

Every node option (cli/options.py) can also come from the environment as
DPSERVE_<OPTION> (upper case, dashes as underscores), which is how the systemd
units read /etc/dpserve/<instance>.env. Flag names follow vLLM's where vLLM
has one; dpserve's own supervisor flags are --supervisor-*; seconds end in -s.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import click
from click.core import ParameterSource
from dpserve.daemons.cli.options import DEFAULTS, FIELDS, FLAG_OF, HEAD, RAY, SERVE, WORKER, given, options
from dpserve.daemons.config import ServeConfig
from dpserve.engine.backends.vllm.args import parse_engine_args
from dpserve.engine.common.procutil import EXIT_CONFIG, die_with_parent, raise_fd_limit, set_process_name

DEMO_MODEL_NAME = "dpserve-demo"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dpserve")
def main() -> None:
    """dpserve: data-parallel LLM serving with an OpenAI-compatible API."""


def _build_config(role: str, model: str | None, opts: dict, given: set[str], log) -> ServeConfig:
    """ServeConfig from what the user gave; everything else keeps the struct's default."""
    values = {name: opts[name] for name in given if name in FIELDS}
    model, values["served_model_name"] = _model(model, opts["served_model_name"], log)
    dp = opts["data_parallel_size"]
    local = opts.get("data_parallel_size_local") or (dp if role in ("serve", "head") else None)
    if local is None:
        raise ValueError("give --data-parallel-size-local: how many of the ranks run on this worker")
    modes = [m for m in ("hybrid", "external", "global") if opts.get("lb_" + m)]
    if len(modes) > 1:
        raise ValueError("choose one load-balancing mode: " + ", ".join(modes) + " were all given")
    ray = opts.get("data_parallel_backend") == "ray"
    _refuse_without_ray(role, ray, given)
    if not opts.get("data_parallel_address"):
        values.pop("data_parallel_address", None)
        if ray:  # '' until the supervisor learns this node's address in the cluster
            values["data_parallel_address"] = ""
    headless = bool(opts.get("headless"))
    values.update(
        model=model,
        role=role,
        **_api_keys(opts),
        engine_args=parse_engine_args(opts["engine_arg"]),
        data_parallel_size_local=local,
        lb_mode=modes[0] if modes else "internal",
        # a headless worker runs no API server, whatever DPSERVE_API_SERVER_COUNT says
        api_server_count=0 if headless else opts["api_server_count"] or local,
    )
    return ServeConfig(**values)


def _model(model: str | None, served: str | None, log) -> tuple[str, str]:
    """The model directory (the demo model's when none is given) and the name clients send."""
    if model is None:
        from dpserve.engine.testing.demo_model import ensure_demo_model

        log.info("no model given; serving the built-in demo model")
        model = ensure_demo_model()
        served = served or DEMO_MODEL_NAME
    # Never the full local path: /v1/models would show it to every client.
    return model, served or os.path.basename(os.path.normpath(model)) or model


def check_sampling_defaults(cfg: ServeConfig, log) -> None:
    """--generation-config / --override-generation-config read and checked before any child starts
    (ValueError naming the file or flag); what they change is said once, as vLLM does."""
    from dpserve.daemons.api.sampling_defaults import load

    defaults = load(cfg.model, cfg.generation_config, cfg.override_generation_config)
    if changed := defaults.differences():
        log.info("requests that leave these unset sample with the model's recommended values "
                 "(--generation-config vllm: the neutral ones)", source=cfg.generation_config,
                 **{f"default_{k}": v for k, v in changed.items()})


def check_tokenizer(model: str) -> None:
    """ValueError naming what is missing, before any child starts: an API server that
    cannot load the tokenizer would fail only after the engines began loading, and
    its exit would not say 'configuration'. (ServeConfig.validate checks the
    directory and its config.json.)"""
    from dpserve.daemons.api.tokenizer import TextTokenizer

    try:
        TextTokenizer.from_dir(model)
    except FileNotFoundError:
        raise ValueError(f"the model directory has no tokenizer.json (only fast tokenizers are supported): "
                         f"{os.path.join(model, 'tokenizer.json')}") from None
    except ValueError:
        raise
    except Exception as exc:  # e.g. a chat template that does not compile
        raise ValueError(f"cannot load the tokenizer of {model}: {type(exc).__name__}: {exc}") from None


# `dpserve serve` runs one node's own processes: without Ray, no inter-node traffic.
_TCP_ONLY = ("data_parallel_address", "data_parallel_rpc_port", "data_parallel_api_rpc_port_base", "key_file")


def _refuse_without_ray(role: str, ray: bool, given: set[str]) -> None:
    """Options that would do nothing are refused, not ignored."""
    if ray:
        return
    names = [spec.name for spec in RAY if spec.name != "data_parallel_backend"]
    if role == "serve":
        names += _TCP_ONLY
    refused = [FLAG_OF[name] for name in names if name in given]
    if refused:
        raise ValueError(f"{', '.join(refused)} apply to --data-parallel-backend ray only")


def _api_keys(opts: dict) -> dict:
    """--api-key, or --api-key-file (not both): its first line, or a TOML file of tenants
    (checked now, read again by each API server; the config carries digests, never keys)."""
    key, path = opts["api_key"], opts.get("api_key_file")
    if not path:
        return {"api_key": _check_key(key, "--api-key")}
    if key:
        raise ValueError("give --api-key or --api-key-file, not both")
    from dpserve.daemons.api.tenants.keyfile import read_key_file

    key, book = read_key_file(path)
    if book is None:
        return {"api_key": key}
    keys = [(d.hex(), t) for d, t in zip(book.digests, book.owners)]
    return {"api_key": None, "tenants_file": os.path.abspath(path), "tenant_keys": keys}


def _check_key(key: str | None, source: str) -> str | None:
    """Refused, not warned about: a key no client can send leaves every /v1/ route a 401.
    HTTP header values are bytes that clients write as ASCII (httpx, and so the official
    openai client, raises UnicodeEncodeError on anything else; RFC 9110 allows only
    visible ASCII, space and tab in a field value), and a space would split the
    'Bearer <key>' credential."""
    if key is None:
        return None
    bad = next((ch for ch in key if not "!" <= ch <= "~"), None)
    if bad is not None:
        raise ValueError(f"{source}: the API key holds {bad!r} (U+{ord(bad):04X}); a key must be printable ASCII "
                         "without spaces (clients send it in an HTTP header)")
    return key


def _run(role: str, model: str | None, opts: dict) -> None:
    from dpserve.engine.common.logs import setup_logging

    ctx = click.get_current_context()
    user_gave, deprecated = given(ctx, opts)
    log = setup_logging("supervisor", opts["log_level"])
    for old, new in deprecated:
        log.warning(f"{old} is deprecated and goes in the next release: use {new}", deprecated=old, use=new)
    set_process_name("dpserve")  # `pgrep -x dpserve` finds the supervisor however it was started
    soft, _ = raise_fd_limit()
    if soft < 4096:
        log.warning("the open-file limit is low; raise LimitNOFILE / ulimit -Hn", soft_limit=soft)
    if ctx.get_parameter_source("api_key") == ParameterSource.COMMANDLINE:
        log.warning("--api-key on the command line shows in ps; use --api-key-file or DPSERVE_API_KEY")
    # Children get the key in their typed config; none of them needs it in its environment.
    os.environ.pop("DPSERVE_API_KEY", None)
    if os.environ.get("DPSERVE_DIE_WITH_PARENT"):
        # For harnesses (tests): if whoever started us dies, stop cleanly too.
        die_with_parent(os.getppid(), signal.SIGTERM)
    ports_file = opts.pop("ports_file")
    try:
        cfg = _build_config(role, model, opts, user_gave, log)
        cfg.validate()
        if cfg.runs_api_servers:  # a headless worker loads no tokenizer
            check_tokenizer(cfg.model)
            check_sampling_defaults(cfg, log)
    except ValueError as exc:
        log.error("invalid configuration", error=str(exc))
        sys.exit(EXIT_CONFIG)
    from dpserve.daemons.supervisor.core import Supervisor

    sys.exit(asyncio.run(Supervisor(cfg, log, ports_file=ports_file).run()))


@main.command()
@click.argument("model", required=False, envvar="DPSERVE_MODEL")
@options(SERVE)
def serve(model, **opts) -> None:
    """Serve MODEL on this node (a local Hugging Face directory; default: the built-in demo model)."""
    _run("serve", model, opts)


@main.command()
@click.argument("model", required=False, envvar="DPSERVE_MODEL")
@options(HEAD)
def head(model, **opts) -> None:
    """Run the head node of a multi-node deployment: coordinator, ranks 0..size-local-1, API servers."""
    _run("head", model, opts)


@main.command()
@click.argument("model", required=False, envvar="DPSERVE_MODEL")
@options(WORKER)
def worker(model, **opts) -> None:
    """Run a worker node: its ranks join the head at --data-parallel-address:--data-parallel-rpc-port."""
    _run("worker", model, opts)


@main.command("demo-model")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True,
              help="tiny: 1 M parameters (fast tests, make demo); small: a random-weight 135M-class Llama "
                   "(30 layers, hidden 576, 9/3 heads, vocab 49,152, 8k context) for realistic engine costs.")
@click.option("--tokenizer", type=click.Choice(["bytelevel", "metaspace"]), default="bytelevel", show_default=True,
              help="bytelevel: GPT-2/Llama-3 style BPE; metaspace: SentencePiece style (Llama-2, Mistral, Gemma: "
                   "U+2581 for spaces, byte fallback), tiny size only.")
@click.option("--chat-template", "chat", type=click.Choice(["plain", "tools"]), default="plain", show_default=True,
              help="plain: ChatML; tools: Hermes/Qwen-style, with tools, <tool_call> tags and a <think> block.")
def demo_model(directory: str, size: str, tokenizer: str, chat: str) -> None:
    """Write a built-in random-weight Llama demo model (weights, tokenizer, chat template) to DIRECTORY."""
    from dpserve.engine.testing.demo_model import create_demo_model

    try:
        path = create_demo_model(directory, size, tokenizer, chat)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(path)


@main.command("sim-engine", context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
              add_help_option=False)
@click.pass_context
def sim_engine(ctx) -> None:
    """Simulated ranks for control-plane tests and benchmarks: NO MODEL, never a way to serve (--help for options)."""
    from dpserve.engine.testing.sim import main as sim_main

    sys.exit(sim_main(ctx.args))


@main.command()
@click.argument("url", required=False, default=f"http://{DEFAULTS['supervisor_host']}:{DEFAULTS['supervisor_port']}")
@click.option("--json", "as_json", is_flag=True, help="Print the raw /status JSON.")
@click.option("--watch", "-w", is_flag=True, help="Refresh in place until Ctrl-C (for a rollout).")
@click.option("--interval-s", "interval", default=2.0, type=click.FloatRange(0.2), show_default=True, help="Seconds between refreshes with --watch.")
@click.option("--interval", "old_interval", default=None, type=click.FloatRange(0.2), hidden=True)
def status(url: str, as_json: bool, watch: bool, interval: float, old_interval: float | None) -> None:
    """Show every rank of the cluster and this node's children, from a supervisor's /status."""
    from dpserve.daemons.cli.status_table import render

    if old_interval is not None:  # a terminal's tool: the note goes to stderr, not a journal
        click.echo("--interval is deprecated and goes in the next release: use --interval-s", err=True)
        if click.get_current_context().get_parameter_source("interval") != ParameterSource.COMMANDLINE:
            interval = old_interval
    target = url.rstrip("/")
    if not target.endswith("/status"):
        target += "/status"

    def fetch() -> dict:
        with urllib.request.urlopen(target, timeout=5) as resp:
            data = json.load(resp)
        if not as_json and data.get("port"):  # busiest tenants: the node's API servers know the cluster's
            data["tenants"] = _tenants(urllib.parse.urlsplit(target).hostname, data["port"])
        return data

    if not watch:
        try:
            data = fetch()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            click.echo(f"cannot read {target}: {exc}", err=True)
            sys.exit(1)
        click.echo(json.dumps(data, indent=2) if as_json else render(data))
        return
    # Ctrl-C stops the watch even where SIGINT came ignored (a shell's background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            try:
                screen = render(fetch())
            except (urllib.error.URLError, OSError, ValueError) as exc:
                screen = f"cannot read {target}: {exc}"  # keep watching: the node may be restarting
            text = f"{time.strftime('%H:%M:%S')}  {target}  (every {interval:g} s, Ctrl-C to stop)\n{screen}"
            # Cursor home, each line cleared to its end, then the rest of the
            # screen: redrawn in place without the flicker of a full clear.
            click.echo("\x1b[H" + "\x1b[K\n".join(text.split("\n")) + "\x1b[K\n\x1b[J", nl=False)
            sys.stdout.flush()  # each screen whole, even through a pipe (tee, a log)
            time.sleep(interval)
    except KeyboardInterrupt:
        click.echo()


def _tenants(host: str | None, port: int) -> list[dict]:
    """Tenants' cluster-wide figures from an API server's /metrics; none when it cannot say."""
    from dpserve.daemons.cli.status_table import tenants_from_metrics

    try:
        with urllib.request.urlopen(f"http://{host or '127.0.0.1'}:{port}/metrics", timeout=2) as resp:
            return tenants_from_metrics(resp.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return []


from dpserve.daemons.cli.drain import drain, retire, rolling_restart, undrain  # noqa: E402
from dpserve.daemons.cli.install import install_units  # noqa: E402

main.add_command(install_units)
main.add_command(drain)
main.add_command(undrain)
main.add_command(retire)
main.add_command(rolling_restart)


if __name__ == "__main__":
    main()
