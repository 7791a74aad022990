"""`python -m keras_ps.server`: run one ps or worker task until SIGTERM.

Stopped by SIGTERM or SIGINT, the task ends by that signal (exit status 143
or 130), so a restart policy starts it again; it exits 0 only when the
process that started it with --exit_with_parent ended.

A ps that a coordinator watches for preemption notices serves on after
SIGTERM until that coordinator has written its backup and releases it (at
most --preemption_grace seconds; see keras_ps.cluster.ps_notices).

A ps given --rdzv_endpoint announces its address to that keras_ps
rendezvous while it runs (keras_ps.elastic._announce), so that a coordinator
using ElasticClusterResolver follows a replacement ps to its new address.

The task comes from TF_CONFIG, or from --cluster_spec/--job_name/--task_index
(which win over TF_CONFIG; --job_name or --task_index alone is refused).
Bad configuration ends the process with a one-line error and exit code 2; an
address another process holds, with one and exit code 3.
"""

import argparse
import json
import os
import signal
import sys
import threading

# keras_ps/__init__ sets GRPC_FAIL_FAST before anything starts gRPC; none of
# these modules imports TensorFlow (a task serves sooner without its Python API).
from keras_ps.cluster import _dead_peers
from keras_ps.cluster import _forks
from keras_ps.cluster import _network
from keras_ps.cluster import ps_notices
from keras_ps import _constants
from keras_ps import _native
from keras_ps import _tf_adapter
from keras_ps import cluster as cluster_lib
from keras_ps._base_errors import ClusterConfigError
from keras_ps.elastic._announce import PsAnnouncer
from keras_ps.elastic.api import RendezvousConfig
from keras_ps.elastic.api import parse_address
from keras_ps.elastic.client import tls_root_cert_or_env


def _fail(message, code=2):
    print(_network.SERVER_ERROR_PREFIX + message, file=sys.stderr,
          flush=True)
    return code


def _parser():
    parser = argparse.ArgumentParser(
        prog="keras_ps.server", description="Run a keras_ps ps or worker task."
    )
    parser.add_argument("--cluster_spec", help="JSON {job: [host:port, ...]}")
    parser.add_argument("--job_name", choices=None)
    parser.add_argument("--task_index", type=int, default=None,
                        help="with --cluster_spec (default 0)")
    parser.add_argument("--inter_op_threads", type=int, default=0,
                        help="inter-op threads (0: max(4, cores))")
    parser.add_argument("--intra_op_threads", type=int, default=0,
                        help="threads one op may split its work over (0: "
                             "TF's default, one per core); LocalCluster "
                             "shares the cores between its tasks")
    parser.add_argument("--preemption_grace", type=float, default=None,
                        help="a ps' longest wait after SIGTERM for the "
                             "coordinator watching it to back up and release"
                             " it (0: stop at once; default: "
                             f"${_constants.PREEMPTION_GRACE_ENV_VAR}, else "
                             f"{ps_notices.DEFAULT_GRACE_S:g}); see "
                             "keras_ps.cluster.ps_notices")
    parser.add_argument("--exit_with_parent", action="store_true",
                        help="stop when the process that started this one "
                             "ends, even by SIGKILL (LocalCluster sets it)")
    parser.add_argument("--rdzv_endpoint", metavar="HOST:PORT",
                        help="a ps announces its address to this keras_ps "
                             "rendezvous while it runs, so that a coordinator "
                             "using ElasticClusterResolver finds it there "
                             "after a move (token: $KERAS_PS_RDZV_TOKEN; "
                             "a rendezvous speaking TLS: its certificate in "
                             "the file $KERAS_PS_RDZV_TLS_ROOT_CERT names)")
    # LocalCluster's: serve no task, fork each of its tasks from this
    # process (keras_ps.cluster._forks).
    parser.add_argument("--fork_server", action="store_true",
                        help=argparse.SUPPRESS)
    return parser


def _check_job(job):
    if job not in ("ps", "worker"):
        raise ClusterConfigError(
            f"keras_ps.server runs ps and worker tasks. Received: task "
            f"type {job!r}. Run the chief as your training script and the "
            "evaluator with `python -m keras_ps.evaluator`."
        )


