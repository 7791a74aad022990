"""docker/: the image, the Compose cluster and the Kubernetes manifests.

Static checks (always): the compose file's TF_CONFIGs describe one cluster,
its commands, restart policies, health checks and ports; the Dockerfile; the
Kubernetes manifests and their NetworkPolicy.

On a Docker engine (where one answers; `.ci/run` starts one when it runs as
root on Debian, with docker/engine.sh): the image is built (FROM a local
Debian base when no registry is reachable), the Compose cluster runs as a
user runs it, to the chief's exit, and the faults the compose file promises
are caused for real: a killed chief, a killed ps and a killed worker, each
brought back by its restart policy.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import portpicker
import pytest
import yaml

from _paths import REPO as ROOT  # noqa: E402
from _polling import wait_until  # noqa: E402
DOCKER = os.path.join(ROOT, "docker")
COMPOSE_FILE = os.path.join(DOCKER, "compose.yaml")
ENGINE_SH = os.path.join(DOCKER, "engine.sh")
IMAGE = "keras_ps:dev"
SERVER_COMMAND = ["python", "-m", "keras_ps.server"]
TRAIN_SCRIPT = "/app/tutorials/model_fit.py"
TASKS = {("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1),
         ("evaluator", 0)}
HOW_TO_ENABLE = ("run the suite as root on a Debian machine through .ci/run, "
                 "or start an engine first with `docker/engine.sh start` "
                 "(root on Debian: installs docker.io, docker-compose and "
                 "debootstrap)")


def load_compose():
    with open(COMPOSE_FILE) as f:
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
        assert command[command.index("--export_filepath") + 1] == "/shared/best.keras"
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
    build, runtime = text.split("\nFROM ${PYTHON_IMAGE}\n")
    # No BuildKit-only syntax line: it would pull a frontend image.
    assert "# syntax=" not in text
    # The import check runs outside WORKDIR /src, whose source folder would
    # shadow the installed package.
    check = re.search(r"&& (cd \S+) && python -c \"import [^\"]*keras_ps\.callbacks",
                      build)
    assert check and check.group(1) != "cd /src", build
    # CPU-only TensorFlow in place of setup.cfg's tensorflow requirement.
    assert "'tensorflow-cpu'" in build and "pip install --no-deps ." in build
    # The final stage takes only the virtualenv, keras_ps' C++ kernels built
    # in the build stage (named by KERAS_PS_CACHE_DIR) and the tutorials.
    assert "COPY --from=build /opt/venv /opt/venv" in runtime
    assert ("COPY --from=build /opt/keras_ps/kernels /opt/keras_ps/kernels"
            in runtime and "KERAS_PS_CACHE_DIR=/opt/keras_ps/kernels" in runtime)
    assert "KERAS_PS_CACHE_DIR=/opt/keras_ps/kernels python -c" in build
    assert "pip install" not in runtime and "apt-get" not in runtime
    assert re.search(r"^USER keras$", runtime, re.M)
    assert "tutorials/ /app/tutorials/" in runtime  # the chief's script path
    # One .dockerignore at the context's root, read by both builders.
    ignore = open(os.path.join(ROOT, ".dockerignore")).read()
    assert re.search(r"^\*\*$", ignore, re.M)
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


def test_compose_services_restart_share_check_health_and_publish_one_port():
    compose = load_compose()
    # Compose 1.29 refuses the top-level `name` (v2 only): the project name
    # is given with -p.
    assert set(compose) <= {"services", "volumes", "networks"} | {
        k for k in compose if k.startswith("x-")}, set(compose)
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
            servers = {n for n, c in configs.items()
                       if task_of(c)[0] in ("ps", "worker")}
            # `up ... chief` starts the whole cluster.
            assert set(service["depends_on"]) == servers | {"evaluator", "tensorboard"}
            for dep, how in service["depends_on"].items():
                assert how["condition"] == ("service_healthy" if dep in servers
                                            else "service_started"), dep
    # TF's gRPC servers accept any caller: no port but TensorBoard's is
    # published, and that one on the host's loopback only.
    for name, service in services.items():
        assert "network_mode" not in service, name
        if name != "tensorboard":
            assert "ports" not in service, name
    (published,) = services["tensorboard"]["ports"]
    assert re.fullmatch(r"127\.0\.0\.1:\$\{TENSORBOARD_PORT:-6006\}:6006", published)
    board = services["tensorboard"]["command"]
    assert board[0] == "tensorboard"
    # TensorBoard reads where the chief's TensorBoard callback writes.
    assert board[board.index("--logdir") + 1] == "/shared/logs"
    assert "shared:/shared:ro" in services["tensorboard"]["volumes"]
    assert "shared" in compose["volumes"]


def compose_implementations():
    """Compose commands this machine has: v2 (`docker compose`) and/or
    Debian's Compose 1.29 (`docker-compose`); KERAS_PS_COMPOSE (a command
    line) replaces both."""
    if os.environ.get("KERAS_PS_COMPOSE"):
        return [shlex.split(os.environ["KERAS_PS_COMPOSE"])]
    found = []
    if shutil.which("docker") and subprocess.run(
            ["docker", "compose", "version"], capture_output=True,
            timeout=30).returncode == 0:
        found.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        found.append(["docker-compose"])
    return found


@pytest.mark.timeout(60)
@pytest.mark.parametrize("implementation", ["docker compose", "docker-compose"])
def test_compose_config_validates(implementation):
    commands = {" ".join(c[:2]) if c[0] == "docker" else "docker-compose": c
                for c in compose_implementations()}
    if implementation not in commands:
        pytest.skip(f"no `{implementation}` on this machine ({HOW_TO_ENABLE})")
    result = subprocess.run(
        commands[implementation] + ["-p", "keras_ps", "-f", COMPOSE_FILE,
                                    "config", "--quiet"],
        capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr


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
    # The operator labels every pod of the job with its name.
    check_network_policy(docs, {"training.kubeflow.org/job-name": "keras-ps"})


def check_network_policy(docs, job_labels):
    """Port 2222 of the job's pods is reachable from the job's own pods only."""
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == job_labels
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = [r for r in spec["ingress"]
               if {"protocol": "TCP", "port": 2222} in r.get("ports", [])]
    assert rule["from"] == [{"podSelector": {"matchLabels": job_labels}}]
    # No other rule opens 2222 (a rule without ports opens every port).
    for other in spec["ingress"]:
        assert other is rule or (other.get("ports") and all(
            p["port"] != 2222 for p in other["ports"])), other


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
    check_network_policy(docs, {"app": "keras-ps"})
    # TensorBoard carries the job's label but serves HTTP only.
    (board,) = [d for d in docs if d["kind"] == "Deployment"
                and d["metadata"]["name"] == "keras-ps-tensorboard"]
    assert board["spec"]["template"]["metadata"]["labels"]["app"] == "keras-ps"


# -- on a Docker engine ------------------------------------------------------------
def poll(predicate, timeout, what):
    """`wait_until` at the pace a container's log needs."""
    return wait_until(predicate, timeout, what, interval=0.5)


