"""The rendezvous server over real gRPC: in-process servers, and real
`python -m keras_ps.elastic.launch --standalone` subprocesses for restart,
SIGTERM and the join flood. Loopback only; node addresses are identifiers."""

import collections
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import grpc
import portpicker
import psutil
import pytest

from _polling import wait_until  # tests/_polling.py
from keras_ps.elastic import api
from keras_ps.elastic import launch
from keras_ps.elastic import rendezvous_pb2 as pb
from keras_ps.elastic import rendezvous_pb2_grpc as pb_grpc
from keras_ps.elastic.api import NodeState
from keras_ps.elastic.api import RendezvousPhase
from keras_ps.elastic.client import RendezvousClient
from keras_ps.elastic.rendezvous_server import RendezvousServer

from _certs import self_signed_cert  # tests/_certs.py
from _paths import REPO  # noqa: E402


def node(i):
    return f"127.0.0.1:{20000 + i}"


A, B, C, D = (node(i) for i in range(4))



@pytest.fixture
def rdzv():
    """Starts in-process servers and clients; stops them all at the end."""
    servers, clients = [], []
    pool = concurrent.futures.ThreadPoolExecutor(16)

    def start(tls=None, **knobs):
        knobs.setdefault("gather_timeout", 0.3)
        knobs.setdefault("keepalive_timeout", 5.0)
        server = RendezvousServer(api.RendezvousConfig(**knobs), **(tls or {}))
        port = server.start()
        servers.append(server)
        return server, f"127.0.0.1:{port}"

    def client(endpoint, **kwargs):
        kwargs.setdefault("timeout", 5.0)
        c = RendezvousClient(endpoint, **kwargs)
        clients.append(c)
        return c

    def join_all(endpoint, addresses, min_nodes, max_nodes, timeout=20.0):
        futures = [pool.submit(client(endpoint).get_cluster_spec, a,
                               min_nodes, max_nodes, timeout)
                   for a in addresses]
        return [f.result(timeout=timeout + 5) for f in futures]

    yield types.SimpleNamespace(start=start, client=client, pool=pool,
                                join_all=join_all)
    for c in clients:
        c.close()
    for server in servers:
        server.stop(0)
    pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------- seed tests


@pytest.mark.timeout(30)
def test_bringup(rdzv):
    server, endpoint = rdzv.start()
    assert server.port > 0
    c = rdzv.client(endpoint)
    with pytest.raises(api.RendezvousUnknownNodeError):
        c.get_waiting_nodes(A)
    assert c.leave(A) is False
    assert server.snapshot().phase is RendezvousPhase.AWAITING_MIN


@pytest.mark.timeout(30)
def test_port_in_use_raises_oserror(rdzv):
    server, _ = rdzv.start()
    with pytest.raises(OSError, match=str(server.port)) as raised:
        RendezvousServer(port=server.port).start()
    assert "pick a free port (0: any)" in str(raised.value), raised.value


@pytest.mark.timeout(60)
def test_resolver_names_the_missing_workers_and_the_fix(rdzv):
    # No agent joins: cluster_spec() gives up after startup_timeout with
    # the count admitted, the rendezvous it asked, and what to change.
    from keras_ps.elastic.resolver import ElasticClusterResolver

    _, endpoint = rdzv.start()
    resolver = ElasticClusterResolver(endpoint, ps=["localhost:1"],
                                      min_workers=2, startup_timeout=0.5,
                                      poll_interval=0.1)
    _gives_up_after(resolver, 0.5, "0 of min_workers=2 workers admitted",
                    endpoint, "Start more worker agents")


def _gives_up_after(resolver, seconds, *needles):
    """`resolver.cluster_spec()` raises RendezvousTimeoutError after
    `seconds` (its startup_timeout), with `needles` in its message."""
    started = time.monotonic()
    with pytest.raises(api.RendezvousTimeoutError) as raised:
        resolver.cluster_spec()
    assert time.monotonic() - started >= seconds
    message = str(raised.value)
    for needle in (*needles, f"within {seconds:g}s", "raise startup_timeout"):
        assert needle in message, message


