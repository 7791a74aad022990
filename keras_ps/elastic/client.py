"""Client of the rendezvous server.

Blocking calls are long polls: the client keeps calling until the server has
an answer or the caller's timeout passes. gRPC failures become the errors of
`keras_ps.elastic.api`, chosen by status code only.
"""

import logging
import os
import random
import socket
import threading
import time
from typing import Dict, Optional

import grpc

from keras_ps.elastic import api
from keras_ps.elastic import rendezvous_pb2 as pb
from keras_ps.elastic import rendezvous_pb2_grpc as pb_grpc
from keras_ps.elastic.rendezvous_server import PemSource
from keras_ps.elastic.rendezvous_server import read_pem

logger = logging.getLogger(__name__)

_NODE_STATE = {pb.WAITING: api.NodeState.WAITING,
               pb.ADMITTED: api.NodeState.ADMITTED}

#: The file of the root certificate (PEM) a rendezvous' clients verify it
#: with when none is given them: a rendezvous started with --tls_cert
#: speaks TLS only.
TLS_ROOT_CERT_ENV = "KERAS_PS_RDZV_TLS_ROOT_CERT"


def tls_root_cert_or_env(given: Optional[PemSource]) -> Optional[PemSource]:
    """`given`, else the file $KERAS_PS_RDZV_TLS_ROOT_CERT names, else None
    (plaintext)."""
    return given if given is not None else (
        os.environ.get(TLS_ROOT_CERT_ENV) or None)


def read_root_cert(source: PemSource) -> bytes:
    """The PEM bytes of a root certificate given as bytes or a file path.

    Raises:
        ValueError: the file cannot be read, or holds no PEM certificate.
    """
    fix = ("Give the certificate the rendezvous server was started with "
           "(its --tls_cert), as a PEM file.")
    try:
        pem = read_pem(source)
    except OSError as error:
        raise ValueError(f"Cannot read the rendezvous' TLS root certificate "
                         f"{source!r}: {error.strerror or error}. {fix}"
                         ) from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise ValueError(f"The rendezvous' TLS root certificate {source!r} "
                         f"holds no PEM certificate (no '-----BEGIN "
                         f"CERTIFICATE-----' line). {fix}")
    return pem


class _TransportDeadline(Exception):
    """The RPC's own deadline passed (not a timeout the server declared)."""