def docker(*args, timeout=120, check=True):
    result = subprocess.run(["docker", *args], capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed "
                             f"({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def engine_skip_reason():
    if shutil.which("docker") is None:
        return f"no docker client on this machine ({HOW_TO_ENABLE})"
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True,
                           timeout=30)
    if probe.returncode != 0:
        return f"no Docker engine answers ({HOW_TO_ENABLE})"
    if not compose_implementations():
        return f"no Docker Compose on this machine ({HOW_TO_ENABLE})"
    return None


@pytest.fixture(scope="module")
def image():
    """keras_ps:dev, built by docker/engine.sh (FROM a local Debian base when
    the pinned python image cannot be pulled; both stay in the engine, so a
    second run reuses their layers)."""
    reason = engine_skip_reason()
    if reason:
        pytest.skip(reason)
    prebuild = os.environ.get("KERAS_PS_IMAGE_PREBUILD")
    if prebuild:  # .ci/run started the build beside the other tests
        rc = os.path.join(prebuild, "rc")
        wait_until(lambda: os.path.exists(rc), timeout=1200,
                   what=f"the background image build ({prebuild}/log)",
                   interval=1.0)
    start = time.monotonic()
    result = subprocess.run([ENGINE_SH, "build", IMAGE], capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-5000:]
    print(f"\nimage {IMAGE} built in {time.monotonic() - start:.0f}s, "
          f"{int(docker('image', 'inspect', '-f', '{{.Size}}', IMAGE)) / 1e6:.0f} MB")
    return IMAGE