@pytest.mark.timeout(60)
def test_a_resolver_given_a_number_of_ps_waits_for_their_announcements(rdzv):
    # Their addresses are not known in advance (pods addressed by IP): the
    # strategy's cluster spec waits until each ps announced itself.
    from keras_ps.elastic.resolver import ElasticClusterResolver

    _, endpoint = rdzv.start(keepalive_timeout=60.0)  # the ps' lease too
    ps, worker = rdzv.client(endpoint), rdzv.client(endpoint)
    ps.announce_ps(0, A, "ps-0")
    resolver = ElasticClusterResolver(endpoint, ps=2, startup_timeout=0.5)
    try:
        worker.get_cluster_spec(C, 1, 1, timeout=10)
        _gives_up_after(resolver, 0.5, "ps [1] of ps=2 announced no address",
                        endpoint, "python -m keras_ps.server --rdzv_endpoint "
                        f"{endpoint}")
        assert resolver.ps_address(1) is None
        ps.announce_ps(1, B, "ps-1")
        spec = resolver.cluster_spec().as_dict()
        assert spec == {"ps": [A, B], "worker": [C]}, spec
    finally:
        resolver.close()


@pytest.mark.timeout(60)
def test_a_resolver_sends_the_token_from_the_environment(rdzv, monkeypatch):
    # As the agent and a ps do: $KERAS_PS_RDZV_TOKEN unless given token=.
    from keras_ps.elastic.resolver import ElasticClusterResolver

    _, endpoint = rdzv.start(token="s3cret")
    rdzv.client(endpoint, token="s3cret").get_cluster_spec(A, 1, 1, timeout=10)
    monkeypatch.setenv("KERAS_PS_RDZV_TOKEN", "s3cret")
    resolver = ElasticClusterResolver(endpoint, ps=[B], startup_timeout=10)
    try:
        assert resolver.cluster_spec().as_dict() == {"ps": [B], "worker": [A]}
    finally:
        resolver.close()
    monkeypatch.setenv("KERAS_PS_RDZV_TOKEN", "wrong")
    resolver = ElasticClusterResolver(endpoint, ps=[B], startup_timeout=5)
    try:
        with pytest.raises(api.RendezvousAuthError, match="token"):
            resolver.cluster_spec()
    finally:
        resolver.close()
    given = ElasticClusterResolver(endpoint, ps=[B], token="s3cret",
                                   startup_timeout=10)
    try:
        assert given.cluster_spec().as_dict()["worker"] == [A]
    finally:
        given.close()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(startup_timeout=-1), "startup_timeout=-1"),
    (dict(startup_timeout=float("nan")), "startup_timeout=nan"),
    (dict(startup_timeout="60"), "startup_timeout='60'"),
    (dict(min_workers=0), "min_workers=0"),
    (dict(poll_interval=0), "poll_interval=0"),
    (dict(ps=[]), "ps=[]"),
    (dict(ps=0), "ps=0"),
])
def test_resolver_refuses_bad_arguments(kwargs, needle):
    from keras_ps.elastic.resolver import ElasticClusterResolver

    arguments = dict(rdzv_endpoint="localhost:1", ps=["localhost:2"])
    arguments.update(kwargs)
    with pytest.raises(ValueError) as raised:
        ElasticClusterResolver(**arguments)
    assert needle in str(raised.value), raised.value


@pytest.mark.timeout(30)
def test_single_connect(rdzv):
    _, endpoint = rdzv.start()
    c = rdzv.client(endpoint)
    spec = c.get_cluster_spec(A, 1, 1, timeout=10)
    assert spec == api.MembershipView((A,), 0, 1)
    assert c.get_waiting_nodes(A) == 0


@pytest.mark.timeout(30)
def test_multi_connect(rdzv):
    _, endpoint = rdzv.start(gather_timeout=5.0)
    specs = rdzv.join_all(endpoint, [A, B, C], 3, 3)
    assert {s.workers for s in specs} == {specs[0].workers}
    assert sorted(s.index for s in specs) == [0, 1, 2]
    assert sorted(specs[0].workers) == [A, B, C]
    for address, spec in zip([A, B, C], specs):
        assert spec.workers[spec.index] == address
        assert spec.version == 1
    started = time.monotonic()  # an admitted node gets the spec at once
    again = rdzv.client(endpoint).get_cluster_spec(B, 3, 3, timeout=10)
    assert time.monotonic() - started < 1.0
    assert again == specs[1]


