"""`scaletui serve`: flags -> ServerShape -> engines -> scheduler -> aiohttp, until SIGTERM/SIGINT.

Every config error is found before the port is bound (the engine plan on these devices and the
memory it needs included) and exits 2 with one line naming the flag and the fix; an engine
that fails to build or compile later exits 1 with the reason. Prints the URL line, then the
model's parameters, precision, weight and KV-cache bytes on stdout; logs compile progress and a
summary per interval (running, waiting, slots, tokens/s) to stderr, as vLLM's stat logger
does. JAX is imported only for the real engine, after `--host-devices` has set XLA's host
device count.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from aiohttp import web

from scaletui import xla_env
from scaletui.serve.engine import memory
from scaletui.serve.engine.engine_api import LOGPROBS_MODES, PROCESSED, EngineFactory
from scaletui.serve.http.api import SCHEDULER, WATCHDOG, ApiSettings, create_app
from scaletui.serve.http.connections import quiet_accept_errors, raise_fd_limit, start_site
from scaletui.serve.http.tokenizer import Tokenizer, load_tokenizer
from scaletui.serve.multihost import launch as multihost
from scaletui.serve.scheduling.scheduler import Scheduler
from scaletui.serve.scheduling.speed import find_speed_model
from scaletui.shape import ConfigError, ServerShape
from scaletui.shape_flags import add_flags
from scaletui.specs import ModelSpec, SpecError, hf_config, load_model

log = logging.getLogger("scaletui.serve")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletui serve", description=__doc__.splitlines()[0])
    kv = add_flags(p)  # the server's shape: one flag per ServerShape field
    kv.add_argument(
        "--kv-memory-fraction",
        type=float,
        help="size the KV pages to this fraction (0-1] of the memory the weights leave",
    )
    a = p.add_argument
    a(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template for /v1/chat/completions, instead of the tokenizer's own",
    )
    a("--host", default="127.0.0.1", help="bind address (non-loopback: /admin needs a token)")
    a("--port", type=int, default=8000, help="TCP port (0 = any free port)")
    a("--admin-token", help="bearer token for /admin/* (required on non-loopback binds)")
    a("--drain-timeout", type=float, default=60.0, help="reconfigure: abort requests after (s)")
    a("--log-interval", type=float, default=10.0, help="seconds between summary lines (0 = off)")
    a(
        "--header-timeout",
        type=float,
        default=10.0,
        help="close a new connection whose request has not arrived after S seconds",
    )
    a("--body-timeout", type=float, default=30.0, help="408 for a body not received within S s")
    a(
        "--keepalive-timeout",
        type=float,
        default=75.0,
        help="close a connection idle between requests after S seconds",
    )
    a(
        "--served-model-name",
        metavar="NAME",
        help="the model name /v1/models lists and requests use (default: --model as given)",
    )
    a(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default=PROCESSED,
        help="what logprobs score: the logits a sampled token was drawn from (after temperature, "
        "top-k, top-p) or the model's raw logits (vLLM v1's default); the same when greedy",
    )
    a(
        "--fit",
        default="auto",
        metavar="auto|PATH|none",
        help="the engine fit each call is priced by, for the speed factor (/metrics, /stats "
        "speed): auto = the stored fit for this shape on this host",
    )
    a(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="serve at once: each shape compiles on its first call (that request waits), not "
        "all before serving (development, tests; one process only)",
    )
    a("--host-devices", type=int, help="JAX CPU: number of virtual host devices (XLA flag)")
    a("--fake", action="store_true", help="serve the hand-computable FakeEngine (tests, demos)")
    a("--fake-step-ms", type=float, default=2.0, help="--fake: milliseconds per decode step")
    multihost.add_flags(p)
    return p


def engine_factory(
    args: argparse.Namespace,
    tok: Tokenizer,
    eos_ids: tuple[int, ...],
    cluster: multihost.Cluster | None = None,
) -> EngineFactory:
    """The real or fake engine factory, never sampling past the tokenizer. Its `check` raises
    ConfigError for a sharding the devices cannot hold or a config that does not fit in their
    memory, so a bad flag fails before binding and a bad reconfiguration before draining.
    """
    if args.fake:
        from scaletui.serve.engine.fake_engine import FakeEngineFactory

        step = args.fake_step_ms / 1e3
        return FakeEngineFactory(tok.vocab_size, eos_ids, step_s=step, prefill_s=step)
    from scaletui.serve.engine.build import JaxEngineFactory  # imports JAX: after the XLA flags

    place = multihost.placed_devices(cluster) if cluster else None  # tp within a process
    return JaxEngineFactory(tok.vocab_size, eos_ids, args.logprobs_mode, place)


def checkpoint_defaults(args: argparse.Namespace, model: ModelSpec) -> None:
    """`--model DIR` (an HF checkpoint): its safetensors and tokenizer.json, unless --weights
    and --tokenizer name others (the fake engine reads no weights)."""
    folder = model.extra.get("checkpoint_dir")
    if not folder:
        return
    if args.weights is None and not args.fake:
        args.weights = folder
    if args.tokenizer is None:
        if not (Path(folder) / "tokenizer.json").is_file():
            raise ValueError(f"{folder} has no tokenizer.json: pass --tokenizer FILE")
        args.tokenizer = folder


def eos_ids_for(model: ModelSpec, tok: Tokenizer) -> tuple[int, ...]:
    """The ids that end a sequence: the tokenizer's EOS and, for a checkpoint directory, the
    `eos_token_id`s of its generation_config.json (else config.json), as vLLM stops on both."""
    folder = model.extra.get("checkpoint_dir")
    ids = [tok.eos_id] if tok.eos_id >= 0 else []
    ids += hf_config.eos_ids(folder) if folder else ()
    return tuple(dict.fromkeys(ids))


def check_weights(config: ServerShape) -> None:
    """A checkpoint's tensors against the spec, before the port is bound: a missing tensor or
    a shape the config does not give is a ValueError naming it, not a server that half-starts."""
    if config.weights:
        from scaletui.serve.weights.checkpoint import Checkpoint  # imports JAX: after the flags

        Checkpoint(config.weights, config.model).check()


def served_default(ref: str, model: ModelSpec) -> str:
    """The served name without --served-model-name: a checkpoint directory's `--model` as
    given (vLLM's default), else the spec's name (a YAML file names its model)."""
    return ref if model.extra.get("checkpoint_dir") else model.name


def default_dtype(args: argparse.Namespace) -> str:
    """The compute dtype when --dtype is not given: f32 for the fake engine, else
    `build.default_compute_dtype` (bf16 on GPU/TPU and where the CPU's native kernels multiply
    bf16 pairs)."""
    if args.fake:
        return "f32"
    from scaletui.serve.engine.build import (
        default_compute_dtype,  # imports JAX: after the XLA flags
    )

    return default_compute_dtype(args.kernels, args.tp, args.dp, args.weight_dtype, args.kv_dtype)


def _listen(host: str, port: int) -> socket.socket:
    """Bind before the engines start, so a taken port fails at once, not after a compile."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return socket.create_server((host, port), family=info[0][0])


async def _serve(
    app: web.Application, sock: socket.socket, host: str, banner: str, details: str
) -> int:
    """Serve until SIGTERM/SIGINT (0) or until the engines fail to start (1)."""
    loop = asyncio.get_running_loop()
    quiet_accept_errors(loop)
    runner = await start_site(app, sock, app[WATCHDOG])
    bound = sock.getsockname()[1]
    print(f"scaletui serve: http://{host}:{bound}/v1  {banner}", flush=True)
    if details:
        print(f"scaletui serve: {details}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_until_started(app[SCHEDULER], stop))
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        watch.cancel()
        await runner.cleanup()
    return 1 if app[SCHEDULER].compile.get("state") == "failed" else 0


async def _until_started(sched: Scheduler, stop: asyncio.Event) -> None:
    """A server whose engines failed to build or compile stops, saying why (exit status 1)."""
    while sched.state in ("starting", "compiling"):
        await asyncio.sleep(0.1)
    if sched.state == "failed":
        print(
            f"scaletui serve: error: the engines failed to start: {sched.error}",
            file=sys.stderr,
            flush=True,
        )
        stop.set()


def _pages_from_fraction(config: ServerShape, fraction: float, fake: bool) -> ServerShape:
    """`--kv-memory-fraction`: kv_pages from the memory the devices have and the weights
    leave (the fake engine holds nothing: the default pages)."""
    if not 0 < fraction <= 1:
        raise ConfigError(
            "kv_memory_fraction", fraction, f"kv_memory_fraction must be in (0, 1], got {fraction}"
        )
    if fake:
        return config
    import jax  # after main() set XLA's host-device flags

    cap = memory.capacity(jax.devices())
    if cap is None:
        return config
    pages = memory.pages_that_fit(config, cap, fraction, config.dp)
    log.info("--kv-memory-fraction %g: %d KV pages per replica", fraction, pages)
    return dataclasses.replace(config, kv_pages=pages)


def warn_oversubscribed(host_devices: int) -> bool:
    """Warn when there are more virtual CPU devices than usable cores: XLA's CPU client runs
    at least one pool thread per device (a collective needs them all at once), so its ops and
    the native kernels split their work into more threads than cores (docs/serve.md,
    `--host-devices`, has the measured cost)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not cores or host_devices <= cores:
        return False
    log.warning(
        "--host-devices %d is more than the %d usable cores: XLA runs a thread per "
        "device, so every engine call shares %d cores among %d threads (a tp 1 decode "
        "runs up to 2x slower); use --host-devices %d or fewer unless tp x dp needs "
        "more",
        host_devices,
        cores,
        cores,
        host_devices,
        cores,
    )
    return True


def _error(message: str) -> int:
    print(f"scaletui serve: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    logging.getLogger("jax").setLevel(logging.WARNING)  # not "Unable to initialize backend"
    if args.host_devices:
        xla_env.set_host_devices(args.host_devices)
        warn_oversubscribed(args.host_devices)
    try:
        cluster = multihost.Cluster.from_args(args)
        if cluster and not args.warmup:
            return _error("--no-warmup is for one process: every process compiles before serving")
        if cluster:
            multihost.initialize(cluster)  # before anything else uses JAX
        model = load_model(args.model)
        checkpoint_defaults(args, model)
        config = ServerShape.from_args(args, model=model, dtype=args.dtype or default_dtype(args))
        if args.kv_memory_fraction is not None:
            config = _pages_from_fraction(config, args.kv_memory_fraction, args.fake)
        check_weights(config)
        tok = load_tokenizer(args.tokenizer, model.vocab_size, args.chat_template)
        factory = engine_factory(args, tok, eos_ids_for(model, tok), cluster)
        factory.check(config)  # the plan on these devices and its memory, before binding
        if args.fit not in ("auto", "none"):
            find_speed_model(config, args.fit)  # a --fit FILE that is not this shape's fit
    except ConfigError as e:
        return _error(e.flag_line())
    except (SpecError, ValueError, ImportError) as e:
        return _error(str(e))
    for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
        if not vars(args)[name] > 0:
            return _error(f"--{name.replace('_', '-')} must be > 0, got {vars(args)[name]}")
    if cluster and not cluster.leader:  # no HTTP: it runs the passes process 0 sends
        return multihost.follow(cluster, config, factory)
    try:
        sock = _listen(args.host, args.port)
    except OSError as e:  # the port is taken, or the address is not this host's
        return _error(f"cannot listen on {args.host}:{args.port}: {e}")
    before, after = raise_fd_limit()
    if after > before:
        log.debug("open-file limit raised from %d to %d", before, after)
    settings = ApiSettings(
        host=args.host,
        admin_token=args.admin_token,
        drain_timeout_s=args.drain_timeout,
        log_interval_s=args.log_interval,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        served_model_name=args.served_model_name or served_default(args.model, model),
    )
    if cluster:
        sched = multihost.lockstep(cluster, config, factory, fit=args.fit)
    else:
        sched = Scheduler(config, factory, fit=args.fit, warmup=args.warmup)
    app = create_app(sched, tok, settings)
    banner = (
        f"model {model.name}{' (fake engine)' if args.fake else ''}, slots {config.slots}, "
        f"tp {config.tp}, dp {config.dp}, {config.mode}"
    )
    details = "" if args.fake else memory.footprint(config).describe(config)
    rc = asyncio.run(_serve(app, sock, args.host, banner, details))
    if sched.state in ("starting", "compiling", "reconfiguring"):
        # XLA is compiling on a worker thread; tearing the interpreter down under it aborts
        log.info("stopped while %s; exiting without waiting for the compile", sched.state)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(rc)
    return rc