class Cluster:
    """One run of docker/compose.yaml under a project name of its own, with
    TensorBoard on a free host port, as a user runs it (plus, for the fault
    runs, an override of the chief's command)."""

    def __init__(self, workdir, chief_command=None):
        self.compose = compose_implementations()[0]
        self.project = f"kpstest{uuid.uuid4().hex[:10]}"
        self.files = [COMPOSE_FILE]
        if chief_command:
            override = os.path.join(workdir, f"{self.project}.override.yaml")
            with open(override, "w") as f:
                yaml.safe_dump({"services": {"chief": {"command": chief_command}}}, f)
            self.files.append(override)
        self.tensorboard_port = portpicker.pick_unused_port()
        self.env = dict(os.environ, TENSORBOARD_PORT=str(self.tensorboard_port))

    def command(self, *args):
        files = [a for f in self.files for a in ("-f", f)]
        return [*self.compose, "-p", self.project, *files, *args]

    def run(self, *args, timeout=300):
        result = subprocess.run(self.command(*args), capture_output=True,
                                text=True, timeout=timeout, env=self.env)
        assert result.returncode == 0, (args, result.stderr[-3000:])
        return result.stdout

    def _label(self, service=None):
        labels = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            labels += ["--filter", f"label=com.docker.compose.service={service}"]
        return labels

    def container(self, service):
        ids = docker("ps", "-aq", *self._label(service)).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def state(self, service):
        info = json.loads(docker("inspect", self.container(service)))[0]
        return dict(info["State"], RestartCount=info["RestartCount"])

    def logs(self, service):
        result = subprocess.run(["docker", "logs", self.container(service)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, timeout=60, errors="replace")
        return result.stdout

    def crash(self, service):
        """SIGKILLs the container's main process, as a crash or the kernel's
        OOM killer would. (`docker kill` counts as a manual stop, for which
        Docker never applies a restart policy.) Returns the time."""
        pid = self.state(service)["Pid"]
        assert pid > 0, f"{service} is not running"
        os.kill(pid, signal.SIGKILL)
        return time.monotonic()

    def volume(self, name):
        (volume,) = [v for v in docker("volume", "ls", "-q", *self._label()).split()
                     if v.endswith(f"_{name}")]
        return volume

    def in_image(self, script, timeout=180):
        """Runs `python -c script` in a new container of the image with the
        cluster's shared volume at /shared: what a user does to look at it."""
        result = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", "-v",
             f"{self.volume('shared')}:/shared:ro", IMAGE, "python", "-c", script],
            capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    def leftovers(self):
        return {kind: docker(kind, "ls", "-q", *self._label()).split()
                if kind != "container" else docker("ps", "-aq", *self._label()).split()
                for kind in ("container", "volume", "network")}

    def down(self):
        subprocess.run(self.command("down", "-v", "--remove-orphans", "-t", "5"),
                       capture_output=True, timeout=180, env=self.env)


