"""Command-line launcher of keras_ps elastic jobs.

Server mode (implemented)::

    python -m keras_ps.elastic.launch --standalone --rdzv_endpoint=HOST:PORT \\
        [--token T | env KERAS_PS_RDZV_TOKEN] [--tls_cert F --tls_key F] \\
        [--gather_timeout S] [--keepalive_timeout S]

runs the rendezvous server until SIGTERM or SIGINT, then exits 0. Every
`RendezvousConfig` knob can also come from its ``KERAS_PS_RDZV_*`` variable;
flags win. Bad flags print a one-line error and exit 2.

Agent mode (see `keras_ps.elastic.agent`)::

    python -m keras_ps.elastic.launch --rdzv_endpoint=HOST:PORT \
        --nnodes=MIN:MAX --address=HOST:PORT [--monitor_interval=S] \
        [--max_restarts=N] [--token T] [--tls_root_cert F] -- TASK...

joins the rendezvous as the worker at --address, runs TASK, restarts it on
failure, and on SIGTERM stops it and leaves (exit 0). It exits 1 when TASK
failed more than --max_restarts times.
"""

import argparse
import logging
import os
import signal
import sys
import threading
from typing import List, Optional

from keras_ps.elastic import api
from keras_ps.elastic.client import TLS_ROOT_CERT_ENV
from keras_ps.elastic.client import read_root_cert
from keras_ps.elastic.client import tls_root_cert_or_env

logger = logging.getLogger(__name__)