@pytest.mark.timeout(30)
def test_waiting_workers(rdzv):
    _, endpoint = rdzv.start()
    rdzv.join_all(endpoint, [A, B], 2, 4)
    a = rdzv.client(endpoint)
    assert a.get_waiting_nodes(A) == 0
    spec = rdzv.client(endpoint).get_cluster_spec(C, 2, 4, timeout=10)
    assert (spec.index, spec.version, spec.size) == (2, 2, 3)
    assert a.get_waiting_nodes(A) == 1
    assert a.get_waiting_nodes(A) == 0
    assert a.get_waiting_nodes(B) == 1
    rdzv.client(endpoint).get_cluster_spec(D, 2, 4, timeout=10)
    assert a.get_waiting_nodes(A) == 1
    assert a.get_waiting_nodes(C) == 1


@pytest.mark.timeout(60)
def test_reset_workers(rdzv):
    server, endpoint = rdzv.start(keepalive_timeout=1.0)
    rdzv.join_all(endpoint, [A, B, C], 3, 3)
    a = rdzv.client(endpoint)
    assert a.get_waiting_nodes(A) == 0
    assert a.leave(C)  # C leaves cleanly; B goes silent and expires
    seen = []
    wait_until(lambda: seen.append(a.get_waiting_nodes(A)) or sum(seen) == -2,
               10, "A to see two nodes lost")
    assert min(seen) < 0
    with pytest.raises(api.RendezvousUnknownNodeError):
        a.get_waiting_nodes(B)
    a_index = a.get_cluster_spec(A, 3, 3, timeout=5).index
    assert server.snapshot().workers[a_index:] == (A,)
    rejoined = rdzv.join_all(endpoint, [B, C], 3, 3)
    assert {s.index for s in rejoined} | {a_index} == {0, 1, 2}
    assert a.get_waiting_nodes(A) == 2
    assert sorted(a.get_cluster_spec(A, 3, 3, timeout=5).addresses) == [A, B, C]


@pytest.mark.timeout(30)
def test_synchronize(rdzv):
    _, endpoint = rdzv.start()
    rdzv.join_all(endpoint, [A, B, C], 3, 3)
    futures = [rdzv.pool.submit(rdzv.client(endpoint).synchronize, a, "step",
                                a.encode() * 3, 10)
               for a in (A, B, C)]
    expected = {a: a.encode() * 3 for a in (A, B, C)}
    assert [f.result(timeout=20) for f in futures] == [expected] * 3
    # Same tag again: a new generation with new data.
    futures = [rdzv.pool.submit(rdzv.client(endpoint).synchronize, a, "step",
                                b"", 10)
               for a in (A, B, C)]
    assert [f.result(timeout=20) for f in futures] == [
        dict.fromkeys((A, B, C), b"")] * 3


@pytest.mark.timeout(30)
def test_synchronize_fail(rdzv):
    _, endpoint = rdzv.start()
    rdzv.join_all(endpoint, [A, B, C], 3, 3)
    started = time.monotonic()
    futures = [rdzv.pool.submit(rdzv.client(endpoint).synchronize, a, "step",
                                b"x", 1.0)
               for a in (A, B)]
    for future in futures:
        with pytest.raises(api.RendezvousTimeoutError) as info:
            future.result(timeout=20)
        assert info.value.missing == (C,)
        assert C in str(info.value) and "step" in str(info.value)
    assert 0.9 < time.monotonic() - started < 10


@pytest.mark.timeout(30)
def test_barrier(rdzv):
    _, endpoint = rdzv.start()
    rdzv.join_all(endpoint, [A, B, C], 3, 3)
    for round_ in range(3):  # the tag is reusable once a meeting completed
        futures = [rdzv.pool.submit(rdzv.client(endpoint).barrier, a, "sync",
                                    10) for a in (A, B, C)]
        assert [f.result(timeout=20) for f in futures] == [None] * 3


