"""A coordinator process for elastic tests that need one (TF connects a
process to one cluster); prints RESULT lines the test reads.

Usage: python tests/_elastic_job.py wrong_members
"""

import http.server
import logging
import signal
import socket
import subprocess
import sys
import threading

import portpicker
import tensorflow as tf

import keras_ps
from _kills import start_task
from _paths import REPO
from _polling import wait_until
from _results import say
from keras_ps.elastic import RendezvousClient
from keras_ps.elastic import RendezvousConfig
from keras_ps.elastic import RendezvousServer


class _Warnings(logging.Handler):
    """Keeps the WARNING (and worse) records of keras_ps' loggers."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelname, record.getMessage()))


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _agent(endpoint, address):
    """A real agent registering `address` as its worker's, with a task that
    serves nothing there."""
    return subprocess.Popen(
        [sys.executable, "-m", "keras_ps.elastic.launch",
         f"--rdzv_endpoint={endpoint}", "--nnodes=1:8",
         f"--address={address}", "--monitor_interval=0.5",
         "--log_level=WARNING", "--", sys.executable, "-c",
         "import time; time.sleep(600)"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _thread_alive(name):
    return any(t.name == name for t in threading.enumerate())


def wrong_members():
    """Agents register the rendezvous server's own address, a ps's address
    and an HTTP server's as their workers', and two where no server answers,
    while training runs on one good worker; a good worker joins after
    them, and a worker task starts at last at one of the two silent
    addresses."""
    warnings = _Warnings()
    logging.getLogger("keras_ps").addHandler(warnings)
    server = RendezvousServer(RendezvousConfig(gather_timeout=0.1,
                                               keepalive_timeout=300))
    endpoint = f"127.0.0.1:{server.start()}"
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    http_address = f"127.0.0.1:{web.server_address[1]}"
    # Two addresses where no TF server ever answers: a port that accepts
    # connections and says nothing (a stopped task's), and one where nothing
    # listens (a wrong port).
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(1024)  # never accepted: each probe stays in its queue
    silent = (f"127.0.0.1:{mute.getsockname()[1]}",
              f"127.0.0.1:{portpicker.pick_unused_port()}")
    agents, tasks = [], []
    try:
        with keras_ps.LocalCluster(num_workers=2, num_ps=1) as cluster:
            good, late = cluster.spec["worker"]
            ps = cluster.spec["ps"][0]
            nodes = RendezvousClient(endpoint)
            nodes.get_cluster_spec(good, 1, 8, timeout=60)
            resolver = keras_ps.elastic.ElasticClusterResolver(
                endpoint, ps=[ps], poll_interval=0.5, startup_timeout=60)
            strategy = keras_ps.ParameterServerStrategy(resolver)
            coordinator = keras_ps.ClusterCoordinator(strategy)
            with strategy.scope():
                total = tf.Variable(0.0)

            @tf.function
            def step():
                total.assign_add(1.0)

            scheduled = []

            def run(steps):
                for _ in range(steps):
                    coordinator.schedule(step)
                coordinator.join()
                scheduled.append(steps)

            def place(address):
                return next((w for w in coordinator.workers
                             if w.address == address), None)

            run(10)
            wrong = (endpoint, ps, http_address)
            agents += [_agent(endpoint, address) for address in wrong]
            agents += [_agent(endpoint, address) for address in silent]
            wait_until(lambda: all(
                place(a) is not None and place(a).state.value == "refused"
                for a in wrong), 120, "the wrong members to be refused")
            wait_until(lambda: all(
                any(f" {a} joined the membership" in m and "no TensorFlow "
                    "server answers there yet" in m
                    for _, m in warnings.messages) for a in silent),
                120, "the silent members to be named")
            # Their threads ended: nothing asks them again.
            wait_until(lambda: not any(
                _thread_alive(f"keras_ps-worker-{place(a).index}")
                for a in wrong), 60, "the refused places' threads to end")
            run(10)  # on the good worker, with the wrong ones members
            # A worker task starts at last where nothing listened: it joins.
            tasks.append(start_task({"worker": [silent[1]]}, "worker", 0,
                                    subprocess.DEVNULL))

            def came_and_ran():
                run(4)
                return place(silent[1]).closures_run

            wait_until(came_and_ran, 120, "the worker that came at last to "
                       "take steps")
            nodes.get_cluster_spec(late, 1, 8, timeout=60)

            def late_took_steps():
                run(4)
                return place(late) is not None and place(late).closures_run

            wait_until(late_took_steps, 120, "the late worker to take steps")
            say(total=float(total.numpy()), scheduled=sum(scheduled),
                states={a: place(a).state.value
                        for a in (good, late, *wrong, *silent)},
                indices={a: place(a).index for a in (*wrong, *silent)},
                mute=silent[0], closed=silent[1],
                late_ran=place(late).closures_run,
                came_ran=place(silent[1]).closures_run,
                rendezvous=endpoint, ps=ps, http=http_address,
                warnings=warnings.messages)
            coordinator.shutdown()
            resolver.close()
            nodes.close()
    finally:
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        for agent in agents:
            agent.wait(30)
        for task in tasks:
            task.kill()
            task.wait(30)
        server.stop(0)
        web.shutdown()
        mute.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    {"wrong_members": wrong_members}[sys.argv[1]]()
