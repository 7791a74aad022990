"""Connections to a task whose machine is gone fail within a bound.

A task killed on a live machine resets its connections: every call to it
fails at once. A machine that vanishes (a preempted VM, a deleted pod, a
route that drops packets) sends nothing back. TF's gRPC connections between
tasks have no keepalive, so a call to it waited until the kernel gave the
connection up: about 15 minutes of retransmissions on Linux. A function
traced meanwhile waited as long, since TF registers each new function on
every task: with a worker's VM gone, the other worker's trace held it, and
a job of two workers stopped until the lost one came back.

This sets, on each TCP connection of this process to or from a task,
keepalive probes and `TCP_USER_TIMEOUT`: the kernel gives a connection up
once the peer's host has acknowledged nothing for `timeout` seconds, and
gRPC fails its calls with UnavailableError, which keras_ps' failure handling
takes from there (a worker set aside, a ps recovered). Only the peer's
kernel has to answer: a stopped (SIGSTOP) or busy process on a live host
keeps its connections, its slow calls running (one whose receive buffer
stays full that long may be given up too: Linux counts its probes of a
closed window against the timeout). TF offers no option for either
setting, and its sockets are gRPC's, so a thread finds this process' new
sockets in /proc/self/fd once a second and sets them on a duplicate of the
descriptor. Linux only; elsewhere nothing is set.

A call made once its connection was given up connects again first, and
gRPC gives each attempt 20 s: to an address that drops packets, that wait
came twice in a ps' recovery (52 s from the loss to the failed calls, 20 s
more reconnecting, where 32 s and 5 s with the bound below). The attempt's
bound is a channel option, which TF takes from TF_GRPC_DEFAULT_OPTIONS:
`bound_connect_attempts` sets it there (unless the user did) before this
process connects or serves.
"""

import logging
import os
import socket
import threading
import time

from keras_ps import _constants
from keras_ps.cluster import _network

logger = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"
_TF_GRPC_OPTIONS = "TF_GRPC_DEFAULT_OPTIONS"
# gRPC's name for the least time it gives an attempt to connect (20 s by
# default), not a backoff.
_CONNECT_OPTION = "grpc.min_reconnect_backoff_ms"
_SCAN_INTERVAL_S = 1.0
# Keepalive probes start after a connection has been idle this share of the
# timeout, and are sent this many times within the rest of it.
_IDLE_SHARE, _PROBES = 0.5, 5