class RendezvousClient:
    """Talks to one rendezvous server.

    Args:
        endpoint: The server's HOST:PORT.
        token: Shared secret, sent as `x-keras-ps-token` metadata.
        tls_root_cert: Root certificate (PEM bytes or file path) to verify the
            server with; when given, the client speaks TLS (see
            `tls_root_cert_or_env`).
        timeout: Deadline in seconds of non-blocking calls, and the slack
            added to the hold time of each long poll.
        poll_timeout: Longest time one long poll may be held by the server.

    Raises:
        ValueError: `endpoint` is not HOST:PORT, or `tls_root_cert` is no
            readable certificate.
    """

    def __init__(self, endpoint: str, token: Optional[str] = None,
                 tls_root_cert: Optional[PemSource] = None,
                 timeout: float = 10.0, poll_timeout: float = 30.0):
        api.parse_address(endpoint, field="endpoint")
        self._endpoint = endpoint
        self._timeout = timeout
        self._poll_timeout = poll_timeout
        self._metadata = ((api.TOKEN_METADATA_KEY, token),) if token else None
        # A server back after a restart is reached again within 0.1-2 s.
        # Not `grpc.min_reconnect_backoff_ms`: gRPC takes it as the time a
        # connection attempt may take (20 s by default), and at 100 ms an
        # agent on a busy machine, whose server sent its first HTTP/2 frame
        # later than that, failed to join with "rendezvous server ... is
        # unavailable: connection attempt timed out before receiving
        # SETTINGS frame". A server that is gone refuses the connection, and
        # is reported at once as before; one that hangs, at the call's
        # deadline.
        options = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_metadata_size", 256 * 1024),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        self._tls = tls_root_cert is not None
        if self._tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=read_root_cert(tls_root_cert))
            self._channel = grpc.secure_channel(endpoint, credentials, options)
        else:
            self._channel = grpc.insecure_channel(endpoint, options)
        self._stub = pb_grpc.RendezvousStub(self._channel)
        self._closed = threading.Event()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    # ------------------------------------------------------------ public

    def get_cluster_spec(self, address: str, min_nodes: int, max_nodes: int,
                         timeout: Optional[float] = None) -> api.MembershipView:
        """Joins the rendezvous and waits for this node's place.

        Args:
            address: This node's HOST:PORT.
            min_nodes: Nodes needed before the first cluster spec.
            max_nodes: Most nodes admitted at once.
            timeout: Seconds to wait for admission; None waits forever.

        Returns:
            The cluster spec with this node's index.

        Raises:
            RendezvousTimeoutError: Not admitted within `timeout`.
            RendezvousError: Any other failure (see api.py).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        registered, sent = 0, False
        while True:
            remaining = (None if deadline is None
                         else deadline - time.monotonic())
            if sent and remaining is not None and remaining <= 0:
                raise api.RendezvousTimeoutError(
                    f"node {address} not admitted within {timeout:.3g}s "
                    f"({registered} registered, min_nodes={min_nodes}, "
                    f"max_nodes={max_nodes})")
            if remaining is None:
                wire_timeout, hold = 0.0, self._poll_timeout
            else:
                wire_timeout = remaining if remaining < 0 else max(remaining,
                                                                   1e-3)
                hold = min(max(remaining, 0.0), self._poll_timeout)
            request = pb.GetClusterSpecRequest(
                address=address, min_nodes=min_nodes, max_nodes=max_nodes,
                timeout=wire_timeout)
            sent = True
            try:
                response = self._call(self._stub.GetClusterSpec, request,
                                      hold + self._timeout)
            except _TransportDeadline:
                continue
            registered = response.registered
            if response.status == pb.ADMITTED:
                return api.MembershipView(
                    tuple(a or None for a in response.workers),
                    response.index, response.version)
            self._backoff(response.retry_after, deadline)

    def keep_alive(self, address: str) -> api.WaitingNodes:
        """Refreshes this node's lease; reports membership changes.

        Raises:
            RendezvousUnknownNodeError: The server does not know `address`
                (lease lapsed, left, or server restarted): join again.
        """
        response = self._unary(self._stub.GetWaitingNodes,
                               pb.GetWaitingNodesRequest(address=address))
        return api.WaitingNodes(response.count, response.joined,
                                response.lost, response.version,
                                _NODE_STATE.get(response.status,
                                                api.NodeState.WAITING))

    def get_waiting_nodes(self, address: str) -> int:
        """Keep-alive; the net number of nodes that joined (+n) or were lost
        (-n) since this node's previous call (or its admission)."""
        return self.keep_alive(address).count

    def leave(self, address: str) -> bool:
        """Removes this node; False if the server did not know it."""
        return self._unary(self._stub.Leave,
                           pb.LeaveRequest(address=address)).removed

    def barrier(self, address: str, tag: str,
                timeout: Optional[float] = None):
        """Waits until every admitted node reached `tag`.

        Args:
            address: This node's HOST:PORT (must be admitted).
            tag: Names the meeting; tags are independent and reusable once
                a meeting completed.
            timeout: Seconds; None (or 0) uses the server's default.

        Raises:
            RendezvousTimeoutError: Someone did not arrive in time; its
                `missing` attribute names them. Every caller gets it.
        """
        self._meet(self._stub.Barrier, pb.BarrierRequest, address, tag,
                   timeout, {})

    def synchronize(self, address: str, tag: str, data: bytes,
                    timeout: Optional[float] = None) -> Dict[str, bytes]:
        """A barrier that exchanges one blob (at most 1 MiB) per node.

        Args:
            address: This node's HOST:PORT (must be admitted).
            tag: Names the meeting (separate from barrier tags).
            data: This node's blob.
            timeout: Seconds; None (or 0) uses the server's default.

        Returns:
            address -> the bytes that node brought, for every node.
        """
        response = self._meet(self._stub.Synchronize, pb.SynchronizeRequest,
                              address, tag, timeout, {"data": bytes(data)})
        return dict(response.data)

    def list_members(self, known_version: int = -1,
                     timeout: float = 0.0) -> api.MembershipView:
        """Reads the cluster spec without joining it (an observer's view).

        Args:
            known_version: The membership version the caller has; the server
                holds the call until the version differs (-1: answer at once).
            timeout: Seconds the server may hold the call (capped by its
                `long_poll_timeout`); 0 answers at once.

        Returns:
            The cluster spec with `index == -1` (the caller is no node),
            and in `ps` the addresses the ps announced (`announce_ps`).

        Raises:
            RendezvousAuthError: Missing or wrong token.
            RendezvousClosedError: The server is unreachable.
            RendezvousTimeoutError: No answer within `timeout` plus the
                client's own timeout.
        """
        request = pb.ListMembersRequest(known_version=known_version,
                                        timeout=timeout)
        try:
            response = self._call(self._stub.ListMembers, request,
                                  timeout + self._timeout)
        except _TransportDeadline:
            raise api.RendezvousTimeoutError(
                f"rendezvous server {self._endpoint} did not answer within "
                f"{timeout + self._timeout:.3g}s") from None
        return api.MembershipView(tuple(a or None for a in response.workers),
                                  -1, response.version,
                                  tuple(a or None for a in response.ps))

    def announce_ps(self, index: int, address: str,
                    incarnation: str) -> float:
        """Says that ps `index` serves at `address` (see `list_members`'
        `ps`); call again within the returned lease (seconds) to keep it.

        Args:
            incarnation: Names the calling ps process; a newer process
                announcing the same index replaces it.

        Raises:
            RendezvousStateError: A newer ps process announced `index`.
            RendezvousInvalidArgumentError: A bad index or address.
        """
        return self._unary(self._stub.AnnouncePs, pb.AnnouncePsRequest(
            index=index, address=address, incarnation=incarnation)).lease

    def close(self):
        """Closes the channel; later calls raise RendezvousClosedError."""
        self._closed.set()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    # --------------------------------------------------------- internals

    def _meet(self, rpc, request_type, address, tag, timeout, fields):
        wire_timeout = 0.0 if timeout is None else timeout
        give_up = (None if timeout is None or timeout < 0
                   else time.monotonic() + timeout + self._timeout)
        generation = 0
        while True:
            if generation == 0:
                request = request_type(address=address, tag=tag,
                                       timeout=wire_timeout, **fields)
            else:
                request = request_type(address=address, tag=tag,
                                       generation=generation)
            try:
                response = self._call(rpc, request,
                                      self._poll_timeout + self._timeout)
            except _TransportDeadline:
                if give_up is not None and time.monotonic() > give_up:
                    raise api.RendezvousTimeoutError(
                        f"no answer from the rendezvous server for {tag!r} "
                        f"within {timeout:.3g}s") from None
                continue
            if response.done:
                return response
            generation = response.generation
            self._backoff(response.retry_after, give_up)

    @staticmethod
    def _backoff(retry_after, deadline):
        if retry_after <= 0:
            return
        pause = retry_after * random.uniform(0.5, 1.5)
        if deadline is not None:
            pause = min(pause, max(0.0, deadline - time.monotonic()))
        time.sleep(pause)

    def _unary(self, rpc, request):
        try:
            return self._call(rpc, request, self._timeout)
        except _TransportDeadline:
            raise api.RendezvousTimeoutError(
                f"rendezvous server {self._endpoint} did not answer within "
                f"{self._timeout:.3g}s") from None

    def _call(self, rpc, request, rpc_timeout):
        if self._closed.is_set():
            raise api.RendezvousClosedError("the RendezvousClient is closed")
        try:
            return rpc(request, timeout=rpc_timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise self._convert(error) from None
        except ValueError:  # "Cannot invoke RPC on closed channel"
            if self._closed.is_set():
                raise api.RendezvousClosedError(
                    "the RendezvousClient is closed") from None
            raise

    def _convert(self, error: grpc.RpcError) -> Exception:
        code = error.code()
        details = error.details() or ""
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            metadata = dict(error.trailing_metadata() or ())
            if api.MISSING_COUNT_METADATA_KEY not in metadata:
                return _TransportDeadline(details)
            missing = metadata.get(api.MISSING_METADATA_KEY, "")
            return api.RendezvousTimeoutError(
                details, tuple(a for a in missing.split(",") if a),
                int(metadata[api.MISSING_COUNT_METADATA_KEY]))
        if code is grpc.StatusCode.CANCELLED and self._closed.is_set():
            return api.RendezvousClosedError("the RendezvousClient is closed")
        if code is grpc.StatusCode.UNIMPLEMENTED:
            # The rendezvous server serves every method of its service: a
            # server without them serves another (a ps or worker task does).
            return api.RendezvousError(
                f"{self._endpoint} is not a keras_ps rendezvous server: it "
                f"answered the rendezvous call with UNIMPLEMENTED "
                f"({details or 'no details'}), so it serves another gRPC "
                "service (a TF ps or worker task answers so). Expected the "
                "HOST:PORT of `python -m keras_ps.elastic.launch "
                "--standalone` (or a RendezvousServer): pass that as "
                "rdzv_endpoint (--rdzv_endpoint of the agent).")
        cls = api.ERRORS_BY_STATUS_CODE.get(code.name, api.RendezvousError)
        if cls is api.RendezvousClosedError:
            details = (f"rendezvous server {self._endpoint} is unavailable: "
                       f"{details}{self._tls_hint()}")
        elif cls is api.RendezvousError:
            details = f"rendezvous call failed with {code.name}: {details}"
        return cls(details)

    def _tls_hint(self) -> str:
        """What to check when the server's port takes connections and the
        gRPC connection still fails: TLS on one side only (a server that is
        down refuses them, and gets no hint)."""
        host, port = api.parse_address(self._endpoint, "endpoint")
        try:
            socket.create_connection((host.strip("[]"), port), 1.0).close()
        except OSError:
            return ""
        if self._tls:
            return (". Its port takes connections but the TLS handshake "
                    "failed: a rendezvous started without --tls_cert speaks "
                    "plaintext; give its clients no root certificate (unset "
                    f"${TLS_ROOT_CERT_ENV}), or start it with --tls_cert "
                    "and --tls_key")
        return (". Its port takes connections but closed this plaintext "
                "one: a rendezvous started with --tls_cert speaks TLS only; "
                "give its clients that certificate (the agent's "
                "--tls_root_cert, ElasticClusterResolver(tls_root_cert=...), "
                f"or ${TLS_ROOT_CERT_ENV}, which every one of them reads)")
