"""A cluster resolver whose worker list follows the rendezvous membership.

The chief's address is fixed; the workers are whoever the rendezvous
admitted; a ps is where it last announced itself to the rendezvous
(`python -m keras_ps.server --rdzv_endpoint`), else where it was given.
The resolver only observes (`RendezvousClient.list_members`): it is no
node of the rendezvous. This module imports TensorFlow, so
`keras_ps.elastic` exports `ElasticClusterResolver` lazily (see its
`__init__`), keeping the rendezvous server and agent free of TensorFlow.
"""

import logging
import math
import numbers
import os
import threading
import time
from typing import Callable, List, Optional, Sequence, Union

import tensorflow as tf

from keras_ps import cluster as cluster_lib
from keras_ps.elastic import api
from keras_ps.elastic.client import RendezvousClient
from keras_ps.elastic.client import tls_root_cert_or_env
from keras_ps.elastic.rendezvous_server import PemSource

logger = logging.getLogger(__name__)

#: Seconds the resolver's watch long-polls the rendezvous per call.
DEFAULT_POLL_INTERVAL = 2.0
# Seconds between two reads of the ps' announcements while some ps has no
# address yet (an announcement does not move the membership's version, on
# which the reads are held).
_PS_POLL_S = 0.2


class ElasticClusterResolver(tf.distribute.cluster_resolver.ClusterResolver,
                             cluster_lib.MembershipWatcher):
    """Chief and ps given; workers as the rendezvous admits them.

    A ps started with `python -m keras_ps.server --rdzv_endpoint` announces
    its address to the rendezvous while it runs; the announced address wins
    over the one given here, so a lost ps that comes back on another address
    (a rescheduled pod, a new VM) is followed there (see `ps_address`).

    Args:
        rdzv_endpoint: The rendezvous server's HOST:PORT.
        ps: The parameter-server addresses (each one replaced by the
            address that ps announces), or their number: `cluster_spec()`
            then waits until each ps announced its address.
        chief: The coordinator's address, or None (the coordinator is then
            the process that builds the strategy, as with LocalCluster).
        min_workers: `cluster_spec()` waits until this many workers are
            admitted: training starts once `min` workers are present.
        token: The rendezvous token, if the server needs one; default:
            $KERAS_PS_RDZV_TOKEN, as the agent and a ps read it.
        tls_root_cert: The root certificate (PEM bytes or file path) of a
            rendezvous that speaks TLS (started with --tls_cert); default:
            the file $KERAS_PS_RDZV_TLS_ROOT_CERT names, else plaintext.
        poll_interval: Longest time one watch call is held on the server;
            changes are reported as soon as they happen regardless.
        startup_timeout: Seconds `cluster_spec()` waits for `min_workers`.
        rpc_layer: The protocol `master(task_type, task_id)` puts before
            a task's address ("grpc": `grpc://HOST:PORT`), as TF's
            resolvers take it.

    Example:
    ```python
    resolver = keras_ps.elastic.ElasticClusterResolver(
        "10.0.0.1:29400", ps=["10.0.0.2:2222"], min_workers=2)
    strategy = keras_ps.ParameterServerStrategy(resolver)
    model.fit(...)  # the coordinator follows joins and departures
    ```
    """

    def __init__(self, rdzv_endpoint: str, ps: Union[Sequence[str], int],
                 chief: Optional[str] = None, min_workers: int = 1,
                 token: Optional[str] = None,
                 tls_root_cert: Optional[PemSource] = None,
                 poll_interval: float = DEFAULT_POLL_INTERVAL,
                 startup_timeout: float = 300.0, rpc_layer: str = "grpc"):
        if isinstance(ps, str):
            raise TypeError(
                f"ps must be a list of 'host:port' addresses, or their number "
                f"when the ps announce themselves. Received: ps={ps!r}, a "
                f"string. Pass ps=[{ps!r}].")
        given = ps
        if isinstance(ps, numbers.Integral) and not isinstance(ps, bool):
            ps = [None] * max(0, ps)  # addresses to learn from the ps
        if not ps:
            raise ValueError(f"ElasticClusterResolver needs at least one ps "
                             f"address (or a number of ps, 1 or more). "
                             f"Received: ps={given!r}.")
        if (isinstance(min_workers, bool)
                or not isinstance(min_workers, numbers.Integral)
                or min_workers < 1):
            raise ValueError(f"min_workers must be an integer, 1 or more. "
                             f"Received: min_workers={min_workers!r}.")
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds. Received: "
                             f"poll_interval={poll_interval!r}.")
        if (not isinstance(startup_timeout, (int, float))
                or isinstance(startup_timeout, bool)
                or not 0 <= startup_timeout < math.inf):
            raise ValueError(
                "startup_timeout must be a number of seconds, 0 or more: how "
                "long cluster_spec() waits for min_workers. Received: "
                f"startup_timeout={startup_timeout!r}.")
        self._ps = list(ps)
        self._chief = chief
        self.min_workers = min_workers
        self.poll_interval = poll_interval
        self.startup_timeout = startup_timeout
        if token is None:
            token = os.environ.get(api.RendezvousConfig.env_var("token"))
        self._client = RendezvousClient(
            rdzv_endpoint, token=token or None,
            tls_root_cert=tls_root_cert_or_env(tls_root_cert))
        self._lock = threading.Lock()
        self._members: Optional[api.MembershipView] = None
        self._watches: List["_Watch"] = []
        self.task_type, self.task_id = None, None
        self.rpc_layer = rpc_layer

    # -- tf.distribute.cluster_resolver.ClusterResolver ------------------------
    def cluster_spec(self) -> tf.train.ClusterSpec:
        """The cluster now; waits until `min_workers` workers are admitted
        (and, given a number of ps, until each announced its address).

        Raises:
            RendezvousTimeoutError: Fewer than `min_workers` workers, or a
                ps with no address, within `startup_timeout` seconds.
        """
        deadline = time.monotonic() + self.startup_timeout
        members = self.wait_for_workers(self.min_workers, self.startup_timeout)
        spec = {"ps": self._wait_for_ps(members, deadline),
                "worker": {i: a for i, a in enumerate(members.workers)
                           if a is not None}}
        if self._chief is not None:
            spec["chief"] = [self._chief]
        return tf.train.ClusterSpec(spec)

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        if task_type is not None and task_id is not None:
            address = self.cluster_spec().task_address(task_type, task_id)
            layer = rpc_layer or self.rpc_layer
            return f"{layer}://{address}" if layer else address
        return ""

    def num_accelerators(self, task_type=None, task_id=None,
                         config_proto=None):
        return {}

    # -- ps --------------------------------------------------------------------
    def ps_address(self, index: int) -> Optional[str]:
        """Where ps `index` serves now: the address it announced to the
        rendezvous, else the last one known (None: none yet). Asks the
        rendezvous at once (it does not wait for workers).

        Raises:
            RendezvousError: The rendezvous did not answer.
        """
        return self._known_ps(self._list_members())[index]

    def _wait_for_ps(self, members: api.MembershipView,
                     deadline: float) -> List[str]:
        """The ps addresses once every ps has one (`ps` given as a number:
        once each announced itself)."""
        while True:
            known = self._known_ps(members)
            missing = [i for i, address in enumerate(known) if not address]
            if not missing:
                return known
            if time.monotonic() >= deadline:
                raise api.RendezvousTimeoutError(
                    f"ps {missing} of ps={len(known)} announced no address "
                    f"to the rendezvous {self._client.endpoint} within "
                    f"{self.startup_timeout:.3g}s. Start each ps with python "
                    f"-m keras_ps.server --rdzv_endpoint "
                    f"{self._client.endpoint} (its own address in its "
                    "cluster spec), give their addresses (ps=[...]), or "
                    "raise startup_timeout")
            time.sleep(min(_PS_POLL_S, max(0.0, deadline - time.monotonic())))
            members = self._list_members()

    def _list_members(self, known_version: int = -1,
                      timeout: float = 0.0) -> api.MembershipView:
        """`RendezvousClient.list_members`, kept as the membership last
        seen."""
        members = self._client.list_members(known_version, timeout)
        with self._lock:
            self._members = members
        return members

    def _known_ps(self, members: api.MembershipView) -> List[str]:
        """The ps addresses, those announced in `members` replacing the
        ones known before (kept once an announcement lapses)."""
        with self._lock:
            for index, address in enumerate(members.ps[:len(self._ps)]):
                if address and address != self._ps[index]:
                    logger.info("[chief] ps %d announced %s to the "
                                "rendezvous (was %s)", index, address,
                                self._ps[index])
                    self._ps[index] = address
            return list(self._ps)

    # -- membership ------------------------------------------------------------
    @property
    def workers(self) -> List[Optional[str]]:
        """Worker addresses by index as last seen (None: a free place)."""
        with self._lock:
            return list(self._members.workers) if self._members else []

    def wait_for_workers(self, count: int,
                         timeout: float) -> api.MembershipView:
        """Waits until `count` workers are admitted; returns the membership.

        Raises:
            RendezvousTimeoutError: Not within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        known = -1
        while True:
            members = self._list_members(
                known, min(self.poll_interval,
                           max(0.0, deadline - time.monotonic())))
            if members.size >= count:
                return members
            if time.monotonic() >= deadline:
                raise api.RendezvousTimeoutError(
                    f"{members.size} of min_workers={count} workers admitted "
                    f"by the rendezvous {self._client.endpoint} within "
                    f"{timeout:.3g}s. Start more worker agents (python -m "
                    "keras_ps.elastic.launch), lower min_workers, or raise "
                    "startup_timeout")
            known = members.version

    def watch(self, callback: Callable[[List[Optional[str]]], None]
              ) -> "_Watch":
        """Calls `callback(worker_addresses)` on every membership change.

        The addresses are by index with None for a free place (what
        `ClusterCoordinator.update_workers` takes). Changes are long-polled,
        so one is reported within milliseconds.

        Returns:
            A handle; call its `stop()` to stop watching.
        """
        with self._lock:
            start = self._members
        handle = _Watch(self, callback, start)
        self._watches.append(handle)
        handle.start()
        return handle

    def close(self):
        """Stops every watch and closes the rendezvous client."""
        for handle in self._watches:
            handle.stop()
        self._client.close()


class _Watch:
    """One thread long-polling the membership for one callback."""

    def __init__(self, resolver, callback, start: Optional[api.MembershipView]):
        self._resolver = resolver
        self._callback = callback
        self._seen = start.workers if start else None
        self._version = start.version if start else -1
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="keras_ps-elastic-watch")

    def start(self):
        self._thread.start()

    def stop(self, timeout: Optional[float] = None):
        self._stopped.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout if timeout is not None
                              else self._resolver.poll_interval + 11.0)

    def _run(self):
        client = self._resolver._client
        while not self._stopped.is_set():
            try:
                members = client.list_members(self._version,
                                              self._resolver.poll_interval)
            except api.RendezvousClosedError as error:
                if self._stopped.is_set():
                    return
                logger.warning("[chief] rendezvous unreachable: %s", error)
                self._stopped.wait(self._resolver.poll_interval)
                continue
            except api.RendezvousError as error:
                logger.warning("[chief] membership watch: %s", error)
                self._stopped.wait(self._resolver.poll_interval)
                continue
            self._version = members.version
            with self._resolver._lock:
                self._resolver._members = members
            if members.workers == self._seen or self._stopped.is_set():
                continue
            self._seen = members.workers
            logger.info("[chief] membership version %s: workers %s",
                        members.version, list(members.workers))
            if members.size < self._resolver.min_workers:
                logger.warning("[chief] %s workers, fewer than min_workers=%s",
                               members.size, self._resolver.min_workers)
            try:
                self._callback(list(members.workers))
            except Exception:  # noqa: BLE001 - keep watching; log the cause
                logger.exception("[chief] membership callback failed")
