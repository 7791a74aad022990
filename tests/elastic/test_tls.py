"""A rendezvous that speaks TLS only, and every one of its clients as a
user runs them: an agent process (`python -m keras_ps.elastic.launch`), a ps
process announcing itself (`python -m keras_ps.server --rdzv_endpoint`) and
the coordinator's `ElasticClusterResolver`. Loopback only; the worker's
address is an identifier (no TF server runs there)."""

import os
import subprocess
import sys

import portpicker
import pytest

from _certs import self_signed_cert  # tests/_certs.py
from _paths import REPO
from _polling import wait_until  # tests/_polling.py
from keras_ps.elastic import api
from keras_ps.elastic.client import RendezvousClient
from keras_ps.elastic.resolver import ElasticClusterResolver
from keras_ps.elastic.rendezvous_server import RendezvousServer

_SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
def tls_rendezvous(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    server = RendezvousServer(
        api.RendezvousConfig(gather_timeout=0.3, keepalive_timeout=5.0),
        host="127.0.0.1", tls_cert=str(cert), tls_key=str(key))
    endpoint = f"127.0.0.1:{server.start()}"
    yield endpoint, cert
    server.stop(0)


def _start(argv, log, **env):
    return subprocess.Popen(
        [sys.executable, *argv], cwd=REPO, stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env))


def _agent(endpoint, address, log, *flags):
    return _start(["-m", "keras_ps.elastic.launch",
                   f"--rdzv_endpoint={endpoint}", "--nnodes=1:2",
                   f"--address={address}", *flags, "--", *_SLEEPER], log)


@pytest.mark.timeout(180)
def test_every_client_reaches_a_tls_rendezvous_given_its_certificate(
        tls_rendezvous, tmp_path, monkeypatch):
    endpoint, cert = tls_rendezvous
    worker = f"127.0.0.1:{portpicker.pick_unused_port()}"
    ps_port = portpicker.pick_unused_port()
    spec = (f'{{"ps": ["localhost:{ps_port}"], '
            f'"worker": ["localhost:{portpicker.pick_unused_port()}"]}}')
    logs = [open(tmp_path / name, "w+") for name in ("agent.log", "ps.log")]
    processes = [
        _agent(endpoint, worker, logs[0], f"--tls_root_cert={cert}"),
        # The ps reads the certificate's file from the environment, as it
        # reads the token.
        _start(["-m", "keras_ps.server", "--cluster_spec", spec,
                "--job_name", "ps", "--exit_with_parent",
                "--rdzv_endpoint", endpoint], logs[1],
               KERAS_PS_RDZV_TLS_ROOT_CERT=str(cert))]
    resolvers = []
    try:
        # The coordinator's resolver: the certificate from the environment
        # here (given as tls_root_cert= in the next one).
        monkeypatch.setenv("KERAS_PS_RDZV_TLS_ROOT_CERT", str(cert))
        resolver = ElasticClusterResolver(endpoint, ps=1, min_workers=1,
                                          startup_timeout=120)
        resolvers.append(resolver)
        spec = resolver.cluster_spec().as_dict()
        assert spec == {"ps": [f"localhost:{ps_port}"], "worker": [worker]}, \
            spec
        monkeypatch.delenv("KERAS_PS_RDZV_TLS_ROOT_CERT")
        given = ElasticClusterResolver(endpoint, ps=1, min_workers=1,
                                       tls_root_cert=str(cert),
                                       startup_timeout=60)
        resolvers.append(given)
        assert given.ps_address(0) == f"localhost:{ps_port}"
        for process, log in zip(processes, logs):
            assert process.poll() is None, open(log.name).read()[-2000:]
        wait_until(lambda: f"announced localhost:{ps_port} to the "
                   f"rendezvous {endpoint}" in open(logs[1].name).read(), 30,
                   "the ps' line saying it announced itself")
    finally:
        for resolver in resolvers:
            resolver.close()
        for process in processes:
            process.kill()
            process.wait()
        for log in logs:
            log.close()


@pytest.mark.timeout(120)
def test_an_agent_without_the_certificate_is_told_to_give_it(
        tls_rendezvous, tmp_path):
    endpoint, _ = tls_rendezvous
    with open(tmp_path / "agent.log", "w+") as log:
        agent = _agent(endpoint, f"127.0.0.1:{portpicker.pick_unused_port()}",
                       log)
        try:
            assert agent.wait(timeout=90) == 1
        finally:
            agent.kill()
            agent.wait()
        output = open(log.name).read()
    assert f"rendezvous server {endpoint} is unavailable" in output, output
    assert "a rendezvous started with --tls_cert speaks TLS only; give its " \
        "clients that certificate (the agent's --tls_root_cert" in output, \
        output
    # Nobody joined meanwhile.
    with RendezvousClient(endpoint, timeout=5.0,
                          tls_root_cert=tls_rendezvous[1]) as client:
        assert client.list_members().addresses == ()


@pytest.mark.timeout(120)
def test_a_ps_without_the_certificate_says_why_it_cannot_announce(
        tls_rendezvous, tmp_path):
    endpoint, cert = tls_rendezvous
    port = portpicker.pick_unused_port()
    spec = (f'{{"ps": ["localhost:{port}"], '
            f'"worker": ["localhost:{portpicker.pick_unused_port()}"]}}')
    with open(tmp_path / "ps.log", "w+") as log:
        ps = _start(["-m", "keras_ps.server", "--cluster_spec", spec,
                     "--job_name", "ps", "--exit_with_parent",
                     "--rdzv_endpoint", endpoint], log)
        try:
            wait_until(lambda: "cannot announce its address" in open(
                log.name).read(), 60, "the ps to say it cannot announce")
            output = open(log.name).read()
            assert "KERAS_PS_RDZV_TLS_ROOT_CERT" in output, output
            assert ps.poll() is None, output  # it serves on, and retries
        finally:
            ps.kill()
            ps.wait()
    with RendezvousClient(endpoint, timeout=5.0, tls_root_cert=cert) as client:
        assert client.list_members().ps == ()
