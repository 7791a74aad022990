"""Fault injection shared by the test jobs (coordinator processes)."""

import json
import os
import re
import subprocess
import sys

import keras


def start_task(spec, job, index, log=None, flags=(), **env):
    """Starts task `job`:`index` of `spec` ({job: [address, ...]}) with
    `python -m keras_ps.server` and its `flags`, outside any LocalCluster (as
    a replacement machine would), its output into `log` (a file) and with
    `env` added to this process' environment; it ends with this process."""
    return subprocess.Popen(
        [sys.executable, "-m", "keras_ps.server", "--cluster_spec",
         json.dumps(spec), "--job_name", job, "--task_index", str(index),
         "--exit_with_parent", *flags], stdout=log,
        stderr=None if log is None else subprocess.STDOUT,
        env=dict(os.environ, **env))


class KillAndRestartPs(keras.callbacks.Callback):
    """SIGKILLs ps 0 of `cluster` (a LocalCluster) and starts it again on its
    address at once, as a restart policy would, at the end of batch `at`
    (epoch, batch); `done` says it happened."""

    def __init__(self, cluster, at):
        super().__init__()
        self.cluster, self.at, self.done, self._epoch = cluster, at, False, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == self.at and not self.done:
            self.done = True
            self.cluster.kill("ps", 0)
            self.cluster.restart("ps", 0)
            print("KILLED AND RESTARTED ps 0", flush=True)


def _tcp_sockets(pid, port):
    """(local port, peer address) of the established TCP connections of
    process `pid` to `port` on this machine (loopback)."""
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established", f"( dport = :{port} )"],
        capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        local, peer = line.split()[2:4]
        found.append((int(local.rsplit(":", 1)[1]), peer))
    return found


def unread_bytes(pid, port):
    """Bytes that process `pid` sent over its connections to `port` and the
    process listening there has not read yet (its receive queues: a
    stopped process reads nothing)."""
    total = 0
    for local, _ in _tcp_sockets(pid, port):
        out = subprocess.run(
            ["ss", "-tnH", "state", "established",
             f"( sport = :{port} and dport = :{local} )"],
            capture_output=True, text=True, check=True).stdout
        total += sum(int(line.split()[0]) for line in out.splitlines())
    return total


def reset_connections(pid, port):
    """Aborts every established TCP connection of process `pid` to `port`
    (both ends get ECONNABORTED / a reset, as when a network path between
    two machines drops them), with `ss -K`; the process may connect again
    at once. Returns how many were aborted."""
    aborted = 0
    for local, _ in _tcp_sockets(pid, port):
        subprocess.run(
            ["ss", "-K", "state", "established",
             f"( sport = :{local} and dport = :{port} )"],
            capture_output=True, text=True, check=True)
        aborted += 1
    return aborted


def can_reset_connections():
    """Whether this machine lets `ss -K` abort a TCP connection (the
    kernel's sock_destroy and the right to use it)."""
    import socket
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    try:
        if reset_connections(os.getpid(), port) != 1:
            return False
        client.settimeout(5)
        try:
            client.send(b"x")
            client.recv(1)
        except OSError:
            return True
        return False
    finally:
        for s in (client, accepted, server):
            s.close()


# -- a network path cut between two processes of this machine ----------------
_NET_CLS = "/sys/fs/cgroup/net_cls"
# Each rule's comment names the process that made it (RULE_COMMENT_<pid>):
# tests run side by side, and a test heals only the rules of jobs that died.
RULE_COMMENT = "keras_ps_test_cut"


class _Rules:
    """iptables and ip6tables rules of the OUTPUT chain ("-j TARGET" last
    in each), inserted at once, each marked with RULE_COMMENT and this
    process' pid; `heal()` removes them."""

    def __init__(self, rules):
        self._rules, self.cut = [self._marked(rule) for rule in rules], False
        for tool in ("iptables", "ip6tables"):
            for rule in self._rules:
                subprocess.run([tool, "-I", *rule], check=True,
                               capture_output=True)
        self.cut = True

    @staticmethod
    def _marked(rule):
        target = rule.index("-j")
        return ["OUTPUT", *rule[:target], "-m", "comment", "--comment",
                f"{RULE_COMMENT}_{os.getpid()}", *rule[target:]]

    def heal(self):
        if self.cut:
            self.cut = False
            for tool in ("iptables", "ip6tables"):
                for rule in self._rules:
                    subprocess.run([tool, "-D", *rule], capture_output=True)


