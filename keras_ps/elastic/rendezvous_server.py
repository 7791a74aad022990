"""The rendezvous gRPC server: a thin layer over `MembershipState`.

Each RPC validates its request, calls one method of the state object and maps
`RendezvousError`s to gRPC status codes. Blocking RPCs (GetClusterSpec,
Barrier, Synchronize) are long polls: they hold a server thread for at most
`long_poll_timeout` (and never past the caller's deadline), and only while one
of `config.blocking_slots` is free; otherwise they answer "still waiting, retry
after a moment" at once. The remaining threads are thus always free for
keep-alives, so a flood of joins cannot starve them; joins beyond
`max_pending_nodes` are refused with RESOURCE_EXHAUSTED. (Under a flood,
gRPC's own overload protection may also cancel calls it cannot queue; they
fail with CANCELLED before reaching this code.)
"""

import concurrent.futures
import functools
import hmac
import logging
import math
import os
import threading
import time
from typing import Optional, Union

import grpc

from keras_ps.elastic import _requests as checks
from keras_ps.elastic import api
from keras_ps.elastic import rendezvous_pb2 as pb
from keras_ps.elastic import rendezvous_pb2_grpc as pb_grpc
from keras_ps.elastic._membership import MembershipSnapshot
from keras_ps.elastic._membership import MembershipState
from keras_ps.elastic._ps_registry import PsRegistry
from keras_ps.elastic.api import MeetingKind
from keras_ps.elastic.api import NodeState

logger = logging.getLogger(__name__)

#: Seconds a caller is told to wait when no blocking slot is free.
BUSY_RETRY_AFTER = 0.2
#: Requests carry at most 1 MiB of data; leave room to reject bigger ones
#: with a clear INVALID_ARGUMENT instead of a transport error.
_MAX_REQUEST_BYTES = 2 * api.MAX_DATA_BYTES + 64 * 1024
_MAX_MISSING_METADATA = 32 * 1024

_NODE_STATUS = {NodeState.WAITING: pb.WAITING, NodeState.ADMITTED: pb.ADMITTED}
_LISTEN_FIX = ("Its port may be in use, or its host not this machine's: pick "
               "a free port (0: any) and a host name or address of this "
               "machine (--rdzv_endpoint of the launcher)")

PemSource = Union[bytes, str, os.PathLike]


def read_pem(source: Optional[PemSource]) -> Optional[bytes]:
    """PEM bytes as given, or read from a file path."""
    if source is None or isinstance(source, bytes):
        return source
    with open(source, "rb") as f:
        return f.read()


def _abort(context, error: api.RendezvousError):
    if isinstance(error, api.RendezvousTimeoutError):
        listed, size = [], 0
        for address in error.missing:
            size += len(address) + 1
            if size > _MAX_MISSING_METADATA:
                break
            listed.append(address)
        context.set_trailing_metadata((
            (api.MISSING_METADATA_KEY, ",".join(listed)),
            (api.MISSING_COUNT_METADATA_KEY, str(error.missing_count)),
        ))
    context.abort(getattr(grpc.StatusCode, error.status_code), error.message)