@pytest.mark.timeout(30)
def test_barrier_fail(rdzv):
    _, endpoint = rdzv.start()
    rdzv.join_all(endpoint, [A, B, C, D], 4, 4)
    futures = [rdzv.pool.submit(rdzv.client(endpoint).barrier, a, "b", 1.0)
               for a in (A, C)]
    for future in futures:
        with pytest.raises(api.RendezvousTimeoutError) as info:
            future.result(timeout=20)
        assert set(info.value.missing) == {B, D}
        assert info.value.missing_count == 2
        assert B in str(info.value) and D in str(info.value)
    # After the failure the tag works again.
    futures = [rdzv.pool.submit(rdzv.client(endpoint).barrier, a, "b", 10)
               for a in (A, B, C, D)]
    assert [f.result(timeout=20) for f in futures] == [None] * 4


# --------------------------------------------------------- more behaviour


@pytest.mark.timeout(30)
def test_independent_tags(rdzv):
    server, endpoint = rdzv.start()
    rdzv.join_all(endpoint, [A, B], 2, 2)
    a_x = rdzv.pool.submit(rdzv.client(endpoint).barrier, A, "x", 10)
    b_y = rdzv.pool.submit(rdzv.client(endpoint).barrier, B, "y", 10)
    wait_until(lambda: server.snapshot().open_meetings == 2, 10,
               "two open meetings")
    rdzv.client(endpoint).barrier(B, "x", 10)
    assert a_x.result(timeout=10) is None
    assert not b_y.done()
    rdzv.client(endpoint).barrier(A, "y", 10)
    assert b_y.result(timeout=10) is None


@pytest.mark.timeout(30)
def test_max_nodes_overflow_waits_for_a_free_place(rdzv):
    server, endpoint = rdzv.start()
    a_spec, b_spec = rdzv.join_all(endpoint, [A, B], 2, 2)
    c_spec = rdzv.pool.submit(rdzv.client(endpoint).get_cluster_spec, C, 2, 2,
                              20)
    wait_until(lambda: server.snapshot().waiting == (C,), 10, "C waiting")
    assert not c_spec.done()
    b = rdzv.client(endpoint)
    assert b.keep_alive(B).count == 0
    assert b.leave(A)
    spec = c_spec.result(timeout=10)  # C takes A's place; B keeps its own
    assert (spec.index, spec.version) == (a_spec.index, 2)
    assert spec.workers[b_spec.index] == B and spec.size == 2
    change = b.keep_alive(B)
    assert (change.count, change.joined, change.lost) == (0, 1, 1)


@pytest.mark.timeout(30)
def test_lease_expiry_seen_as_minus_one(rdzv):
    _, endpoint = rdzv.start(keepalive_timeout=1.0)
    rdzv.join_all(endpoint, [A, B], 2, 2)
    a = rdzv.client(endpoint)
    started = time.monotonic()
    wait_until(lambda: a.get_waiting_nodes(A) == -1, 10, "B's lease to lapse")
    assert time.monotonic() - started >= 0.9
    with pytest.raises(api.RendezvousUnknownNodeError):
        rdzv.client(endpoint).get_waiting_nodes(B)


@pytest.mark.timeout(30)
def test_token(rdzv):
    _, endpoint = rdzv.start(token="s3cret")
    good = rdzv.client(endpoint, token="s3cret")
    assert good.get_cluster_spec(A, 1, 1, timeout=10).workers == (A,)
    for bad in (rdzv.client(endpoint, token="wrong"), rdzv.client(endpoint)):
        with pytest.raises(api.RendezvousAuthError, match="token"):
            bad.get_waiting_nodes(A)
        with pytest.raises(api.RendezvousAuthError):
            bad.get_cluster_spec(B, 1, 1, timeout=5)
    assert good.get_waiting_nodes(A) == 0


