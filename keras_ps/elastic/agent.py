"""The local elastic agent: one per worker machine.

It joins the rendezvous with the worker's address, runs the worker TASK (for
example ``python -m keras_ps.server --job_name worker ...``) in a subprocess,
keeps the node's lease alive from a thread, restarts the task when it fails
(up to `max_restarts`), meets the other nodes at an exit barrier when the task
succeeds, and on SIGTERM stops the task and leaves the rendezvous.

The task sees its place through ``{index}`` and ``{address}`` in its
arguments (replaced literally, so JSON braces are left alone) and through the
environment variables ``KERAS_PS_ELASTIC_INDEX``, ``KERAS_PS_ELASTIC_ADDRESS``
and ``KERAS_PS_RDZV_ENDPOINT``. Nothing here imports TensorFlow.
"""

import dataclasses
import enum
import logging
import math
import os
import signal
import subprocess
import threading
from typing import Optional, Tuple

from keras_ps.cluster import _network
from keras_ps.elastic import api
from keras_ps.elastic.client import RendezvousClient
from keras_ps.elastic.rendezvous_server import PemSource

logger = logging.getLogger(__name__)

#: Seconds the task gets to exit after SIGTERM before it is killed.
TASK_STOP_GRACE = 10.0
#: Tag of the barrier nodes meet at when their task succeeded.
EXIT_BARRIER_TAG = "keras_ps-agent-exit"


class TaskStatus(enum.Enum):
    """What the agent's monitor sees of its task."""

    HEALTHY = "healthy"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class AgentDecision(enum.Enum):
    """What the agent does after one look at its task."""

    CONTINUE = "continue"
    RESTART = "restart"
    FINISH = "finish"
    GIVE_UP = "give_up"


def decide(status: TaskStatus, restarts: int,
           max_restarts: int) -> AgentDecision:
    """The agent's failure policy: decides only, the agent acts."""
    if status is TaskStatus.HEALTHY:
        return AgentDecision.CONTINUE
    if status is TaskStatus.SUCCEEDED:
        return AgentDecision.FINISH
    return (AgentDecision.RESTART if restarts < max_restarts
            else AgentDecision.GIVE_UP)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """What one agent runs and where it registers.

    Attributes:
        rdzv_endpoint: The rendezvous server's HOST:PORT.
        address: The worker's HOST:PORT; identifies the node.
        min_nodes: Nodes needed before the first cluster spec.
        max_nodes: Most nodes admitted at once.
        task: The command that runs the worker.
        monitor_interval: Seconds between looks at the task, and between
            keep-alives (keep it well below the server's keepalive_timeout).
        max_restarts: How often a failed task is started again.
        token: The rendezvous token, if the server needs one.
        tls_root_cert: The root certificate (PEM bytes or file path) of a
            rendezvous that speaks TLS (started with --tls_cert); None:
            plaintext.
        join_timeout: Seconds to wait for admission; None waits forever.
        exit_barrier_timeout: Seconds to wait at the exit barrier.
    """

    rdzv_endpoint: str
    address: str
    min_nodes: int
    max_nodes: int
    task: Tuple[str, ...]
    monitor_interval: float = 1.0
    max_restarts: int = 3
    token: Optional[str] = dataclasses.field(default=None, repr=False)
    tls_root_cert: Optional[PemSource] = None
    join_timeout: Optional[float] = None
    exit_barrier_timeout: float = 60.0

    def __post_init__(self):
        api.parse_address(self.rdzv_endpoint, "rdzv_endpoint")
        api.parse_address(self.address, "address")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"nnodes must be MIN:MAX with 1 <= MIN <= MAX. Received: "
                f"min_nodes={self.min_nodes}, max_nodes={self.max_nodes}.")
        if not self.task:
            raise ValueError("the agent needs a TASK command after `--`.")
        if not (math.isfinite(self.monitor_interval)
                and self.monitor_interval > 0):
            raise ValueError(
                f"monitor_interval must be a number of seconds > 0. "
                f"Received: monitor_interval={self.monitor_interval!r}.")
        if self.max_restarts < 0:
            raise ValueError(
                f"max_restarts must be >= 0. Received: "
                f"max_restarts={self.max_restarts}.")