#: Seconds in-flight RPCs get to finish on shutdown.
SHUTDOWN_GRACE = 1.0


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line on stderr, exit code 2 (argparse's convention).
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The launcher's flags (server mode; agent mode adds its own)."""
    parser = _Parser(prog="python -m keras_ps.elastic.launch",
                     description="keras_ps elastic launcher")
    parser.add_argument(
        "--standalone", action="store_true",
        help="run the rendezvous server in this process")
    parser.add_argument(
        "--rdzv_endpoint", metavar="HOST:PORT",
        help="where the rendezvous server listens (port 0: pick one)")
    parser.add_argument(
        "--token", help="shared secret clients must present "
        "(default: $KERAS_PS_RDZV_TOKEN)")
    parser.add_argument("--tls_cert", metavar="FILE",
                        help="server certificate chain (PEM); needs --tls_key")
    parser.add_argument("--tls_key", metavar="FILE",
                        help="private key of --tls_cert (PEM)")
    for name, kind in (("gather_timeout", float), ("keepalive_timeout", float),
                       ("barrier_timeout", float), ("max_pending_nodes", int),
                       ("max_workers", int), ("long_poll_timeout", float)):
        parser.add_argument(
            f"--{name}", type=kind, metavar="N",
            help=f"RendezvousConfig.{name} "
            f"(default: ${api.RendezvousConfig.env_var(name)} or "
            f"{api.RendezvousConfig.__dataclass_fields__[name].default})")
    parser.add_argument("--nnodes", metavar="MIN:MAX",
                        help="agent mode: nodes needed and most admitted")
    parser.add_argument("--address", metavar="HOST:PORT",
                        help="agent mode: the worker's address")
    parser.add_argument("--monitor_interval", type=float, default=1.0,
                        metavar="S", help="agent mode: seconds between looks "
                        "at the task and between keep-alives")
    parser.add_argument("--max_restarts", type=int, default=3, metavar="N",
                        help="agent mode: restarts of a failed task")
    parser.add_argument("--tls_root_cert", metavar="FILE",
                        help="agent mode: the certificate (PEM) of a "
                        "rendezvous started with --tls_cert (default: "
                        f"${TLS_ROOT_CERT_ENV}; none: plaintext)")
    parser.add_argument("--log_level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def _config_from_args(parser, args) -> api.RendezvousConfig:
    overrides = {name: getattr(args, name) for name in (
        "gather_timeout", "keepalive_timeout", "barrier_timeout",
        "max_pending_nodes", "max_workers", "long_poll_timeout", "token")}
    try:
        return api.RendezvousConfig.from_env(**overrides)
    except ValueError as error:
        parser.error(str(error))


def run_standalone(args, parser: Optional[argparse.ArgumentParser] = None
                   ) -> int:
    """Runs the rendezvous server until SIGTERM/SIGINT.

    Args:
        args: Parsed flags (see `build_parser`).
        parser: Used to report bad flags (exit code 2).

    Returns:
        The process exit code.
    """
    from keras_ps.elastic.rendezvous_server import RendezvousServer

    parser = parser or build_parser()
    if not args.rdzv_endpoint:
        parser.error("--standalone needs --rdzv_endpoint=HOST:PORT")
    try:
        host, port = api.parse_address(args.rdzv_endpoint, "--rdzv_endpoint",
                                       allow_port_zero=True)
    except ValueError as error:
        parser.error(str(error))
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls_cert and --tls_key must be given together")
    config = _config_from_args(parser, args)
    try:
        server = RendezvousServer(config, host=host.strip("[]"), port=port,
                                  tls_cert=args.tls_cert, tls_key=args.tls_key)
    except OSError as error:
        parser.error(f"cannot read TLS file: {error}")

    stop = threading.Event()

    def on_signal(signum, frame):
        logger.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            bound = server.start()
        except OSError as error:
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
            return 1
        print(f"rendezvous server listening on {host}:{bound}", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        server.stop(SHUTDOWN_GRACE)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _parse_nnodes(parser, text):
    low, sep, high = (text or "").partition(":")
    try:
        low = int(low)
        high = int(high) if sep else low
    except ValueError:
        parser.error(f"--nnodes must be MIN:MAX (integers), got {text!r}")
    return low, high


def run_agent(args, task: List[str],
              parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Runs the local elastic agent until its task ends or SIGTERM/SIGINT.

    Args:
        args: Parsed flags (see `build_parser`).
        task: The worker command (what follows `--`).
        parser: Used to report bad flags (exit code 2).

    Returns:
        The process exit code.
    """
    from keras_ps.elastic.agent import AgentConfig
    from keras_ps.elastic.agent import ElasticAgent

    parser = parser or build_parser()
    for flag in ("rdzv_endpoint", "nnodes", "address"):
        if not getattr(args, flag):
            parser.error(f"agent mode needs --{flag}")
    min_nodes, max_nodes = _parse_nnodes(parser, args.nnodes)
    try:
        tls_root_cert = tls_root_cert_or_env(args.tls_root_cert)
        if tls_root_cert is not None:  # read now: a bad file is said at once
            tls_root_cert = read_root_cert(tls_root_cert)
        config = AgentConfig(
            rdzv_endpoint=args.rdzv_endpoint, address=args.address,
            min_nodes=min_nodes, max_nodes=max_nodes, task=tuple(task),
            monitor_interval=args.monitor_interval,
            max_restarts=args.max_restarts,
            token=args.token or os.environ.get(
                api.RendezvousConfig.env_var("token")) or None,
            tls_root_cert=tls_root_cert)
    except ValueError as error:
        parser.error(str(error))
    agent = ElasticAgent(config)
    previous = {sig: signal.signal(sig, agent.request_stop)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return agent.run()
    except api.RendezvousError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `python -m keras_ps.elastic.launch`."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    task = []
    if "--" in argv:
        split = argv.index("--")
        argv, task = argv[:split], argv[split + 1:]
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.standalone:
        if task:
            parser.error("--standalone takes no TASK after `--`")
        return run_standalone(args, parser)
    if args.nnodes is None and args.address is None and not task:
        parser.error("give --standalone (the rendezvous server) or agent "
                     "flags --nnodes, --address and `-- TASK...`")
    return run_agent(args, task, parser)


if __name__ == "__main__":
    sys.exit(main())