def _slow_to_answer(endpoint, delay):
    """A loopback TCP relay to `endpoint` that holds back the server's first
    bytes of each connection (its HTTP/2 SETTINGS frame) for `delay`
    seconds, as a server on a busy machine sends them late. Returns
    (its HOST:PORT, a function that closes it)."""
    host, port = endpoint.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    sockets = [listener]

    def pump(source, target, hold):
        time.sleep(hold)
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        for s in (source, target):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def accept():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection((host, int(port)))
            sockets.extend([client, server])
            for args in ((client, server, 0.0), (server, client, delay)):
                threading.Thread(target=pump, args=args, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()

    def close():
        for s in sockets:
            s.close()
    return f"127.0.0.1:{listener.getsockname()[1]}", close


@pytest.mark.timeout(60)
def test_a_server_slow_to_send_its_first_frame_is_joined(rdzv):
    # gRPC gives a connection attempt the client's "min reconnect backoff"
    # as its time limit: set to 0.1 s, a join through a server whose first
    # frame came 0.5 s late failed with "rendezvous server ... is
    # unavailable: connection attempt timed out before receiving SETTINGS
    # frame", as agents on a busy machine did.
    _, endpoint = rdzv.start()
    relayed, close = _slow_to_answer(endpoint, 0.5)
    try:
        assert rdzv.client(relayed).get_cluster_spec(A, 1, 1, timeout=20) \
            == api.MembershipView((A,), 0, 1)
    finally:
        close()


@pytest.mark.timeout(30)
def test_tls(rdzv, tmp_path):
    cert, key = self_signed_cert(tmp_path)
    _, endpoint = rdzv.start(tls={"tls_cert": str(cert),
                                  "tls_key": key.read_bytes()})
    secure = rdzv.client(endpoint, tls_root_cert=str(cert))
    assert secure.get_cluster_spec(A, 1, 1, timeout=10) == api.MembershipView(
        (A,), 0, 1)
    plaintext = rdzv.client(endpoint, timeout=3.0)
    started = time.monotonic()
    with pytest.raises(api.RendezvousClosedError, match="unavailable") as info:
        plaintext.get_waiting_nodes(A)
    assert time.monotonic() - started < 5
    # Its port takes connections: the error says to give the certificate.
    assert "a rendezvous started with --tls_cert speaks TLS only" in \
        str(info.value), info.value
    for where in ("the agent's --tls_root_cert",
                  "ElasticClusterResolver(tls_root_cert=...)",
                  "$KERAS_PS_RDZV_TLS_ROOT_CERT"):
        assert where in str(info.value), info.value
    # The other way round: a client given a certificate, a plaintext server.
    _, plain_endpoint = rdzv.start()
    with pytest.raises(api.RendezvousClosedError) as info:
        rdzv.client(plain_endpoint, tls_root_cert=cert.read_bytes(),
                    timeout=3.0).get_waiting_nodes(A)
    assert "a rendezvous started without --tls_cert speaks plaintext; give " \
        "its clients no root certificate" in str(info.value), info.value
    # A server that is down refuses connections: no word of TLS.
    down = f"127.0.0.1:{portpicker.pick_unused_port()}"
    with pytest.raises(api.RendezvousClosedError) as info:
        rdzv.client(down, timeout=3.0).get_waiting_nodes(A)
    assert "TLS" not in str(info.value), info.value


_BIG = b"x" * (api.MAX_DATA_BYTES + 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rpc, request_, field, value", [
    ("GetClusterSpec", pb.GetClusterSpecRequest(address="", min_nodes=1,
                                                max_nodes=1), "address", "''"),
    ("GetClusterSpec", pb.GetClusterSpecRequest(address="nohost", min_nodes=1,
                                                max_nodes=1), "address",
     "nohost"),
    ("GetClusterSpec", pb.GetClusterSpecRequest(address="h:0", min_nodes=1,
                                                max_nodes=1), "address", "h:0"),
    ("GetClusterSpec", pb.GetClusterSpecRequest(address="h:65536",
                                                min_nodes=1, max_nodes=1),
     "address", "h:65536"),
    ("GetClusterSpec", pb.GetClusterSpecRequest(address=A, min_nodes=0,
                                                max_nodes=1), "min_nodes", "0"),
    ("GetClusterSpec", pb.GetClusterSpecRequest(address=A, min_nodes=3,
                                                max_nodes=2), "max_nodes", "2"),
    ("GetClusterSpec", pb.GetClusterSpecRequest(address=A, min_nodes=1,
                                                max_nodes=1, timeout=-1.0),
     "timeout", "-1.0"),
    ("GetWaitingNodes", pb.GetWaitingNodesRequest(address="h:x"), "address",
     "h:x"),
    ("Leave", pb.LeaveRequest(address=""), "address", "''"),
    ("Barrier", pb.BarrierRequest(address=A, tag=""), "tag", "''"),
    ("Barrier", pb.BarrierRequest(address=A, tag="t", timeout=-2.5),
     "timeout", "-2.5"),
    ("Barrier", pb.BarrierRequest(address=A, tag="t", generation=-1),
     "generation", "-1"),
    ("Synchronize", pb.SynchronizeRequest(address=A, tag=""), "tag", "''"),
    ("Synchronize", pb.SynchronizeRequest(address="", tag="t"), "address",
     "''"),
    ("Synchronize", pb.SynchronizeRequest(address=A, tag="t", data=_BIG),
     "data", str(len(_BIG))),
], ids=lambda v: v if isinstance(v, str) else None)
def test_malformed_requests_are_invalid_argument(rdzv, rpc, request_, field,
                                                 value):
    _, endpoint = rdzv.start()
    with grpc.insecure_channel(endpoint) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, rpc)(request_, timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details() and value in info.value.details()


@pytest.mark.timeout(30)
def test_client_maps_invalid_argument_to_value_error(rdzv):
    _, endpoint = rdzv.start()
    with pytest.raises(api.RendezvousInvalidArgumentError, match="min_nodes"):
        rdzv.client(endpoint).get_cluster_spec(A, 0, 1, timeout=5)
    with pytest.raises(ValueError, match="tag"):
        rdzv.client(endpoint).barrier(A, "", 5)


# ----------------------------------------------- real server subprocesses


class LaunchedServer:
    """`python -m keras_ps.elastic.launch --standalone` on a given port."""

    def __init__(self, port, log_path, env=None):
        self.endpoint = f"127.0.0.1:{port}"
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keras_ps.elastic.launch", "--standalone",
             f"--rdzv_endpoint={self.endpoint}"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=self._log,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {})))
        self.log_path = log_path
        probe = RendezvousClient(self.endpoint, timeout=2.0)
        try:
            wait_until(lambda: self._answers(probe), 60, "the server to start")
        finally:
            probe.close()

    def _answers(self, probe):
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited with {self.proc.returncode}: "
                                 f"{open(self.log_path).read()[-2000:]}")
        try:
            probe.get_waiting_nodes("127.0.0.1:1")
        except api.RendezvousUnknownNodeError:
            return True
        except api.RendezvousError:
            return False

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture
def launched(tmp_path):
    started = []

    def start(port, env=None):
        server = LaunchedServer(port, tmp_path / f"server{len(started)}.log",
                                env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.mark.timeout(90)
def test_server_restart_nodes_reregister(rdzv, launched):
    port = portpicker.pick_unused_port()
    first = launched(port)
    specs = rdzv.join_all(first.endpoint, [A, B], 2, 2)
    assert sorted(specs[0].workers) == [A, B]
    a = rdzv.client(first.endpoint)
    assert a.get_waiting_nodes(A) == 0
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=10)
    with pytest.raises(api.RendezvousClosedError):
        a.get_waiting_nodes(A)

    second = launched(port)

    def not_found():
        try:
            a.get_waiting_nodes(A)
        except api.RendezvousUnknownNodeError:
            return True
        except api.RendezvousClosedError:
            return False
        raise AssertionError("the restarted server knew A")

    wait_until(not_found, 20, "the restarted server to answer NOT_FOUND")
    specs = rdzv.join_all(second.endpoint, [A, B], 2, 2)
    assert sorted(specs[0].workers) == [A, B]
    assert specs[0].version == 1
    assert a.get_waiting_nodes(A) == 0