class ElasticAgent:
    """Runs one worker task under the rendezvous (see the module docstring).

    Args:
        config: The `AgentConfig`.
        client: A `RendezvousClient` the caller owns (and closes). None:
            each `run()` makes one from the config and closes it on its way
            out, whichever way that is, so a caller that catches a failed
            join and runs again leaves no channel open.
    """

    def __init__(self, config: AgentConfig, client=None):
        self.config = config
        self._given_client = client
        self._client = client
        self._stop = threading.Event()
        self._process: Optional[subprocess.Popen] = None
        self._spec: Optional[api.MembershipView] = None
        self.restarts = 0
        self.status: Optional[TaskStatus] = None
        self._prefix = f"[agent {config.address}]"

    def request_stop(self, signum=None, frame=None):
        """Stops the task and leaves (safe from a signal handler)."""
        self._stop.set()

    def run(self) -> int:
        """Joins, runs and monitors the task.

        Whichever way it ends, the rendezvous client it made is closed; a
        node not admitted within `join_timeout` leaves the rendezvous first.

        Returns:
            0 when the task succeeded or the agent was asked to stop, 1 when
            the task failed more than `max_restarts` times.

        Raises:
            RendezvousTimeoutError: Not admitted within `join_timeout`.
            RendezvousError: The rendezvous could not be joined otherwise
                (refused, unreachable, or no rendezvous server there).
        """
        if self._given_client is not None:
            return self._join_and_monitor()
        self._client = RendezvousClient(
            self.config.rdzv_endpoint, token=self.config.token,
            tls_root_cert=self.config.tls_root_cert)
        try:
            return self._join_and_monitor()
        finally:
            self._client.close()

    def _join_and_monitor(self) -> int:
        config = self.config
        try:
            self._spec = self._client.get_cluster_spec(
                config.address, config.min_nodes, config.max_nodes,
                timeout=config.join_timeout)
        except api.RendezvousTimeoutError:
            # Registered, not admitted: left registered, it would count
            # toward the next node's min_nodes until its lease lapsed.
            self._leave()
            raise
        logger.info("%s admitted as worker %s of %s (version %s)",
                    self._prefix, self._spec.index, self._spec.size,
                    self._spec.version)
        keeper = threading.Thread(target=self._keep_alive, daemon=True,
                                  name="keras_ps-agent-keepalive")
        keeper.start()
        try:
            return self._monitor()
        finally:
            self._stop.set()
            self._stop_task()
            keeper.join(timeout=self._client_timeout())
            self._leave()

    def _client_timeout(self):
        return 2 * self.config.monitor_interval + 10.0

    def _monitor(self) -> int:
        self._start_task()
        while not self._stop.wait(self.config.monitor_interval):
            self._set_status(self._poll())
            decision = decide(self.status, self.restarts,
                              self.config.max_restarts)
            code = self._process.returncode
            if decision is AgentDecision.CONTINUE:
                continue
            if decision is AgentDecision.FINISH:
                self._exit_barrier()
                return 0
            if decision is AgentDecision.RESTART:
                self.restarts += 1
                logger.warning("%s task failed (exit code %s%s); restart %s "
                               "of %s", self._prefix, code, self._why(code),
                               self.restarts, self.config.max_restarts)
                self._start_task()
                continue
            message = (f"task failed with exit code {code}{self._why(code)} "
                       f"and max_restarts={self.config.max_restarts} "
                       f"restarts are used up: {' '.join(self.config.task)}")
            logger.error("%s %s", self._prefix, message)
            print(f"keras_ps.elastic.agent: error: {message}", flush=True)
            return 1
        logger.info("%s stop requested", self._prefix)
        return 0

    def _why(self, code):
        """What an exit code of a keras_ps server task means, where it
        names a cause ("" for the others)."""
        if code == _network.EXIT_ADDRESS_TAKEN:
            return (f": keras_ps.server's code for an address another "
                    f"process holds; free {self.config.address} or give the "
                    f"agent another --address")
        return ""

    def _poll(self) -> TaskStatus:
        code = self._process.poll()
        if code is None:
            return TaskStatus.HEALTHY
        return TaskStatus.SUCCEEDED if code == 0 else TaskStatus.FAILED

    def _set_status(self, status: TaskStatus):
        if status is not self.status:
            logger.info("%s task %s -> %s", self._prefix,
                        self.status and self.status.value, status.value)
            self.status = status

    def _start_task(self):
        spec, address = self._spec, self.config.address
        command = [arg.replace("{index}", str(spec.index))
                   .replace("{address}", address) for arg in self.config.task]
        env = dict(os.environ)
        env.update(KERAS_PS_ELASTIC_INDEX=str(spec.index),
                   KERAS_PS_ELASTIC_ADDRESS=address,
                   KERAS_PS_RDZV_ENDPOINT=self.config.rdzv_endpoint)
        self._process = subprocess.Popen(command, env=env)
        self.status = None
        self._set_status(TaskStatus.HEALTHY)
        # One line on stdout so supervisors (and tests) learn the task's pid.
        print(f"keras_ps.elastic.agent: task pid={self._process.pid} "
              f"index={spec.index} address={address}", flush=True)

    def _stop_task(self):
        process = self._process
        if process is None or process.poll() is not None:
            return
        logger.info("%s stopping task pid %s", self._prefix, process.pid)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(TASK_STOP_GRACE)
        except subprocess.TimeoutExpired:
            logger.warning("%s task pid %s ignored SIGTERM; killing it",
                           self._prefix, process.pid)
            process.kill()
            process.wait()

    def _keep_alive(self):
        while not self._stop.wait(self.config.monitor_interval):
            try:
                waiting = self._client.keep_alive(self.config.address)
            except api.RendezvousUnknownNodeError:
                # Lease lapsed or the server restarted: register again.
                logger.warning("%s unknown to the rendezvous; joining again",
                               self._prefix)
                self._rejoin()
            except api.RendezvousError as error:
                logger.warning("%s keep-alive failed: %s", self._prefix,
                               error)
            else:
                if waiting.count:
                    logger.info("%s membership changed by %+d (version %s)",
                                self._prefix, waiting.count, waiting.version)

    def _rejoin(self):
        try:
            spec = self._client.get_cluster_spec(
                self.config.address, self.config.min_nodes,
                self.config.max_nodes, timeout=self.config.monitor_interval)
        except api.RendezvousError as error:
            logger.warning("%s join again failed: %s", self._prefix, error)
            return
        if spec.index != self._spec.index:
            logger.warning("%s now worker %s (was %s); the running task keeps "
                           "its index until it restarts", self._prefix,
                           spec.index, self._spec.index)
        self._spec = spec

    def _exit_barrier(self):
        try:
            self._client.barrier(self.config.address, EXIT_BARRIER_TAG,
                                 timeout=self.config.exit_barrier_timeout)
        except api.RendezvousError as error:
            logger.warning("%s exit barrier: %s", self._prefix, error)

    def _leave(self):
        try:
            removed = self._client.leave(self.config.address)
            logger.info("%s left the rendezvous (known: %s)", self._prefix,
                        removed)
        except api.RendezvousError as error:
            logger.warning("%s leaving the rendezvous failed: %s",
                           self._prefix, error)