def _rpc(method):
    """Turns RendezvousErrors raised by an RPC method into gRPC statuses."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except api.RendezvousError as error:
            if isinstance(error, api.RendezvousInvalidArgumentError):
                logger.debug("%s: invalid request: %s", method.__name__,
                             error.message)
            _abort(context, error)

    return wrapper


class _CallInterceptor(grpc.ServerInterceptor):
    """Answers a call of another service (TF's, when this server's address
    is given as a ps or worker) with UNIMPLEMENTED saying what this server
    is, and rejects calls without the right `x-keras-ps-token` metadata."""

    _SERVICE = "/keras_ps.elastic.Rendezvous/"

    def __init__(self, token: Optional[str]):
        self._token = token and token.encode("ascii")

        def deny(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing or wrong rendezvous token (metadata "
                f"{api.TOKEN_METADATA_KEY}). Fix: give the client the "
                f"server's token, e.g. RendezvousClient(endpoint, token=...) "
                f"with the server's --token / KERAS_PS_RDZV_TOKEN value")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(self._SERVICE):
            return grpc.unary_unary_rpc_method_handler(
                lambda request, context: context.abort(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"this is a keras_ps rendezvous server, which serves "
                    f"keras_ps.elastic.Rendezvous only, not {method}"))
        if self._token is None:
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == api.TOKEN_METADATA_KEY:
                if isinstance(value, str):
                    value = value.encode("utf-8", "replace")
                if hmac.compare_digest(value, self._token):
                    return continuation(handler_call_details)
                break
        return self._deny


class RendezvousServicer(pb_grpc.RendezvousServicer):
    """The RPCs; all state lives in the `MembershipState`."""

    def __init__(self, state: MembershipState, config: api.RendezvousConfig):
        self._state = state
        self._config = config
        self._ps = PsRegistry(config.keepalive_timeout)
        self._slots = threading.BoundedSemaphore(config.blocking_slots)
        self._refused = 0
        self._refusal_logged = -math.inf
        self._refusal_lock = threading.Lock()

    def _hold(self, context, address, attempt, limit=math.inf):
        """Runs `attempt` and, if it has no answer yet, waits for one.

        Returns:
            (result or None, busy): `busy` when no blocking slot was free.
        """
        result = attempt()
        if result is not None:
            return result, False
        if not self._slots.acquire(blocking=False):
            return None, True
        try:
            wait = min(limit, self._config.long_poll_timeout)
            remaining = context.time_remaining()
            if remaining is not None:
                wait = min(wait, remaining - min(0.5, remaining * 0.2))
            if wait <= 0:
                return None, False
            with self._state.in_flight(address):
                return self._state.wait_for(attempt,
                                            time.monotonic() + wait), False
        finally:
            self._slots.release()

    def _note_refusal(self, error):
        with self._refusal_lock:
            self._refused += 1
            now = time.monotonic()
            if now - self._refusal_logged >= 10.0:
                logger.warning("%s (%s join(s) refused so far)",
                               error.message, self._refused)
                self._refusal_logged = now

    @_rpc
    def GetClusterSpec(self, request, context):
        address = checks.address(request.address)
        if request.min_nodes < 1:
            raise checks.invalid(
                f"min_nodes must be >= 1, got {request.min_nodes}")
        if request.max_nodes < request.min_nodes:
            raise checks.invalid(f"max_nodes must be >= min_nodes "
                                 f"({request.min_nodes}), got "
                                 f"{request.max_nodes}")
        timeout = checks.timeout(request.timeout)
        started = time.monotonic()
        try:
            self._state.join(address, request.min_nodes, request.max_nodes)
        except api.RendezvousResourceExhaustedError as error:
            self._note_refusal(error)
            raise
        limit = timeout if timeout > 0 else math.inf
        spec, busy = self._hold(context, address,
                                lambda: self._state.spec_for(address), limit)
        if spec is not None:
            return pb.GetClusterSpecResponse(
                status=pb.ADMITTED, workers=[a or "" for a in spec.workers],
                index=spec.index, version=spec.version,
                registered=self._state.registered)
        if time.monotonic() - started >= limit:
            raise api.RendezvousTimeoutError(
                f"{self._state.describe_wait(address)} after {timeout:.3g}s")
        return pb.GetClusterSpecResponse(
            status=pb.WAITING, registered=self._state.registered,
            retry_after=BUSY_RETRY_AFTER if busy else 0.0)

    @_rpc
    def GetWaitingNodes(self, request, context):
        waiting = self._state.keep_alive(checks.address(request.address))
        return pb.GetWaitingNodesResponse(
            count=waiting.count, joined=waiting.joined, lost=waiting.lost,
            version=waiting.version, status=_NODE_STATUS[waiting.state])

    @_rpc
    def Leave(self, request, context):
        removed = self._state.leave(checks.address(request.address))
        return pb.LeaveResponse(removed=removed)

    def _meet(self, kind, request, context, data):
        address = checks.address(request.address)
        tag = checks.tag(request.tag)
        timeout = checks.timeout(request.timeout)
        generation = checks.generation(request.generation)
        if generation == 0:
            generation = self._state.arrive(
                kind, address, tag, data,
                timeout if timeout > 0 else self._config.barrier_timeout)
        result, busy = self._hold(
            context, address,
            lambda: self._state.meeting_result(kind, address, tag, generation))
        return result, generation, BUSY_RETRY_AFTER if busy else 0.0

    @_rpc
    def Barrier(self, request, context):
        result, generation, retry = self._meet(MeetingKind.BARRIER, request,
                                               context, b"")
        return pb.BarrierResponse(done=result is not None,
                                  generation=generation, retry_after=retry)

    @_rpc
    def Synchronize(self, request, context):
        if len(request.data) > api.MAX_DATA_BYTES:
            raise checks.invalid(
                f"data must be at most {api.MAX_DATA_BYTES} bytes (1 MiB), "
                f"got {len(request.data)} bytes")
        result, generation, retry = self._meet(MeetingKind.SYNCHRONIZE,
                                               request, context, request.data)
        return pb.SynchronizeResponse(done=result is not None,
                                      generation=generation, data=result or {},
                                      retry_after=retry)

    @_rpc
    def ListMembers(self, request, context):
        # An observer (the coordinator's cluster resolver) reads the
        # membership without registering; the token check applies as to
        # every RPC. Held until the version moves or `timeout` passes.
        timeout = checks.timeout(request.timeout)
        known = request.known_version

        def attempt():
            snapshot = self._state.snapshot()
            return snapshot if snapshot.version != known else None

        snapshot = attempt()
        if snapshot is None and timeout > 0 and \
                self._slots.acquire(blocking=False):
            try:
                wait = min(timeout, self._config.long_poll_timeout)
                remaining = context.time_remaining()
                if remaining is not None:
                    wait = min(wait, remaining - min(0.5, remaining * 0.2))
                if wait > 0:
                    snapshot = self._state.wait_for(
                        attempt, time.monotonic() + wait)
            finally:
                self._slots.release()
        snapshot = snapshot or self._state.snapshot()
        return pb.ListMembersResponse(
            workers=[a or "" for a in snapshot.workers],
            version=snapshot.version, waiting=snapshot.waiting,
            ps=self._ps.addresses())

    @_rpc
    def AnnouncePs(self, request, context):
        lease = self._ps.announce(checks.ps_index(request.index),
                                  checks.address(request.address),
                                  checks.incarnation(request.incarnation))
        return pb.AnnouncePsResponse(lease=lease)


class RendezvousServer:
    """The rendezvous server.

    Args:
        config: Knobs; defaults to `RendezvousConfig()`.
        host: Interface to listen on.
        port: Port to listen on; 0 picks a free one (see `start`).
        tls_cert: Server certificate chain (PEM bytes or a file path); with
            `tls_key`, the server only speaks TLS.
        tls_key: Private key of `tls_cert` (PEM bytes or a file path).

    Example:
        >>> server = RendezvousServer(RendezvousConfig(token="s3cret"))
        >>> port = server.start()
        >>> ...
        >>> server.stop(grace=1.0)
    """

    def __init__(self, config: Optional[api.RendezvousConfig] = None,
                 host: str = "127.0.0.1", port: int = 0,
                 tls_cert: Optional[PemSource] = None,
                 tls_key: Optional[PemSource] = None):
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together, "
                             f"got tls_cert={tls_cert!r} tls_key={tls_key!r}")
        self._config = config or api.RendezvousConfig()
        self._host = host
        self._port = port
        self._tls = ((read_pem(tls_key), read_pem(tls_cert)) if tls_cert
                     else None)
        self._state = MembershipState(self._config)
        self._server = None
        self._reaper = None
        self._stopping = threading.Event()

    @property
    def config(self) -> api.RendezvousConfig:
        return self._config

    @property
    def port(self) -> int:
        """The bound port (after `start`)."""
        return self._port

    @property
    def endpoint(self) -> str:
        host = self._host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self._port}"

    def snapshot(self) -> MembershipSnapshot:
        """A consistent view of the membership (for tests and debugging)."""
        return self._state.snapshot()

    def start(self) -> int:
        """Binds and starts serving.

        Returns:
            The bound port.

        Raises:
            OSError: The address cannot be bound.
        """
        if self._server is not None:
            raise RuntimeError("RendezvousServer already started")
        config = self._config
        server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(
                max_workers=config.max_workers, thread_name_prefix="rdzv"),
            interceptors=[_CallInterceptor(config.token)],
            options=[("grpc.so_reuseport", 0),
                     ("grpc.max_receive_message_length", _MAX_REQUEST_BYTES)],
            maximum_concurrent_rpcs=config.max_concurrent_rpcs)
        pb_grpc.add_RendezvousServicer_to_server(
            RendezvousServicer(self._state, config), server)
        address = f"{self.endpoint.rpartition(':')[0]}:{self._port}"
        try:
            if self._tls is not None:
                port = server.add_secure_port(
                    address, grpc.ssl_server_credentials([self._tls]))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as error:
            raise OSError(f"cannot listen on {address}: {error}. {_LISTEN_FIX}"
                          ) from None
        if not port:
            raise OSError(f"cannot listen on {address}. {_LISTEN_FIX}")
        self._port = port
        server.start()
        self._server = server
        self._reaper = threading.Thread(target=self._reap, name="rdzv-reaper",
                                        daemon=True)
        self._reaper.start()
        logger.info("rendezvous server listening on %s (tls=%s, token=%s, "
                    "%s)", self.endpoint, self._tls is not None,
                    config.token is not None, config)
        return port

    def _reap(self):
        while not self._stopping.is_set():
            try:
                due = self._state.tick()
            except api.RendezvousClosedError:
                return
            self._stopping.wait(min(max(due - time.monotonic(), 0.01), 1.0))

    def stop(self, grace: Optional[float] = None):
        """Stops serving; waiting callers get UNAVAILABLE at once.

        Args:
            grace: Seconds in-flight RPCs get to finish; None cancels them.
        """
        self._stopping.set()
        self._state.close()
        if self._server is not None:
            self._server.stop(grace).wait()
            logger.info("rendezvous server on %s stopped", self.endpoint)
        if self._reaper is not None:
            self._reaper.join()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the server stops; False if `timeout` passed first."""
        if self._server is None:
            return True
        return self._server.wait_for_termination(timeout)

    def __enter__(self):
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc_info):
        self.stop(grace=0)