@pytest.mark.timeout(60)
def test_sigterm_exits_zero_quickly(rdzv, launched):
    server = launched(portpicker.pick_unused_port())
    waiter = rdzv.pool.submit(rdzv.client(server.endpoint).get_cluster_spec,
                              A, 2, 2, 30)
    probe = rdzv.client(server.endpoint)
    wait_until(lambda: _registered(probe, A), 10, "A registered")
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=10) == 0
    assert time.monotonic() - started < 5
    with pytest.raises(api.RendezvousClosedError):
        waiter.result(timeout=10)


def _registered(client, address):
    try:
        return client.keep_alive(address).state is NodeState.WAITING
    except api.RendezvousUnknownNodeError:
        return False


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, expected", [
    ([], "--standalone"),
    (["--standalone"], "--rdzv_endpoint"),
    (["--standalone", "--rdzv_endpoint=nohost"], "nohost"),
    (["--standalone", "--rdzv_endpoint=127.0.0.1:0", "--gather_timeout=-1"],
     "gather_timeout"),
    (["--standalone", "--rdzv_endpoint=127.0.0.1:0", "--keepalive_timeout=x"],
     "keepalive_timeout"),
    (["--standalone", "--rdzv_endpoint=127.0.0.1:0", "--tls_cert=c.pem"],
     "--tls_key"),
    (["--standalone", "--bogus"], "--bogus"),
])
def test_launch_rejects_bad_flags(capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        launch.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err and expected in err


# ------------------------------------------------------------------ flood


FLOOD_JOINS = 3000
FLOOD_MAX_RSS_GROWTH = 50 * 2**20
FLOOD_MAX_RSS_GROWTH_FROM_COLD = 100 * 2**20
# The server drops a node whose keep-alives stop for its keep-alive timeout
# (5 s here): answered within it, the legitimate node keeps its place.
FLOOD_KEEPALIVE_TIMEOUT = 5


@pytest.mark.timeout(90)
def test_join_flood_keeps_keepalives_and_memory_bounded(launched):
    server = launched(portpicker.pick_unused_port(),
                      env={"KERAS_PS_RDZV_GATHER_TIMEOUT": "0",
                           "KERAS_PS_RDZV_KEEPALIVE_TIMEOUT":
                               str(FLOOD_KEEPALIVE_TIMEOUT)})
    legit = RendezvousClient(server.endpoint, timeout=5.0)
    assert legit.get_cluster_spec(A, 1, 1, timeout=10).workers == (A,)
    process = psutil.Process(server.proc.pid)
    rss_cold = process.memory_info().rss

    latencies, errors, stop = [], [], threading.Event()

    def keep_alive():
        while not stop.is_set():
            started = time.monotonic()
            try:
                latencies.append((legit.get_waiting_nodes(A),
                                  time.monotonic() - started))
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)
            stop.wait(0.05)

    keeper = threading.Thread(target=keep_alive)
    keeper.start()
    channels = [grpc.insecure_channel(server.endpoint) for _ in range(8)]
    try:
        stubs = [pb_grpc.RendezvousStub(c) for c in channels]
        # Warm-up: the server spins up its fixed pool of max_workers threads
        # (a one-off cost bounded by the config, ~15-20 MiB of stacks and
        # malloc arenas); the bound below is on what the flood adds.
        warm_up = [
            stubs[i % len(stubs)].GetClusterSpec.future(
                pb.GetClusterSpecRequest(address=f"10.255.{i}.1:1",
                                         min_nodes=1, max_nodes=1,
                                         timeout=0.5), timeout=3.0)
            for i in range(200)]
        for future in warm_up:
            future.exception()
        rss_before = process.memory_info().rss
        started = time.monotonic()
        outcomes = collections.Counter()
        refusal_details = set()
        futures = [
            stubs[i % len(stubs)].GetClusterSpec.future(
                pb.GetClusterSpecRequest(
                    address=f"10.{i // 250}.{i % 250}.1:{1000 + i}",
                    min_nodes=1, max_nodes=1, timeout=1.0),
                timeout=3.0)
            for i in range(FLOOD_JOINS)]
        for future in futures:
            try:
                outcomes[pb.NodeStatus.Name(future.result().status)] += 1
            except grpc.RpcError as error:
                outcomes[error.code().name] += 1
                if error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refusal_details.add(error.details().split(":")[0][:40])
        flood_seconds = time.monotonic() - started
        rss_after = process.memory_info().rss
        rss_growth = rss_after - rss_before
        rss_cold_growth = rss_after - rss_cold
        during = len(latencies)
        wait_until(lambda: len(latencies) > during + 3, 10, "keep-alives")
    finally:
        stop.set()
        keeper.join()
        for c in channels:
            c.close()
    print(f"\nflood: {dict(outcomes)} in {flood_seconds:.2f}s; server RSS "
          f"growth {rss_growth / 2**20:.1f} MiB (from cold "
          f"{rss_cold_growth / 2**20:.1f} MiB); keep-alive latency max "
          f"{max(t for _, t in latencies) * 1000:.0f} ms over "
          f"{len(latencies)} calls")

    # Waiting nodes beyond max_nodes are capped at max_pending_nodes (1024);
    # the rest is refused at once. (gRPC's own overload protection may cancel
    # a few calls it cannot even queue: CANCELLED.) A flood node never keeps
    # alive, so it is dropped after the keep-alive timeout and its place goes
    # to a later join: a flood that lasts longer than the timeout (a loaded
    # machine: 5.7 s once) registers up to one more cap's worth per timeout.
    assert set(outcomes) <= {"WAITING", "DEADLINE_EXCEEDED",
                             "RESOURCE_EXHAUSTED", "CANCELLED"}
    windows = 1 + int(flood_seconds // FLOOD_KEEPALIVE_TIMEOUT)
    assert outcomes["WAITING"] + outcomes["DEADLINE_EXCEEDED"] <= 1024 * windows
    assert outcomes["RESOURCE_EXHAUSTED"] >= 1000
    assert any("refusing node" in d for d in refusal_details)
    # The legitimate node's keep-alives kept answering, each within its
    # keep-alive timeout, and it kept its place.
    assert not errors, errors[:3]
    assert all(count == 0 for count, _ in latencies)
    assert max(t for _, t in latencies) < FLOOD_KEEPALIVE_TIMEOUT
    assert rss_growth < FLOOD_MAX_RSS_GROWTH
    assert rss_cold_growth < FLOOD_MAX_RSS_GROWTH_FROM_COLD
    assert legit.get_cluster_spec(A, 1, 1, timeout=5).workers == (A,)
    legit.close()


# ------------------------------------------------- observer (ListMembers)


@pytest.mark.timeout(30)
def test_list_members_observes_without_joining(rdzv):
    server, endpoint = rdzv.start()
    observer = rdzv.client(endpoint)
    empty = observer.list_members()
    assert (empty.workers, empty.index) == ((), -1)
    rdzv.join_all(endpoint, [A, B], 2, 3)
    seen = observer.list_members()
    # A and B joined at once: either may have registered first.
    assert sorted(seen.workers) == [A, B] and seen.version > empty.version
    # The observer is no node: nothing registered, nothing waiting.
    assert server.snapshot().workers == seen.workers
    assert server.snapshot().waiting == ()
    # A long poll on the known version returns once the membership moves.
    first, last = seen.workers
    future = rdzv.pool.submit(observer.list_members, seen.version, 5.0)
    rdzv.client(endpoint).leave(last)
    moved = future.result(timeout=10)
    assert moved.workers == (first,) and moved.version > seen.version
    # Unchanged version: held at most `timeout`, then the current view.
    assert observer.list_members(moved.version, 0.2).version == moved.version
    _, guarded = rdzv.start(token="s3cret")
    assert rdzv.client(guarded, token="s3cret").list_members().workers == ()
    for bad in (rdzv.client(guarded, token="wrong"), rdzv.client(guarded)):
        with pytest.raises(api.RendezvousAuthError, match="token"):
            bad.list_members()
