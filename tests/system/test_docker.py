"""docker/: the image, the Compose cluster and the Kubernetes manifests.

Docker's engine does not run on the development machines, so the Compose
file is proven another way: its TF_CONFIGs must describe one cluster, and its
services' very commands and environments, run as local processes with the
service host names mapped to loopback ports, must train the job end to end.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import portpicker
import pytest
import yaml

from _paths import REPO as ROOT  # noqa: E402
DOCKER = os.path.join(ROOT, "docker")
SERVER_COMMAND = ["python", "-m", "keras_ps.server"]
TRAIN_SCRIPT = "/app/tutorials/model_fit.py"
TASKS = {("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1),
         ("evaluator", 0)}


def load_compose():
    with open(os.path.join(DOCKER, "compose.yaml")) as f:
        return yaml.safe_load(f)


def load_manifests(name):
    with open(os.path.join(DOCKER, "k8s", name)) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def compose_tf_configs(compose):
    """{service: parsed TF_CONFIG} for every service that has one."""
    configs = {}
    for name, service in compose["services"].items():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        if "TF_CONFIG" in env:
            configs[name] = json.loads(env["TF_CONFIG"])
    return configs


def task_of(config):
    return config["task"]["type"], int(config["task"]["index"])


def check_role_command(role, command):
    """What each role must run: keras_ps.server for ps/worker (it reads
    TF_CONFIG and needs no flags), the training script for the chief, the
    sidecar evaluator module for the evaluator."""
    if role in ("ps", "worker"):
        assert command == SERVER_COMMAND, (role, command)
    elif role == "chief":
        assert command[:2] == ["python", TRAIN_SCRIPT], command
        script = os.path.join(ROOT, "tutorials", os.path.basename(command[1]))
        assert os.path.exists(script), script
        flags = [a for a in command[2:] if a.startswith("--")]
        source = open(script).read()
        for flag in flags:
            assert f'"{flag}"' in source, f"{flag} is not a flag of {script}"
        assert command[command.index("--workdir") + 1] == "/shared"
    elif role == "evaluator":
        assert command[:3] == ["python", "-m", "keras_ps.evaluator"], command
        # It loads the training script's eval_model and reads the
        # checkpoints its SidecarCheckpoint writes to <workdir>/sidecar.
        model_fn = command[command.index("--model_fn") + 1]
        path, _, function = model_fn.partition(":")
        assert path == TRAIN_SCRIPT
        source = open(os.path.join(ROOT, "tutorials", os.path.basename(path))).read()
        assert f"def {function}():" in source
        assert "SidecarCheckpoint(" in source and '"sidecar"' in source
        assert command[command.index("--checkpoint_dir") + 1] == "/shared/sidecar"
    else:
        raise AssertionError(f"unexpected role {role!r}")


# -- the image -------------------------------------------------------------------
def test_dockerfile_is_pinned_multi_stage_and_non_root():
    text = open(os.path.join(DOCKER, "Dockerfile")).read()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M).group(1)
    # Pinned to a full Python version, not a floating tag.
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base), base
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert stages == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"]
    runtime = text.split("\nFROM ${PYTHON_IMAGE}\n")[1]
    # The final stage takes only the virtualenv and the tutorials.
    assert "COPY --from=build /opt/venv /opt/venv" in runtime
    assert "pip install" not in runtime and "apt-get" not in runtime
    assert re.search(r"^USER keras$", runtime, re.M)
    assert "tutorials/ /app/tutorials/" in runtime  # the chief's script path
    ignore = open(os.path.join(DOCKER, "Dockerfile.dockerignore")).read()
    for needed in ("setup.cfg", "keras_ps/", "callbacks/", "tutorials/"):
        assert f"!{needed}" in ignore


# -- compose: static checks -------------------------------------------------------
def test_compose_tf_configs_describe_one_cluster():
    compose = load_compose()
    configs = compose_tf_configs(compose)
    clusters = {json.dumps(c["cluster"], sort_keys=True) for c in configs.values()}
    assert len(clusters) == 1, clusters
    cluster = next(iter(configs.values()))["cluster"]
    assert {task_of(c) for c in configs.values()} == TASKS
    assert len(configs) == len(TASKS)  # one service per task
    for name, config in configs.items():
        job, index = task_of(config)
        host, _, port = cluster[job][index].rpartition(":")
        # The address of a task is its own service.
        assert host == name == compose["services"][name]["hostname"]
        assert port == "2222"
        check_role_command(job, compose["services"][name]["command"])


def test_compose_services_restart_share_and_check_health():
    compose = load_compose()
    services = compose["services"]
    configs = compose_tf_configs(compose)
    for name, config in configs.items():
        job, _ = task_of(config)
        service = services[name]
        if job in ("ps", "worker"):
            assert service["restart"] == "on-failure"
            check = " ".join(service["healthcheck"]["test"])
            assert "create_connection(('localhost', 2222)" in check
        if job == "chief":
            assert service["restart"] == "on-failure"
            assert "shared:/shared" in service["volumes"]
            waits_for = {n for n, c in configs.items()
                         if task_of(c)[0] in ("ps", "worker")}
            assert set(service["depends_on"]) == waits_for
            assert all(v["condition"] == "service_healthy"
                       for v in service["depends_on"].values())
    board = services["tensorboard"]["command"]
    assert board[0] == "tensorboard"
    # TensorBoard reads where the chief's TensorBoard callback writes.
    assert board[board.index("--logdir") + 1] == "/shared/logs"
    assert "shared:/shared:ro" in services["tensorboard"]["volumes"]
    assert "shared" in compose["volumes"]


def test_docker_compose_config_validates():
    if shutil.which("docker") is None:
        pytest.skip("no docker client on this machine")
    probe = subprocess.run(["docker", "compose", "version"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip("the docker client has no compose plugin here "
                    f"({(probe.stderr or probe.stdout).strip()[:100]})")
    result = subprocess.run(
        ["docker", "compose", "-f", os.path.join(DOCKER, "compose.yaml"),
         "config", "--quiet"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- compose: the same commands as local processes ---------------------------------
def wait_for_port(port, proc, deadline):
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("localhost", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


class LocalCompose:
    """Runs compose services as local processes: each service host is mapped
    to localhost:<free port>, "python" to this interpreter, /app/tutorials to
    the repo's tutorials and /shared to a temporary folder."""

    def __init__(self, compose, shared_dir):
        self.services = compose["services"]
        self.configs = compose_tf_configs(compose)
        self.ports = {name: portpicker.pick_unused_port() for name in self.configs}
        self.shared = str(shared_dir)
        self.procs = {}

    def _map_address(self, address):
        host, _, port = address.rpartition(":")
        assert port == "2222" and host in self.ports, address
        return f"localhost:{self.ports[host]}"

    def env(self, name):
        config = json.loads(json.dumps(self.configs[name]))
        config["cluster"] = {job: [self._map_address(a) for a in tasks]
                             for job, tasks in config["cluster"].items()}
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        env["TF_CONFIG"] = json.dumps(config)
        return env

    def command(self, argv, port=None):
        out = []
        for arg in argv:
            if arg == "python":
                arg = sys.executable
            arg = arg.replace(TRAIN_SCRIPT, os.path.join(ROOT, "tutorials", "model_fit.py"))
            arg = re.sub(r"^/shared", self.shared, arg)
            if port is not None:
                arg = arg.replace("2222", str(port))
            out.append(arg)
        return out

    def start(self, name):
        log = open(os.path.join(self.shared, f"{name}.log"), "wb")
        self.procs[name] = subprocess.Popen(
            self.command(self.services[name]["command"]), env=self.env(name),
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        log.close()

    def healthcheck(self, name):
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        return subprocess.run(self.command(test[1:], port=self.ports[name]),
                              capture_output=True, timeout=30).returncode

    def log(self, name):
        with open(os.path.join(self.shared, f"{name}.log"), errors="replace") as f:
            return f.read()

    def stop_all(self):
        codes = {}
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes


@pytest.mark.timeout(240)
def test_compose_job_trains_end_to_end_as_local_processes(tmp_path):
    compose = load_compose()
    local = LocalCompose(compose, tmp_path)
    servers = [n for n, c in local.configs.items()
               if task_of(c)[0] in ("ps", "worker")]
    try:
        for name in servers:
            local.start(name)
        deadline = time.monotonic() + 90
        for name in servers:
            assert wait_for_port(local.ports[name], local.procs[name], deadline), \
                local.log(name)[-2000:]
        # The health checks compose would run pass against the live tasks.
        for name in servers:
            assert local.healthcheck(name) == 0, name
        (chief,) = [n for n, c in local.configs.items() if task_of(c)[0] == "chief"]
        (evaluator,) = [n for n, c in local.configs.items()
                        if task_of(c)[0] == "evaluator"]
        # The evaluator starts with the cluster and waits for checkpoints.
        local.start(evaluator)
        result = subprocess.run(
            local.command(compose["services"][chief]["command"]),
            env=local.env(chief), capture_output=True, text=True,
            timeout=180, cwd=ROOT)
        out = result.stdout
        assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
        # The compose job as written: 5 epochs x 20 steps.
        assert re.search(r"^Training steps: 100$", out, re.M), out[-2000:]
        accuracy = float(re.search(r"Evaluation accuracy: ([\d.]+)", out).group(1))
        assert accuracy >= 0.95
        # The shared volume holds what TensorBoard and the evaluator read.
        assert os.listdir(tmp_path / "logs" / "train")
        assert len(os.listdir(tmp_path / "ckpt")) == 5
        assert "embedding shards: [((4, 16384), 'job:ps'), ((4, 16384), 'job:ps')]" in out
        # The evaluator evaluates the chief's checkpoints and ends by itself
        # after the final one.
        assert local.procs[evaluator].wait(120) == 0, local.log(evaluator)[-3000:]
        done = re.search(r"keras_ps.evaluator: done (\{.*\})", local.log(evaluator))
        assert done, local.log(evaluator)[-3000:]
        assert json.loads(done.group(1))["evaluated"]
        assert os.listdir(tmp_path / "logs" / "validation")
    finally:
        codes = local.stop_all()
    # keras_ps.server exits 0 on SIGTERM (docker stop), as compose expects.
    assert all(codes[name] == 0 for name in servers), codes


# -- Kubernetes --------------------------------------------------------------------
def test_tfjob_manifest_roles_and_commands():
    docs = load_manifests("tfjob.yaml")
    (job,) = [d for d in docs if d["kind"] == "TFJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["tfReplicaSpecs"]
    assert {role: spec["replicas"] for role, spec in specs.items()} == {
        "Chief": 1, "PS": 2, "Worker": 2, "Evaluator": 1}
    claims = {d["metadata"]["name"] for d in docs
              if d["kind"] == "PersistentVolumeClaim"}
    for role, spec in specs.items():
        (container,) = spec["template"]["spec"]["containers"]
        # The operator sets TF_CONFIG only in the container named tensorflow,
        # with the task type in lower case ("ps", "worker", ...).
        assert container["name"] == "tensorflow"
        assert "env" not in container or all(
            e["name"] != "TF_CONFIG" for e in container["env"])
        check_role_command(role.lower(), container["command"])
        if role != "Evaluator":
            assert {"name": "tfjob-port", "containerPort": 2222} in container["ports"]
        assert spec["restartPolicy"] == "OnFailure"
        for volume in spec["template"]["spec"].get("volumes", []):
            assert volume["persistentVolumeClaim"]["claimName"] in claims


def test_plain_manifest_tf_configs_services_and_commands():
    docs = load_manifests("plain.yaml")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = [d for d in docs if d["kind"] in ("Deployment", "Job")
                 and d["metadata"]["name"] != "keras-ps-tensorboard"]
    configs = {}
    for workload in workloads:
        template = workload["spec"]["template"]
        (container,) = template["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        config = json.loads(env["TF_CONFIG"])
        task = task_of(config)
        assert task not in configs, f"two workloads for {task}"
        configs[task] = config
        check_role_command(task[0], container["command"])
        if workload["kind"] == "Deployment":
            # ps and workers serve until stopped; one pod each, restarted.
            assert task[0] in ("ps", "worker")
            assert workload["spec"]["replicas"] == 1
            assert workload["spec"]["selector"]["matchLabels"] == \
                template["metadata"]["labels"]
        else:
            assert task[0] in ("chief", "evaluator")
            assert template["spec"]["restartPolicy"] == "OnFailure"
        # The task's address is a Service that selects exactly this pod.
        host, _, port = config["cluster"][task[0]][task[1]].rpartition(":")
        service = services[host]
        assert service["spec"]["selector"] == template["metadata"]["labels"]
        assert {"name": "grpc", "port": int(port), "targetPort": 2222} in \
            service["spec"]["ports"]
    assert set(configs) == TASKS
    clusters = {json.dumps(c["cluster"], sort_keys=True) for c in configs.values()}
    assert len(clusters) == 1
    # Labels are unique per task, so no Service selects two tasks' pods.
    labels = [w["spec"]["template"]["metadata"]["labels"]["task"] for w in docs
              if w["kind"] in ("Deployment", "Job")]
    assert len(labels) == len(set(labels))