def _task(args):
    """(cluster, job, index) from the flags, or from TF_CONFIG without them.

    Raises:
        ClusterConfigError: the configuration cannot be used.
    """
    if args.cluster_spec is None:
        if not os.environ.get("TF_CONFIG", "").strip():
            raise ClusterConfigError(
                "keras_ps.server does not know its task: TF_CONFIG is not "
                "set and no --cluster_spec was given. Set TF_CONFIG, or "
                "pass --cluster_spec JSON --job_name ps|worker --task_index "
                "N.")
        cluster, job, index = cluster_lib.parse_tf_config()
        flags = [f"--{name} {value}" for name, value in (
            ("job_name", args.job_name), ("task_index", args.task_index))
            if value is not None]
        if flags:
            # TF_CONFIG names the task; flags that say otherwise would be
            # ignored without a word.
            raise ClusterConfigError(
                f"{' and '.join(flags)} without --cluster_spec: this task "
                f"comes from TF_CONFIG ({job}:{index}), which the flags "
                "would not change. Drop them to serve TF_CONFIG's task, or "
                "pass --cluster_spec too (the flags then win over "
                "TF_CONFIG).")
        _check_job(job)
        return cluster, job, index
    if args.job_name is None:
        raise ClusterConfigError(
            "--job_name is required with --cluster_spec. Received: no "
            "--job_name. Pass --job_name ps or --job_name worker.")
    _check_job(args.job_name)
    try:
        spec = json.loads(args.cluster_spec)
    except json.JSONDecodeError as e:
        raise ClusterConfigError(
            f"--cluster_spec is not valid JSON ({e.msg}). Received: "
            f"{args.cluster_spec[:200]!r}. Expected JSON like "
            '{"ps": ["host:port"], "worker": ["host:port"]}.'
        ) from None
    index = 0 if args.task_index is None else args.task_index
    tasks = spec.get(args.job_name) if isinstance(spec, dict) else None
    if isinstance(tasks, list) and not 0 <= index < len(tasks):
        raise ClusterConfigError(
            "--task_index is out of range. Received: --task_index="
            f"{index}, but --cluster_spec lists {len(tasks)} "
            f"{args.job_name} task(s). "
            + (f"Pass --task_index from 0 to {len(tasks) - 1}." if tasks else
               f"Add this task's address to --cluster_spec's {args.job_name!r} "
               "list."))
    config = {"cluster": spec,
              "task": {"type": args.job_name, "index": index}}
    cluster, job, index = cluster_lib.parse_tf_config(config)
    _check_job(job)
    return cluster, job, index


def _announcer(endpoint, job, index, address):
    """The ps' announcement of its address to the rendezvous at
    `endpoint`, or None without one.

    Raises:
        ValueError: a worker given an endpoint, or a bad endpoint.
    """
    if endpoint is None:
        return None
    if job != "ps":
        raise ValueError(
            f"--rdzv_endpoint {endpoint} is for ps tasks, not {job}:{index}: "
            "a worker joins the rendezvous through its agent (python -m "
            "keras_ps.elastic.launch --rdzv_endpoint ... -- python -m "
            "keras_ps.server ...). Drop --rdzv_endpoint here.")
    try:
        parse_address(endpoint, "endpoint")
    except ValueError as e:
        raise ValueError(f"--rdzv_endpoint {endpoint!r}: {e}. Pass the "
                         "rendezvous' HOST:PORT.") from None
    return PsAnnouncer(
        endpoint, index, address, token=os.environ.get(
            RendezvousConfig.env_var("token")) or None,
        tls_root_cert=tls_root_cert_or_env(None),
        say=lambda line: print(f"keras_ps.server: {job}:{index} {line}",
                               flush=True))


def _stop_on_signals():
    """An event that SIGTERM and SIGINT set, and the list of the signals
    received. Installed before the server starts: its port is open as soon
    as it starts, and a signal sent then (a test, or an orchestrator stopping
    a task that just came up) must stop it cleanly, not with Python's default
    exit."""
    stop = threading.Event()
    received = []

    def on_signal(signum, frame):
        received.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop, received


def _serve_until_signal(server, job, index, address, threads, signals,
                        parent=None, notices=None, grace=0.0):
    """Serves until a signal (SIGTERM/SIGINT, see _stop_on_signals), or
    until `parent` (a pid) is no longer this process' parent: a parent that
    dies, even by SIGKILL, leaves this process to init, and nothing else
    would stop it. A ps (`notices`: its ServerNotices) that a coordinator
    watches serves on after SIGTERM until released, for up to `grace`
    seconds (keras_ps.cluster.ps_notices)."""
    stop, received = signals
    print(f"keras_ps.server: {job}:{index} serving at {address}"
          f" ({threads})", flush=True)
    why = "on signal"  # the message tests and operators look for
    while not stop.wait(1.0):
        if parent is not None and os.getppid() != parent:
            why = f"because the process that started it (pid {parent}) ended"
            break
    else:
        if (notices is not None and grace > 0 and received[:1] ==
                [signal.SIGTERM] and len(received) == 1 and notices.watched()):
            stop.clear()
            if len(received) > 1:  # a second signal came before the clear
                stop.set()
            why = ps_notices.serve_out_notice(
                notices, grace, stop, lambda line: print(
                    f"keras_ps.server: {job}:{index} {line}", flush=True))
    print(f"keras_ps.server: {job}:{index} stopping {why} ({server.target})",
          flush=True)
    sys.stdout.flush()
    # TF's server has no clean shutdown in 2.x; leave without running its
    # destructors (which can block on in-flight RPCs).
    if received:
        _end_by(received[0])
    os._exit(0)