class NetworkCut(_Rules):
    """Cuts the TCP connections that processes `pids` open to `port`, as a
    firewall rule between two machines would, every other path left
    working: the processes are moved into a cgroup (v1 `net_cls`) of their
    own, and iptables and ip6tables reject (with a reset) their packets to
    that port, or with `drop` drop them without an answer (a security
    group's default). `heal()` removes the rules; the processes stay in the
    cgroup, which nothing else matches."""

    def __init__(self, pids, port, drop=False):
        self.classid = 0x10000 + os.getpid() % 0xFFFF
        self.group = os.path.join(_NET_CLS, f"keras_ps_test_{os.getpid()}")
        os.makedirs(self.group, exist_ok=True)
        with open(os.path.join(self.group, "net_cls.classid"), "w") as f:
            f.write(str(self.classid))
        for pid in pids:
            with open(os.path.join(self.group, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        super().__init__([[
            "-p", "tcp", "--dport", str(port), "-m", "cgroup", "--cgroup",
            hex(self.classid), "-j",
            *(["DROP"] if drop else ["REJECT", "--reject-with", "tcp-reset"])]])


class Vanish(_Rules):
    """Drops every packet to or from `port` (a task's), as when the task's
    machine vanishes (a preempted VM, a deleted pod): nothing answers, not
    even with a reset, and a connection open to it stays open while its
    data goes unacknowledged. Kill the task with it, or its peers' calls
    keep running on it. `heal()` removes the rules."""

    def __init__(self, port):
        super().__init__([["-p", "tcp", f"--{side}", str(port), "-j", "DROP"]
                          for side in ("dport", "sport")])


def run_cutting_job(argv, timeout, **env):
    """Runs the job `argv`, which cuts network paths with the classes above,
    with `env` added to the environment; skips the calling test where this
    machine cannot cut (see can_cut_network), and removes any rule the job
    left (it died before it healed). Returns (exit code, output)."""
    import pytest
    from _results import run_child
    why = can_cut_network()
    if why:
        pytest.skip(f"cannot cut a network path on this machine: {why}")
    try:
        return run_child(argv, timeout, env=dict(
            os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env))
    finally:
        heal_every_cut()


def heal_every_cut():
    """Removes every rule a NetworkCut or Vanish left whose process is gone
    (killed before it healed; a live one's, of a test beside this one, are
    kept), and the cuts' cgroups once their processes are gone; returns
    how many rules."""
    for name in os.listdir(_NET_CLS) if os.path.isdir(_NET_CLS) else ():
        maker = re.fullmatch(r"keras_ps_test_(\d+)", name)
        if maker and not _alive(int(maker.group(1))):
            try:
                os.rmdir(os.path.join(_NET_CLS, name))
            except OSError:  # a process of it still runs
                pass
    removed = 0
    for tool in ("iptables", "ip6tables"):
        listed = subprocess.run([tool, "-S", "OUTPUT"], capture_output=True,
                                text=True).stdout
        for line in listed.splitlines():
            maker = re.search(rf"{RULE_COMMENT}_(\d+)", line)
            if (maker and line.startswith("-A ")
                    and not _alive(int(maker.group(1)))):
                subprocess.run([tool, "-D", *line.split()[1:]],
                               capture_output=True)
                removed += 1
    return removed


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def can_cut_network():
    """'' when this machine lets a test cut a process' connections to a
    port (root, a cgroup v1 net_cls hierarchy, mounted here if needed,
    iptables and ip6tables with the cgroup match), else why not."""
    if os.geteuid() != 0:
        return "needs root (iptables and a net_cls cgroup)"
    if not os.path.exists(os.path.join(_NET_CLS, "net_cls.classid")):
        os.makedirs(_NET_CLS, exist_ok=True)
        mounted = subprocess.run(
            ["mount", "-t", "cgroup", "-o", "net_cls", "net_cls", _NET_CLS],
            capture_output=True, text=True)
        if mounted.returncode != 0:
            return f"cannot mount a net_cls cgroup: {mounted.stderr.strip()}"
    for tool in ("iptables", "ip6tables"):
        listed = subprocess.run([tool, "-m", "cgroup", "-h"],
                                capture_output=True, text=True)
        if listed.returncode != 0 or "--cgroup" not in listed.stdout:
            return f"{tool} with the cgroup match is missing"
        listed = subprocess.run([tool, "-m", "comment", "-h"],
                                capture_output=True, text=True)
        if listed.returncode != 0 or "--comment" not in listed.stdout:
            return f"{tool} with the comment match is missing"
    return ""