@pytest.fixture
def make_cluster(image, tmp_path):
    """Clusters that are taken down (containers, network, volume) whatever
    the test's outcome."""
    clusters = []

    def make(**kwargs):
        cluster = Cluster(str(tmp_path), **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        # Every service's log, for a failed test's reader.
        for service in load_compose()["services"]:
            try:
                with open(tmp_path / f"{service}.log", "w") as f:
                    f.write(cluster.logs(service))
            except AssertionError:
                pass
        print(f"\nservice logs: {tmp_path}")
        cluster.down()
        left = cluster.leftovers()
        for container in left["container"]:
            docker("rm", "-f", container, check=False)
        for volume in left["volume"]:
            docker("volume", "rm", "-f", volume, check=False)
        for network in left["network"]:
            docker("network", "rm", network, check=False)


def chief_command(epochs, steps_per_epoch, per_execution, backup_freq):
    """The chief's command of a fault run: the tutorial, on /shared."""
    return ["python", TRAIN_SCRIPT, "--workdir", "/shared", "--epochs",
            str(epochs), "--steps_per_epoch", str(steps_per_epoch),
            "--steps_per_execution", str(per_execution), "--backup_freq",
            str(backup_freq)]


def number(pattern, text):
    match = re.search(pattern, text, re.M)
    assert match, f"no {pattern!r} in:\n{text[-3000:]}"
    return float(match.group(1))


def tensorboard_answer(port):
    """(status of TensorBoard's page, its runs) or None while it is not up."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
            status = r.status
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs",
                                    timeout=2) as r:
            return status, json.loads(r.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None


@pytest.mark.timeout(1500)
def test_compose_up_trains_and_returns_the_chiefs_exit_code(make_cluster):
    """The README's commands: `up --exit-code-from chief chief` starts the
    cluster, shows the chief's output, returns with its exit code when it is
    done; `down -v` leaves nothing behind."""
    cluster = make_cluster()
    start = time.monotonic()
    up = subprocess.Popen(cluster.command("up", "--exit-code-from", "chief", "chief"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=cluster.env, errors="replace")
    # TensorBoard answers on the published loopback port while the chief
    # trains, and lists the chief's training run.
    board = None
    deadline = time.monotonic() + 420
    while up.poll() is None and time.monotonic() < deadline:
        answer = tensorboard_answer(cluster.tensorboard_port)
        if answer and answer[0] == 200 and any(
                run.startswith("train") for run in answer[1]):
            board = answer
        time.sleep(0.5)
    try:
        output, _ = up.communicate(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        up.kill()
        raise AssertionError(f"`up` did not return: {up.communicate()[0][-3000:]}")
    output = re.sub(r"\x1b\[[0-9;]*m", "", output)  # Compose's colours
    print(f"\n`up` returned {up.returncode} after {time.monotonic() - start:.0f}s")
    chief = cluster.state("chief")
    assert chief["Status"] == "exited", chief
    # The command returns the chief's own exit code, and it succeeded.
    assert up.returncode == chief["ExitCode"] == 0, output[-4000:]
    # The chief's output, shown by `up`.
    assert re.search(r"^chief\S*\s+\| Training steps: 100$", output, re.M), output[-4000:]
    accuracy = number(r"Evaluation accuracy: ([\d.]+) on 200 examples", output)
    assert accuracy >= 0.95
    assert board, "TensorBoard never listed the training run"
    # keras_ps' C++ kernels were built into the image: each task loaded them
    # at start-up (its one line says which), none built or went without.
    for service in ("ps0", "ps1", "worker0", "worker1"):
        log = cluster.logs(service)
        assert "; native kernels loaded" in log, log[-2000:]
    # The rest of the cluster still serves (Compose 1.29 and v2 alike stop
    # only the attached chief): `down -v` removes all of it.
    running = docker("ps", "--format", "{{.Names}}", *cluster._label()).split()
    print(f"running after `up` returned: {running}")
    cluster.run("down", "-v", timeout=180)
    assert cluster.leftovers() == {"container": [], "volume": [], "network": []}


@pytest.mark.timeout(1500)
def test_chief_ps_and_worker_crashes_recover(make_cluster):
    """Each restart policy of the compose file, for real: the chief killed
    mid-epoch resumes from its backup; a killed ps comes back empty and the
    chief gives it its variables back from the backup in the same run; a
    killed worker comes back and the coordinator re-admits it. The job ends
    with the planned steps."""
    epochs, steps_per_epoch, per_execution = 8, 40, 2
    planned = epochs * steps_per_epoch
    cluster = make_cluster(chief_command=chief_command(
        epochs, steps_per_epoch, per_execution, backup_freq=10))
    cluster.run("up", "-d", timeout=300)

    def chief_log_after(count, pattern):
        """The chief's log once `pattern` matches in its (count+1)-th run."""
        def check():
            runs = cluster.logs("chief").split("embedding shards:")[1:]
            return len(runs) > count and re.search(pattern, runs[count], re.M) \
                and runs[count]
        return check

    def restarted(service, times):
        def check():
            state = cluster.state(service)
            return state["RestartCount"] >= times and state["Status"] == "running"
        return check

    # 1. The chief, SIGKILLed in its second epoch after a mid-epoch backup,
    # is restarted and resumes from the newest backup it wrote. The kill
    # lands a moment after the backup seen: later ones may exist by then,
    # an epoch's end too (resuming mid-epoch alone is test_fit_faults').
    poll(chief_log_after(0, r"backup \d+ written: epoch 1, step 10 \("), 300,
         "the chief's backup at step 10 of its second epoch")
    cluster.crash("chief")
    poll(restarted("chief", 1), 60, "the chief's restart")
    restored = r"restored backup backup-(\d+)\S*: epoch (\d+), step (\d+)"
    second = poll(chief_log_after(1, restored), 180,
                  "the restarted chief's restore")
    backup, epoch, step = map(int, re.search(restored, second).groups())
    first_run = cluster.logs("chief").split("embedding shards:")[1]
    written = {int(n): (int(e), int(s)) for n, e, s in re.findall(
        r"backup (\d+) written: epoch (\d+), step (\d+) \(", first_run)}
    newest = max(written)
    # A backup published in the instant before the kill may miss its log
    # line: never an older one than the newest logged.
    assert backup >= newest and (epoch, step) >= (1, 10), (
        f"restored backup {backup} (epoch {epoch}, step {step}); the killed "
        f"run wrote {written}")
    if backup in written:
        assert written[backup] == (epoch, step), (backup, epoch, step, written)

    # 2. ps0 SIGKILLed: restarted by its policy with its variables lost; the
    # same chief run recovers it from its backup and trains on.
    poll(chief_log_after(1, r"^Epoch \d+/"), 120, "the chief training again")
    killed = cluster.crash("ps0")
    poll(restarted("ps0", 1), 60, "ps0's restart")
    recovered = poll(chief_log_after(1, r"ps \[0\] recovered in ([\d.]+)s"),
                     180, "the chief's in-run recovery of ps0")
    chief_recovered = time.monotonic() - killed
    assert cluster.state("chief")["RestartCount"] == 1, recovered[-3000:]

    # 3. worker1 SIGKILLed: restarted, re-admitted, it runs steps again.
    poll(chief_log_after(1, r"recovered in [\d.]+s[\s\S]*^Epoch \d+/"), 120,
         "the chief training again after the recovery")
    cluster.crash("worker1")
    poll(restarted("worker1", 1), 60, "worker1's restart")

    # The chief finishes: exit code 0 and the planned number of steps.
    poll(lambda: cluster.state("chief")["Status"] == "exited", 600,
         "the chief's end")
    chief = cluster.state("chief")
    log = cluster.logs("chief")
    last = log.split("embedding shards:")[-1]
    assert chief["ExitCode"] == 0 and chief["RestartCount"] == 1, log[-4000:]
    # At-least-once: an execution per worker may run twice.
    steps = number(r"^Training steps: (\d+)$", last)
    assert planned <= steps <= planned + 2 * 2 * per_execution, last[-3000:]
    assert number(r"Evaluation accuracy: ([\d.]+)", last) >= 0.95
    # The worker's loss and re-admission, seen by the chief's coordinator.
    assert re.search(r"\[worker:1\] healthy -> failed", last), last[-4000:]
    assert re.search(r"\[worker:1\] \w+ -> healthy", last), last[-4000:]
    assert re.search(r"\[worker:1\] first call after \(re\)admission", last), last
    line = re.search(r"^Steps per worker: .*$", last, re.M)
    assert line, last[-3000:]
    per_worker = {index: (int(steps), state) for index, steps, state in
                  re.findall(r"worker (\d): (\d+) \((\w+)\)", line[0])}
    print(f"\nresumed at epoch {epoch} step {step}; ps0 recovered "
          f"{chief_recovered:.1f}s after its kill; last run: {line[0]}")
    assert per_worker["1"][0] > 0 and per_worker["1"][1] == "healthy", line[0]

    # The evaluator ends by itself after the final checkpoint, having
    # exported the best model, which loads and scores like the chief's.
    poll(lambda: cluster.state("evaluator")["Status"] == "exited", 300,
         "the evaluator's end")
    evaluator = cluster.state("evaluator")
    assert evaluator["ExitCode"] == 0, cluster.logs("evaluator")[-3000:]
    assert re.search(r"exported /shared/best\.keras", cluster.logs("evaluator"))
    scores = json.loads(cluster.in_image(
        "import json, sys; sys.path.insert(0, '/app/tutorials'); import keras, "
        "model_fit; _, data = model_fit.eval_model(); "
        "model = keras.models.load_model('/shared/best.keras'); "
        "print(json.dumps(model.evaluate(data, verbose=0, return_dict=True)))"
    ).strip().splitlines()[-1])
    assert scores["accuracy"] >= 0.95, scores
    # ps and workers keep serving until `down`.
    for name in ("ps0", "ps1", "worker0", "worker1"):
        assert cluster.state(name)["Status"] == "running", name


@pytest.mark.slow  # in the suite on a LocalCluster: test_ps_recovery's notice
@pytest.mark.timeout(1500)  # test, and test_cluster's exit status as PID 1
def test_a_ps_sigtermed_in_place_is_restarted_by_its_policy_and_recovered(
        make_cluster):
    """SIGTERM to a ps container's command (a preempted node's notice to the
    process, a `kill` in the container; `docker stop` is a manual stop, for
    which Docker applies no restart policy): the tutorial's
    BackupAndRestore(save_before_preemption=True) backs up at the next step
    and releases the ps, which ends by the signal (143, not 0), so `restart:
    on-failure` brings it back, and the same chief run recovers it with no
    step rolled back."""
    epochs, steps_per_epoch, per_execution = 6, 40, 2
    planned = epochs * steps_per_epoch
    cluster = make_cluster(chief_command=chief_command(
        epochs, steps_per_epoch, per_execution, backup_freq="epoch"))
    cluster.run("up", "-d", timeout=300)
    poll(lambda: re.search(r"^Epoch 2/", cluster.logs("chief"), re.M), 300,
         "the chief's second epoch")
    os.kill(cluster.state("ps1")["Pid"], signal.SIGTERM)
    poll(lambda: cluster.state("ps1")["RestartCount"] >= 1 and
         cluster.state("ps1")["Status"] == "running", 120, "ps1's restart")
    poll(lambda: cluster.state("chief")["Status"] == "exited", 600,
         "the chief's end")
    log = cluster.logs("chief")
    chief = cluster.state("chief")
    assert chief["ExitCode"] == 0 and chief["RestartCount"] == 0, log[-4000:]
    assert re.search(r"written after the preemption notice of ps \[1\]: "
                     r"released", log), log[-4000:]
    assert re.search(r"ps \[1\] recovered in [\d.]+s", log), log[-4000:]
    assert re.search(r"\(0 steps rolled back\)", log), log[-4000:]
    steps = number(r"^Training steps: (\d+)$", log)
    assert planned <= steps <= planned + 2 * 2 * per_execution, log[-3000:]
    # The first ps1 process' own last line, before its restart.
    assert "ps:1 stopping on SIGTERM, released by the coordinator after " \
        "its backup" in cluster.logs("ps1"), cluster.logs("ps1")[-3000:]


@pytest.mark.slow  # the suite has the same in a PID namespace: test_preemption
@pytest.mark.timeout(1500)
def test_docker_stop_of_the_chief_backs_up_first_and_start_resumes_there(
        make_cluster):
    """`docker stop` sends the chief's command, the container's first
    process, SIGTERM and a SIGKILL after the grace period. The tutorial's
    BackupAndRestore(save_before_preemption=True) writes a backup at the
    next step and exits 143 by itself (a SIGKILL would be 137); `docker
    start` resumes at that backup's step and finishes."""
    epochs, steps_per_epoch, per_execution = 6, 40, 2
    planned = epochs * steps_per_epoch
    cluster = make_cluster(chief_command=chief_command(
        epochs, steps_per_epoch, per_execution, backup_freq="epoch"))
    cluster.run("up", "-d", timeout=300)

    def chief_runs():
        return cluster.logs("chief").split("embedding shards:")[1:]

    poll(lambda: chief_runs() and re.search(r"^Epoch 2/", chief_runs()[0], re.M),
         300, "the chief's second epoch")
    docker("stop", "-t", "120", cluster.container("chief"), timeout=240)
    stopped = cluster.state("chief")
    first = chief_runs()[0]
    assert stopped["ExitCode"] == 128 + signal.SIGTERM, first[-4000:]
    noticed = re.search(r"SIGTERM: backup \d+ \(epoch (\d+), step (\d+)\) "
                        r"written; passing the signal on", first)
    assert noticed, first[-4000:]
    at = tuple(map(int, noticed.groups()))

    docker("start", cluster.container("chief"))
    poll(lambda: len(chief_runs()) == 2 and cluster.state("chief")["Status"]
         == "exited", 600, "the restarted chief's end")
    second = chief_runs()[1]
    assert cluster.state("chief")["ExitCode"] == 0, second[-4000:]
    restored = re.search(r"restored backup .*: epoch (\d+), step (\d+)", second)
    assert restored and tuple(map(int, restored.groups())) == at, second[-4000:]
    steps = number(r"^Training steps: (\d+)$", second)
    assert planned <= steps <= planned + 2 * 2 * per_execution, second[-3000:]
    print(f"\nSIGTERM backup at epoch {at[0]} step {at[1]}; resumed there")