def _end_by(signum):
    """Ends the process as the signal's default action does (exit status 128
    + signum: 143 for SIGTERM), not with 0. A task stopped by a signal has
    not finished its work: restart policies that start again only what
    failed (Docker's on-failure, Kubernetes' OnFailure, a TFJob's ExitCode
    policy, which retries 130, 137 and 143) bring it back, and the job's
    coordinator gives a ps back its variables. The kernel drops a signal
    whose action is the default when it is sent to the first process of a
    PID namespace (a container's command): that process leaves with the
    same status."""
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
    os._exit(128 + signum)


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.fork_server:
        _forks.serve(main)
    parent = os.getppid() if args.exit_with_parent else None
    # Must be set before TF starts gRPC. A task's own calls to other tasks
    # (a worker reading a tensor from a ps) fail at once when the peer is
    # gone, instead of waiting for a process to answer on its address: a
    # restarted ps would then be asked for a tensor its previous process was
    # to send, and the call would wait forever. (The coordinator's calls use
    # keras_ps' default, "use_caller"; a value the user set is kept.)
    if os.environ.get("GRPC_FAIL_FAST", "use_caller") == "use_caller":
        os.environ["GRPC_FAIL_FAST"] = "true"
    for flag in ("inter_op_threads", "intra_op_threads"):
        if getattr(args, flag) < 0:
            return _fail(
                f"--{flag} {getattr(args, flag)} is negative. Pass 0 for "
                "TF's default or a number of threads (1 or more).")
    if args.preemption_grace is None:
        try:
            args.preemption_grace = _constants.env_float(
                _constants.PREEMPTION_GRACE_ENV_VAR,
                ps_notices.DEFAULT_GRACE_S, minimum=0)
        except ValueError as e:
            return _fail(str(e))
    elif not 0 <= args.preemption_grace < float("inf"):  # NaN too
        return _fail(
            f"--preemption_grace {args.preemption_grace} is not a number of "
            "seconds. Pass 0 to stop at once on SIGTERM, or the seconds a ps "
            "may wait for its coordinator's backup (default "
            f"{ps_notices.DEFAULT_GRACE_S:g}).")
    # Every connection of this process is TF's: calls to a task whose
    # machine vanished fail within a bound. Before TF starts gRPC, which
    # reads its channels' options once; a bad value fails before serving.
    try:
        _dead_peers.watch(every_socket=True)
    except ValueError as e:
        return _fail(str(e))
    try:
        cluster, job, index = _task(args)
    except ClusterConfigError as e:
        return _fail(str(e))

    address = cluster[job][index]
    try:
        announcer = _announcer(args.rdzv_endpoint, job, index, address)
    except ValueError as e:
        return _fail(str(e))
    port = _network.split_address(address)[1]
    if not _network.port_is_free(port):
        return _fail(_network.address_taken(job, index, address),
                     _network.EXIT_ADDRESS_TAKEN)

    # TF's server alone, without the rest of its Python API: serving starts
    # 2.5 s sooner (a worker joining a running job waits on this).
    server_lib, config_pb2 = _tf_adapter.server_modules()
    # Before the server starts: a function using them may arrive at once.
    try:
        native = _native.load_in_server()
    except ValueError as e:  # a KERAS_PS_NATIVE or _DIRECT_IO it refuses
        return _fail(str(e))
    config = config_pb2.ConfigProto()
    config.inter_op_parallelism_threads = (
        args.inter_op_threads or max(4, os.cpu_count() or 1))
    config.intra_op_parallelism_threads = args.intra_op_threads
    signals = _stop_on_signals()
    try:
        server = server_lib.Server(
            server_lib.ClusterSpec(cluster_lib.training_cluster(cluster)),
            job_name=job, task_index=index, protocol="grpc", config=config,
            start=True,
        )
    except Exception as e:
        # TF's error names no address. A port taken since the check above
        # is held still; anything else is no reason to try another port.
        if not _network.port_is_free(port):
            return _fail(_network.address_taken(job, index, address),
                         _network.EXIT_ADDRESS_TAKEN)
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        return _fail(f"could not start {job}:{index} at {address}: "
                     f"{first_line}")
    threads = (f"{config.inter_op_parallelism_threads} inter-op threads, "
               + (f"{args.intra_op_threads} intra-op"
                  if args.intra_op_threads else "intra-op: one per core")
               + f"; {native}")
    if announcer is not None:
        announcer.start()
    library = _native.server_library()
    notices = (ps_notices.ServerNotices(library)
               if job == "ps" and library is not None else None)
    _serve_until_signal(server, job, index, address, threads, signals,
                        parent, notices, args.preemption_grace)


if __name__ == "__main__":
    sys.exit(main())
