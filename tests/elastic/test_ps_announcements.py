"""A ps' address announced to the rendezvous: the registry's rules with a
fake clock, the RPC over real gRPC, and real `python -m keras_ps.server
--rdzv_endpoint` processes announcing themselves. Loopback only."""

import json
import os
import subprocess
import sys
import time

import portpicker
import pytest

from _clock import FakeClock  # tests/_clock.py
from _polling import wait_until  # tests/_polling.py
from keras_ps.elastic import api
from keras_ps.elastic._ps_registry import PsRegistry
from keras_ps.elastic.client import RendezvousClient
from keras_ps.elastic.rendezvous_server import RendezvousServer

P0, P1, P2 = "127.0.0.1:21100", "127.0.0.1:21101", "127.0.0.1:21102"


def test_an_announcement_holds_for_its_lease_and_renewals_extend_it():
    clock = FakeClock()
    registry = PsRegistry(lease=10.0, clock=clock)
    assert registry.addresses() == []
    assert registry.announce(1, P1, "b") == 10.0
    assert registry.addresses() == ["", P1]
    clock.now += 9.0
    registry.announce(1, P1, "b")  # renewed: 10 s from now
    clock.now += 9.0
    assert registry.addresses() == ["", P1]
    clock.now += 1.0
    assert registry.addresses() == []  # lapsed: its ps is gone


def test_a_newer_ps_process_replaces_the_older_for_good():
    clock = FakeClock()
    registry = PsRegistry(lease=10.0, clock=clock)
    registry.announce(0, P0, "old")
    registry.announce(0, P2, "new")
    assert registry.addresses() == [P2]
    # The old process, cut off and still renewing, cannot take it back,
    # even once the new one's announcement lapsed.
    with pytest.raises(api.RendezvousStateError) as raised:
        registry.announce(0, P0, "old")
    assert "replaced by a newer ps process announcing index 0 (at " \
        f"{P2})" in str(raised.value), raised.value
    assert "Stop this process" in str(raised.value)
    clock.now += 11.0
    with pytest.raises(api.RendezvousStateError):
        registry.announce(0, P0, "old")
    assert registry.addresses() == []
    registry.announce(0, P2, "new")
    assert registry.addresses() == [P2]


@pytest.fixture
def server(request):
    lease = getattr(request, "param", 1.0)
    rendezvous = RendezvousServer(
        api.RendezvousConfig(keepalive_timeout=lease))
    endpoint = f"127.0.0.1:{rendezvous.start()}"
    client = RendezvousClient(endpoint, timeout=5.0)
    yield endpoint, client
    client.close()
    rendezvous.stop(0)


@pytest.mark.timeout(60)
def test_announced_ps_are_listed_without_a_membership_change(server):
    endpoint, client = server
    before = client.list_members()
    assert before.ps == ()
    assert client.announce_ps(1, P1, "ps-1") == 1.0  # the server's lease
    after = client.list_members()
    assert after.ps == (None, P1)
    assert after.version == before.version  # worker watches not woken
    client.announce_ps(0, P0, "ps-0")
    client.announce_ps(0, P2, "ps-0-replacement")
    assert client.list_members().ps == (P2, P1)
    with pytest.raises(api.RendezvousStateError) as raised:
        client.announce_ps(0, P0, "ps-0")
    assert f"(at {P2})" in str(raised.value), raised.value
    # Nobody renews: both lapse within the 1 s lease.
    wait_until(lambda: client.list_members().ps == (), 30,
               "the announcements to lapse")


def _ps_process(port, endpoint, log):
    spec = {"ps": [f"localhost:{port}"], "worker": ["localhost:1"]}
    return subprocess.Popen(
        [sys.executable, "-m", "keras_ps.server", "--cluster_spec",
         json.dumps(spec), "--job_name", "ps", "--exit_with_parent",
         "--rdzv_endpoint", endpoint], stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("server", [4.0], indirect=True)  # the lease
def test_a_ps_process_announces_itself_until_a_newer_one_replaces_it(
        server, tmp_path):
    endpoint, client = server
    first, second = (portpicker.pick_unused_port() for _ in range(2))
    logs = [open(tmp_path / f"ps-{i}.log", "w+") for i in range(2)]
    processes = [_ps_process(first, endpoint, logs[0])]
    try:
        wait_until(lambda: client.list_members().ps == (
            f"localhost:{first}",), 60, "ps 0 to announce itself")
        wait_until(lambda: "announced localhost:" in open(
            logs[0].name).read(), 30, "its line")
        assert f"keras_ps.server: ps:0 announced localhost:{first} to the " \
            f"rendezvous {endpoint} (renewed every 1.33 s)" in open(
                logs[0].name).read()
        processes.append(_ps_process(second, endpoint, logs[1]))
        wait_until(lambda: "stops announcing its address" in open(
            logs[0].name).read(), 60, "the first ps to stop announcing")
        text = open(logs[0].name).read()
        assert "replaced by a newer ps process announcing index 0 (at " \
            f"localhost:{second})" in text, text
        # The newer one keeps its address listed for over two leases: it
        # renews it (unrenewed, it lapses within one).
        wait_until(lambda: client.list_members().ps == (
            f"localhost:{second}",), 30, "the second ps listed")
        until = time.monotonic() + 9.0
        while time.monotonic() < until:
            assert client.list_members().ps == (f"localhost:{second}",)
            time.sleep(0.1)
        assert processes[0].poll() is None  # it serves on, unannounced
    finally:
        for process in processes:
            process.kill()
            process.wait()
        for log in logs:
            log.close()


@pytest.mark.timeout(120)
def test_a_ps_started_before_the_rendezvous_announces_once_it_answers(
        tmp_path):
    port, rendezvous_port = (portpicker.pick_unused_port() for _ in range(2))
    endpoint = f"127.0.0.1:{rendezvous_port}"
    with open(tmp_path / "ps.log", "w+") as log:
        process = _ps_process(port, endpoint, log)
        rendezvous = None
        try:
            wait_until(lambda: "cannot announce its address to the "
                       f"rendezvous {endpoint} yet" in open(log.name).read(),
                       60, "the ps to find no rendezvous")
            rendezvous = RendezvousServer(
                api.RendezvousConfig(keepalive_timeout=5.0),
                port=rendezvous_port)
            rendezvous.start()
            with RendezvousClient(endpoint, timeout=5.0) as client:
                wait_until(lambda: client.list_members().ps == (
                    f"localhost:{port}",), 60, "ps 0 to announce itself")
        finally:
            process.kill()
            process.wait()
            if rendezvous is not None:
                rendezvous.stop(0)
