"""Command-line launcher of keras_ps elastic jobs.

Server mode (implemented)::

    python -m keras_ps.elastic.launch --standalone --rdzv_endpoint=HOST:PORT \\
        [--token T | env KERAS_PS_RDZV_TOKEN] [--tls_cert F --tls_key F] \\
        [--gather_timeout S] [--keepalive_timeout S]

runs the rendezvous server until SIGTERM or SIGINT, then exits 0. Every
`RendezvousConfig` knob can also come from its ``KERAS_PS_RDZV_*`` variable;
flags win. Bad flags print a one-line error and exit 2.

Agent mode (``--nnodes=MIN:MAX --address=HOST:PORT -- TASK...``) is to be
added beside `run_standalone`: add its flags in `build_parser`, and dispatch
in `main`.
"""

import argparse
import logging
import signal
import sys
import threading
from typing import List, Optional

from keras_ps.elastic import api

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
    from keras_ps.elastic.server import RendezvousServer

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


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `python -m keras_ps.elastic.launch`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.standalone:
        return run_standalone(args, parser)
    parser.error("only --standalone (the rendezvous server) is implemented")
    return 2


if __name__ == "__main__":
    sys.exit(main())