class _Watched:
    """What this process' thread sets the options on (under `lock`)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ports = set()  # a socket to or from one of these is a task's
        self.every_socket = False
        self.generation = 0  # counts changes of the two above
        self.thread = None


_watched = _Watched()


def _forget():  # a forked child has none of its parent's threads or locks
    global _watched
    _watched = _Watched()


os.register_at_fork(after_in_child=_forget)


def timeout_from_env():
    """KERAS_PS_PEER_TIMEOUT in seconds (0: off).

    Raises:
        ValueError: not a number, negative, or between 0 and 1 s (the
            kernel's user timeout is in milliseconds, keepalive in seconds).
    """
    value = _constants.env_float(_constants.PEER_TIMEOUT_ENV_VAR,
                                 _constants.DEFAULT_PEER_TIMEOUT, minimum=0)
    if 0 < value < 1:
        raise ValueError(
            f"Environment variable {_constants.PEER_TIMEOUT_ENV_VAR} must be "
            f"0 (off) or at least 1 second. Received: "
            f"{_constants.PEER_TIMEOUT_ENV_VAR}="
            f"{os.environ[_constants.PEER_TIMEOUT_ENV_VAR]!r}. Unset it for "
            f"the default {_constants.DEFAULT_PEER_TIMEOUT:g}.")
    return value


def bound_connect_attempts(timeout):
    """Has gRPC give up an attempt to connect after a sixth of the peer
    `timeout` (2 to 20 s) instead of 20 s, by TF_GRPC_DEFAULT_OPTIONS; an
    option the user set there is kept. Nothing with `timeout` 0. Call it
    before this process makes its first TF channel (TF may read the
    variable once)."""
    options = os.environ.get(_TF_GRPC_OPTIONS, "")
    if not timeout or _CONNECT_OPTION in options:
        return
    bound_ms = int(min(20.0, max(2.0, timeout / 6)) * 1000)
    os.environ[_TF_GRPC_OPTIONS] = ",".join(
        filter(None, [options, f"{_CONNECT_OPTION}={bound_ms}"]))


def watch(addresses=(), every_socket=False):
    """Sets the bound on this process' connections to or from the ports of
    `addresses` ("host:port"), or on every TCP connection of the process
    with `every_socket` (a task's server process: all of them are TF's),
    from now on; later calls add to it. Returns the timeout in seconds (0:
    off, or not Linux).

    Raises:
        ValueError: a bad KERAS_PS_PEER_TIMEOUT (see timeout_from_env), or
            an address that is not "host:port".
    """
    timeout = timeout_from_env()
    if not timeout or not os.path.isdir(_FD_DIR):
        return 0.0
    bound_connect_attempts(timeout)
    watched = _watched
    with watched.lock:
        before = (len(watched.ports), watched.every_socket)
        watched.ports.update(_network.split_address(a)[1]
                             for a in addresses)
        watched.every_socket = watched.every_socket or every_socket
        if (len(watched.ports), watched.every_socket) != before:
            watched.generation += 1
        if watched.thread is None:
            watched.thread = threading.Thread(
                target=_run, args=(watched, timeout), daemon=True,
                name="keras_ps-dead-peers")
            watched.thread.start()
            logger.info("connections to tasks are given up after %gs "
                        "without an answer from the peer's host (%s)",
                        timeout, _constants.PEER_TIMEOUT_ENV_VAR)
    return timeout


def _run(watched, timeout):
    seen, skipped, generation = set(), set(), None
    while True:
        with watched.lock:
            ports, every_socket = set(watched.ports), watched.every_socket
            if generation != watched.generation:
                # New tasks: sockets passed over may be theirs now.
                generation = watched.generation
                skipped.clear()
        try:
            configure(timeout, seen, ports, every_socket, skipped)
        except Exception:  # never let the thread end: log, try again
            logger.exception("setting the peer timeout on sockets failed")
        time.sleep(_SCAN_INTERVAL_S)


def configure(timeout, seen, ports, every_socket, skipped=None):
    """Sets the options on each connected TCP socket of this process whose
    local or peer port is in `ports`, or on every one with `every_socket`,
    and adds its inode to `seen`; one in `seen` (set already) or `skipped`
    is passed over, and one not a task's is added to `skipped` (if given).
    Inodes no longer open leave both. Returns how many sockets it set."""
    present, done = set(), 0
    skipped = set() if skipped is None else skipped
    for fd, inode in _sockets():
        present.add(inode)
        if inode in seen or inode in skipped:
            continue
        verdict = _set_options(fd, inode, timeout, ports, every_socket)
        if verdict:
            seen.add(inode)
            done += 1
        elif verdict is not None:  # None: not connected yet, look again
            skipped.add(inode)
    seen.intersection_update(present)
    skipped.intersection_update(present)
    return done


def _sockets():
    """(fd, inode) of each socket this process has open."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return
    for name in names:
        try:
            target = os.readlink(os.path.join(_FD_DIR, name))
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            yield int(name), int(target[len("socket:["):-1])


def _set_options(fd, inode, timeout, ports, every_socket):
    """True if set, False if not a task's TCP connection, None if it is not
    connected yet. Works on a duplicate of `fd`, checked to be the same
    socket (the number may have been reused since it was listed)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        sock = (socket.socket(fileno=dup) if os.fstat(dup).st_ino == inode
                else None)
    except OSError:
        sock = None
    if sock is None:
        os.close(dup)
        return False
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET, socket.AF_INET6):
            return False
        try:
            local, peer = sock.getsockname()[1], sock.getpeername()[1]
        except OSError:  # listening, or its connect still under way
            return None if sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0 else False
        if not every_socket and local not in ports and peer not in ports:
            return False
        idle = max(1, int(timeout * _IDLE_SHARE))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL,
                        max(1, int((timeout - idle) / _PROBES)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _PROBES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                        int(timeout * 1000))
        return True
    except OSError:  # closed meanwhile
        return False
    finally:
        sock.detach()
        os.close(dup)
