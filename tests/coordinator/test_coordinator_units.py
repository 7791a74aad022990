"""Fast unit tests of the pure parts: failure policy and closure queue."""

import concurrent.futures
import threading
import time
import types

import pytest
import tensorflow as tf

from _polling import wait_until  # tests/_polling.py
from keras_ps import cluster as cluster_lib
from keras_ps import errors
from keras_ps.coordinator import failure_handling
from keras_ps.coordinator import ps_addresses
from keras_ps.coordinator import watchdog
from keras_ps.coordinator.closures import Closure, ClosureQueue
from keras_ps.coordinator.failure_handling import Decision
from keras_ps.coordinator.worker_states import WorkerState
from keras_ps.errors import ParameterServerUnavailableError
from keras_ps.errors import StuckCallError

pytestmark = pytest.mark.timeout(60)

UNAVAILABLE = tf.errors.UnavailableError(None, None, "gone")
APP = tf.errors.InvalidArgumentError(None, None, "NaN")


@pytest.mark.parametrize("error, alive, dead_ps, failures, expected", [
    (UNAVAILABLE, True, [0], 1, Decision.RAISE_PS_FAILURE),
    (APP, True, [1], 1, Decision.RAISE_PS_FAILURE),
    (UNAVAILABLE, False, [], 1, Decision.RETRY_ELSEWHERE),
    (APP, False, [], 1, Decision.RETRY_ELSEWHERE),
    (UNAVAILABLE, True, [], 1, Decision.RETRY),
    (UNAVAILABLE, True, [], 4, Decision.RETRY_ELSEWHERE),
    (APP, True, [], 1, Decision.RAISE),
])
def test_decide(error, alive, dead_ps, failures, expected):
    assert failure_handling.decide(error, alive, dead_ps,
                                 consecutive_failures=failures) is expected


def test_outputs_lost_after_the_function_ran_are_retried_once():
    # The function ran to its end; copying its outputs back failed with an
    # error that is not about the connection (a worker stopped or killed at
    # that moment): retried, not raised as the user's error. A second such
    # failure of the same closures is the outputs themselves, and raised.
    assert failure_handling.decide(
        APP, True, [], outputs_lost=1) is Decision.RETRY
    assert failure_handling.decide(
        APP, True, [], consecutive_failures=2, outputs_lost=2) is Decision.RAISE
    # A lost ps, a lost worker and a lost context still come first.
    assert failure_handling.decide(
        APP, True, [0], outputs_lost=1) is Decision.RAISE_PS_FAILURE
    assert failure_handling.decide(
        APP, False, [], outputs_lost=2) is Decision.RETRY_ELSEWHERE
    assert failure_handling.decide(
        APP, True, [], context_lost=True, outputs_lost=2) \
        is Decision.RETRY_ELSEWHERE


def test_context_lost_is_never_blamed_on_the_user():
    assert failure_handling.decide(APP, True, [], context_lost=True) \
        is Decision.RETRY_ELSEWHERE


def test_a_failure_after_every_readmission_is_bounded():
    # A worker found restarted again and again before any call could run
    # on it (a process that crashes at every call, brought back each time):
    # after a few re-admissions that is raised, never retried forever.
    limit = failure_handling.MAX_FAILED_READMISSIONS
    decisions = [failure_handling.decide(APP, True, [], context_lost=True,
                                         consecutive_failures=n,
                                         failed_readmissions=n)
                 for n in range(1, limit + 2)]
    assert decisions[:limit] == [Decision.RETRY_ELSEWHERE] * limit
    assert decisions[limit] is Decision.RAISE_REPEATED
    # An unreachable worker (killed again) is waited for, not raised.
    assert failure_handling.decide(APP, False, [], context_lost=True,
                                   failed_readmissions=limit + 1) \
        is Decision.RETRY_ELSEWHERE


def _closures(fn, n):
    return [Closure(fn, (), {}, False) for _ in range(n)]


def test_take_packs_fair_power_of_two_share_of_one_function():
    queue = ClosureQueue()
    f, g = object(), object()
    for c in _closures(f, 11) + _closures(g, 3):
        queue.put(c)
    batch = queue.take(max_pack=16, num_takers=2)  # share ceil(14/2)=7 -> 4
    assert len(batch) == 4 and all(c.fn is f for c in batch)
    batch = queue.take(max_pack=16, num_takers=1)  # 10 left, 7 of f -> 4
    assert [c.fn for c in batch] == [f] * 4
    assert [c.fn for c in queue.take(max_pack=4, num_takers=1)] == [f, f]
    assert [c.fn for c in queue.take(max_pack=4, num_takers=1)] == [f]
    assert [c.fn for c in queue.take(max_pack=4, num_takers=1)] == [g, g]


def test_put_back_requeues_first_and_join_waits():
    queue = ClosureQueue()
    first, second = _closures(object(), 2)
    queue.put(first)
    queue.put(second)
    batch = queue.take(max_pack=1, num_takers=1)
    assert batch == [first]
    queue.put_back(batch)
    assert queue.take(max_pack=1, num_takers=1) == [first]
    assert not queue.done()
    queue.mark_finished(1)
    assert queue.take(max_pack=1, num_takers=1) == [second]
    queue.mark_finished(1)
    assert queue.done()
    queue.wait()


def test_application_error_raised_once_and_pending_cancelled():
    queue = ClosureQueue()
    running, *pending = _closures(object(), 4)
    for c in [running, *pending]:
        queue.put(c)
    queue.take(max_pack=1, num_takers=1)
    queue.mark_failed(1, APP, running.generation)
    with pytest.raises(tf.errors.InvalidArgumentError):
        queue.wait()
    queue.wait()  # raised once
    for c in pending:
        with pytest.raises(tf.errors.CancelledError):
            c.remote_value.fetch(timeout=1)


def test_errors_of_closures_already_in_flight_are_not_raised_again():
    queue = ClosureQueue()
    a, b = _closures(object(), 2)
    queue.put(a)
    queue.put(b)
    queue.take(max_pack=1, num_takers=2)
    queue.take(max_pack=1, num_takers=2)
    queue.mark_failed(1, APP, a.generation)
    with pytest.raises(tf.errors.InvalidArgumentError):
        queue.wait()
    queue.mark_failed(1, APP, b.generation)  # same generation: swallowed
    queue.wait()
    c = Closure(object(), (), {}, False)
    queue.put(c)
    queue.take(max_pack=1, num_takers=1)
    queue.mark_failed(1, APP, c.generation)  # a new generation: raised
    with pytest.raises(tf.errors.InvalidArgumentError):
        queue.wait()


def test_fatal_error_raised_every_time():
    queue = ClosureQueue()
    queue.put(Closure(object(), (), {}, False))
    queue.take(max_pack=1, num_takers=1)
    fatal = ParameterServerUnavailableError("ps 0 gone")
    queue.mark_fatal(1, fatal)
    for _ in range(2):
        with pytest.raises(ParameterServerUnavailableError):
            queue.done()
    with pytest.raises(tf.errors.UnavailableError):
        queue.put(Closure(object(), (), {}, False))


def test_take_blocks_until_work_arrives():
    queue = ClosureQueue()
    got = []
    taker = threading.Thread(target=lambda: got.append(queue.take(4, 1)))
    taker.start()
    closure = Closure(object(), (), {}, False)
    queue.put(closure)
    taker.join(timeout=10)
    assert got == [[closure]]


def test_errors_pickle():
    import pickle

    error = pickle.loads(pickle.dumps(ParameterServerUnavailableError("ps 0 gone")))
    assert isinstance(error, tf.errors.UnavailableError) and "ps 0 gone" in str(error)


# -- worker states ------------------------------------------------------------------
def test_worker_state_transitions_are_checked_and_final_states_stay():
    from keras_ps.coordinator import worker as worker_lib
    S = worker_lib.WorkerState
    assert set(worker_lib.ALLOWED_TRANSITIONS) == set(S)
    worker = worker_lib.Worker(services=None, index=0, address="localhost:1")
    assert worker.transition(S.HUNG, "test")            # healthy -> hung
    assert not worker.transition(S.HEALTHY, "test")     # hung must recover first
    assert worker.state is S.HUNG
    assert worker.transition(S.RECOVERING, "test")
    assert worker.transition(S.READMITTED, "test")
    assert worker.transition(S.HEALTHY, "test")         # first call ran
    assert worker.transition(S.LEFT, "test")
    assert not worker.transition(S.RECOVERING, "test")  # LEFT is final
    assert worker.transition(S.STOPPED, "test")
    assert worker.state is S.STOPPED
    # A joining member that is no worker task is refused: final, but its
    # place may be given to another address (it leaves) or stopped.
    joining = worker_lib.Worker(services=None, index=1, address="localhost:2",
                                state=S.JOINING)
    assert joining.transition(S.REFUSED, "test")
    assert not joining.transition(S.RECOVERING, "test")  # REFUSED is final
    assert joining.transition(S.LEFT, "test")
    assert not worker_lib.Worker(None, 2, "localhost:3").transition(
        S.REFUSED, "test")  # only a joining member is refused


# -- packing --------------------------------------------------------------------------
def test_pack_sizes_are_powers_of_two_within_a_fair_share():
    from keras_ps.coordinator import packing
    assert packing.pack_limit(pending=100, max_pack=16, num_takers=2) == 16
    assert packing.pack_limit(pending=12, max_pack=16, num_takers=2) == 4
    assert packing.pack_limit(pending=1, max_pack=16, num_takers=4) == 1
    assert [packing.pack_size(n) for n in (1, 2, 3, 7, 8, 9)] == [1, 2, 2, 4, 8, 8]


def test_packed_functions_are_released_with_their_function():
    import gc
    from keras_ps.coordinator.packing import PackedFunctions
    cache = PackedFunctions()
    step = tf.function(lambda x: x + 1)
    calls = [((tf.constant(1),), {}), ((tf.constant(2),), {})]
    pack = cache.prepare(step, calls)  # traced
    assert cache.prepare(step, calls).function is pack.function
    assert cache.is_traced(step, 2) and len(cache) == 1
    results, _ = pack.function(*pack.args)
    assert [int(r) for r in pack.split(results)] == [2, 3]
    del step, pack
    gc.collect()
    assert len(cache) == 0


def test_without_new_trace_shrinks_to_a_traced_size_only_when_unsafe():
    from keras_ps.coordinator.packing import PackedFunctions
    cache = PackedFunctions()
    step = tf.function(lambda: tf.constant(0))
    batch = [Closure(step, (), {}, False) for _ in range(4)]
    assert cache.without_new_trace(batch, lambda: True) == (batch, [])
    assert cache.without_new_trace(batch, lambda: False) == (batch, [])
    cache.prepare(step, [((), {}), ((), {})])
    assert cache.without_new_trace(batch, lambda: False) == (batch[:2], batch[2:])


def test_a_trace_under_way_is_not_a_traced_size():
    # A trace waits while TF registers its pack on every worker, a hung one
    # too. Until it returns, another worker's thread falls back to a size
    # traced already instead of joining that wait: when a worker may be
    # hung, and also when none seems to be (one may have stopped after the
    # trace began, and its wait is not over).
    import threading
    from keras_ps.coordinator.packing import PackedFunctions
    cache = PackedFunctions()
    in_trace, release, block = threading.Event(), threading.Event(), []

    def step(x):  # Python: run again by each pack's trace
        if block:
            in_trace.set()
            release.wait(60)
        return x + 1

    calls = [((tf.constant(i),), {}) for i in range(4)]
    cache.prepare(step, calls[:2])
    block.append(True)
    tracer = threading.Thread(target=cache.prepare, args=(step, calls))
    tracer.start()
    try:
        assert in_trace.wait(60)
        batch = [Closure(step, args, {}, False) for args, _ in calls]
        assert not cache.is_traced(step, 4) and cache.sizes(step) == [2]
        assert cache.without_new_trace(batch, lambda: False) == (batch[:2],
                                                                 batch[2:])
        assert cache.without_new_trace(batch, lambda: True) == (batch[:2],
                                                                batch[2:])
    finally:
        release.set()
        tracer.join()
    assert cache.is_traced(step, 4) and cache.sizes(step) == [2, 4]
    assert cache.without_new_trace(batch, lambda: False) == (batch, [])


def test_a_function_whose_trace_is_under_way_gives_way_to_its_stand_in():
    # fit's steps written out, traced by one worker's thread: the others run
    # the loop form meanwhile, even when no worker seems hung, instead of
    # waiting for that trace (a worker stopped since may hold it).
    import threading
    from keras_ps.coordinator import packing
    cache = packing.PackedFunctions()
    in_trace, release = threading.Event(), threading.Event()
    looped = packing.loop_packable(tf.function(lambda it: tf.constant(1)))

    def slow_to_trace(it):
        in_trace.set()
        release.wait(60)
        return tf.constant(2)

    written_out = packing.loop_packable(tf.function(slow_to_trace),
                                        stand_in=looped)
    it = tf.constant(0)
    cache.prepare(looped, [((it,), {})] * 2)
    tracer = threading.Thread(target=cache.prepare,
                              args=(written_out, [((it,), {})] * 2))
    tracer.start()
    try:
        assert in_trace.wait(60)
        closures = [Closure(written_out, (it,), {}, False) for _ in range(2)]
        assert cache.without_new_trace(closures, lambda: True) == (closures, [])
        assert all(c.fn is looped for c in closures)
    finally:
        release.set()
        tracer.join()
    closures = [Closure(written_out, (it,), {}, False) for _ in range(2)]
    assert cache.without_new_trace(closures, lambda: True) == (closures, [])
    assert all(c.fn is written_out for c in closures)


def test_two_threads_never_both_start_the_same_new_trace():
    # Two workers' threads take batches of a pack not traced yet at the same
    # moment, with every worker answering: one is let through to trace it;
    # the other runs a size traced already instead of waiting for that
    # trace (a worker that stops meanwhile would hold both). Once its batch
    # is done with (here: never reaching the trace), the claim is released.
    import threading
    from keras_ps.coordinator.packing import PackedFunctions
    cache = PackedFunctions()
    step = tf.function(lambda x: x + 1)
    calls = [((tf.constant(i),), {}) for i in range(4)]
    cache.prepare(step, calls[:2])
    batches = [[Closure(step, args, {}, False) for args, _ in calls]
               for _ in range(2)]
    got, done = [], threading.Event()

    def take(batch):
        got.append(cache.without_new_trace(batch, lambda: True))
        done.wait(60)  # the claim is held until the batch is done with
        cache.release_claim()

    threads = [threading.Thread(target=take, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sizes = sorted(len(run) for run, _ in got)
    done.set()
    for t in threads:
        t.join()
    assert sizes == [2, 4]
    # Released: a thread may start that trace again.
    assert cache.without_new_trace(batches[0], lambda: True) == (batches[0], [])
    cache.release_claim()


def test_a_claim_whose_size_another_thread_traced_meanwhile_is_given_back():
    # A thread is let through to trace a pack size, and before its batch
    # reaches the trace another thread traces that size. Its claim is given
    # back when its pack is prepared: the size is no longer under way.
    import threading
    from keras_ps.coordinator.packing import PackedFunctions
    cache = PackedFunctions()
    step = tf.function(lambda x: x + 1)
    calls = [((tf.constant(i),), {}) for i in range(4)]
    batch = [Closure(step, args, {}, False) for args, _ in calls]
    assert cache.without_new_trace(batch, lambda: True) == (batch, [])
    other = threading.Thread(target=cache.prepare, args=(step, calls))
    other.start()
    other.join()
    assert cache.is_traced(step, 4)
    cache.prepare(step, calls)  # this thread's batch, traced already
    assert cache._under_way[step][4] == 0


def test_a_function_not_traced_gives_way_to_its_stand_in_only_when_unsafe():
    # fit's steps written out, handed out before a worker stopped: when the
    # call runs, the loop form (traced) runs in its place, never tracing
    # while a worker may be hung; once it is safe, the form written out.
    from keras_ps.coordinator import packing
    cache = packing.PackedFunctions()
    looped = packing.loop_packable(tf.function(lambda it: tf.constant(1)))
    written_out = packing.loop_packable(tf.function(lambda it: tf.constant(2)),
                                        stand_in=looped)
    it = tf.constant(0)

    def batch(fn, n):
        return [Closure(fn, (it,), {}, False) for _ in range(n)]

    # The stand-in is not traced either: nothing to gain, run as given.
    closures = batch(written_out, 2)
    assert cache.without_new_trace(closures, lambda: False) == (closures, [])
    assert all(c.fn is written_out for c in closures)
    cache.prepare(looped, [((it,), {})] * 2)  # traced in a loop: any size
    # Safe: the function runs as scheduled (and is traced).
    closures = batch(written_out, 3)
    assert cache.without_new_trace(closures, lambda: True) == (closures, [])
    assert all(c.fn is written_out for c in closures)
    # Unsafe: the whole batch runs the stand-in, which gives the same
    # results from the same arguments.
    assert cache.without_new_trace(closures, lambda: False) == (closures, [])
    assert all(c.fn is looped for c in closures)
    pack = cache.prepare(looped, [(c.args, c.kwargs) for c in closures])
    results, _ = pack.function(*pack.args)
    assert [int(r) for r in pack.split(results)] == [1, 1, 1]
    # Once the function itself is traced, it runs even while unsafe.
    cache.prepare(written_out, [((it,), {})])
    closures = batch(written_out, 2)
    assert cache.without_new_trace(closures, lambda: False) == (closures, [])
    assert all(c.fn is written_out for c in closures)


# -- settings -------------------------------------------------------------------------
def test_coordinator_config_validates_and_reads_the_environment(monkeypatch):
    from keras_ps.coordinator.config import CoordinatorConfig
    monkeypatch.setenv("KERAS_PS_MAX_PACK", "4")
    monkeypatch.setenv("KERAS_PS_HANG_TIMEOUT", "3")
    config = CoordinatorConfig.from_env()
    assert (config.max_pack, config.hang_timeout) == (4, 3.0)
    assert CoordinatorConfig.from_env(max_pack=2).max_pack == 2
    with pytest.raises(ValueError, match="Received: KERAS_PS_MAX_PACK=0"):
        monkeypatch.setenv("KERAS_PS_MAX_PACK", "0")
        CoordinatorConfig.from_env()
    with pytest.raises(ValueError, match="probe_timeout=0"):
        CoordinatorConfig(probe_timeout=0)
    # Shorter than a healthy worker takes to answer on a loaded machine.
    with pytest.raises(ValueError, match=r"at least 0.1 s.*never re-admitted"
                       r".*probe_timeout=0.01\. Leave it unset"):
        CoordinatorConfig(probe_timeout=0.01)
    assert CoordinatorConfig(probe_timeout=0.1).probe_timeout == 0.1


def test_idle_take_returns_when_its_worker_stops_being_runnable():
    """A worker thread waiting for closures must notice that its worker was
    marked failed from elsewhere (a dataset it could not make), so it goes
    on to recover it instead of waiting for the next closure."""
    queue = ClosureQueue()
    failed = threading.Event()
    got = []
    taker = threading.Thread(target=lambda: got.append(
        queue.take(8, 1, interrupted=failed.is_set)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()  # nothing to take, still runnable: it waits
    failed.set()
    queue.wake()
    taker.join(10)
    assert not taker.is_alive() and got == [[]]
    # Work queued meanwhile is still handed out when it asks again.
    queue.put(Closure(lambda: None, (), {}, per_worker=False))
    assert len(queue.take(8, 1, interrupted=failed.is_set)) == 1


class _CallingWorker:
    """A worker whose one call (of `fn`, `closures` closures) has run `age`
    seconds, at a real address; `per_closure`: its longest finished call of
    `fn` per closure (None: none finished)."""

    def __init__(self, index, address, age, fn=None, closures=1,
                 per_closure=None, tracing=False):
        self.index, self.address, self.age = index, address, age
        self.fn, self.closures, self.per_closure = fn, closures, per_closure
        self.tracing = tracing  # the call is still in its trace
        self.abandoned = []  # (reason, state)
        self.state = WorkerState.HEALTHY

    def in_flight_call(self):
        batch = [Closure(self.fn, (), {}, False) for _ in range(self.closures)]
        return types.SimpleNamespace(batch=batch, tracing=self.tracing,
                                     started=time.monotonic() - self.age)

    def seconds_per_closure(self, fn):
        return self.per_closure if fn is self.fn else None

    def abandon_in_flight(self, reason, state, call):
        self.abandoned.append((reason, state))


def test_hang_watchdog_gives_up_silent_workers_and_logs_stuck_calls(caplog):
    # Real probes: a gRPC server answers at one address; nothing listens at
    # the other. The silent worker's call is given up; the answering one's is
    # waited for, and logged once it is long, again at each doubling.
    import grpc
    import portpicker

    from keras_ps.coordinator.config import CoordinatorConfig

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("localhost:0")
    server.start()
    try:
        answering = _CallingWorker(0, f"localhost:{port}", 5.0)
        silent = _CallingWorker(
            1, f"localhost:{portpicker.pick_unused_port()}", 5.0)
        watcher = watchdog.HangWatchdog(
            lambda: [answering, silent],
            CoordinatorConfig(hang_timeout=2.0, probe_timeout=2.0))
        stuck = watchdog.STUCK_WARNING_S
        logged = []
        for age in (5.0, stuck - 1, stuck + 1, stuck + 5, 2 * stuck + 3,
                    3.0, stuck + 1):
            answering.age = age
            caplog.clear()
            with caplog.at_level("WARNING", logger=watchdog.__name__):
                watcher.check()
            logged.append(any(f"[worker:0] a call has run {age:.0f}s" in m
                              and "restarting its process" in m
                              for m in caplog.messages))
        # Logged past the threshold, again at twice that age, and for a
        # later call (its age started over) past the threshold again.
        assert logged == [False, False, True, False, True, False, True]
        assert answering.abandoned == []
        assert len(silent.abandoned) == 7
        reason, state = silent.abandoned[0]
        assert "does not answer" in reason and state is WorkerState.HUNG
    finally:
        server.stop(0)


def test_stuck_after_compares_a_call_with_finished_calls_of_its_function():
    from keras_ps import _constants
    floor, factor = _constants.STUCK_FLOOR_S, _constants.STUCK_FACTOR
    stuck_after = watchdog.stuck_after
    # Auto: never before a call of the function finished (a first call may
    # be long); then FACTOR times the longest per closure, times the
    # closures of this call, and at least the floor.
    assert stuck_after(None, None, 4) is None
    assert stuck_after(None, 0.01, 4) == floor
    assert stuck_after(None, 10.0, 4) == factor * 10.0 * 4
    # A setting wins over what was seen; 0 is never.
    assert stuck_after(30.0, None, 4) == 30.0
    assert stuck_after(30.0, 10.0, 4) == 30.0
    assert stuck_after(0.0, 10.0, 4) is None


def test_hang_watchdog_gives_up_a_stuck_call_on_a_worker_that_answers(caplog):
    # Real probes: both workers answer at a real gRPC server. Worker 1's call
    # of `step` has run far longer than worker 0's finished calls of it: it
    # is given up as stuck, but not while a ps does not answer, and not a
    # call of a function with no finished call yet.
    import grpc

    from keras_ps.coordinator.config import CoordinatorConfig

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("localhost:0")
    server.start()
    address = f"localhost:{port}"
    step = object()
    try:
        fast = _CallingWorker(0, address, 0.0, fn=step, per_closure=0.5)
        stuck = _CallingWorker(1, address, 0.0, fn=step, closures=2)
        dead_ps = {}
        watcher = watchdog.HangWatchdog(
            lambda: [fast, stuck], CoordinatorConfig(hang_timeout=2.0),
            lambda: dict(dead_ps))
        limit = watchdog.stuck_after(None, 0.5, 2)  # the floor here
        stuck.age = limit - 1
        with caplog.at_level("WARNING", logger=watchdog.__name__):
            watcher.check()
        assert stuck.abandoned == []
        assert any(f"gives it up as stuck at {limit:.0f}s" in m
                   for m in caplog.messages)
        stuck.age = limit + 1
        dead_ps[0] = "localhost:1"
        watcher.check()
        assert stuck.abandoned == []  # a silent ps holds every call
        dead_ps.clear()
        watcher.check()
        assert [state for _, state in stuck.abandoned] == [WorkerState.STUCK]
        assert f"(limit {limit:.0f}s)" in stuck.abandoned[0][0]
        assert fast.abandoned == []
        # A function no call of which finished: waited for, and the log
        # says how to bound it.
        stuck.fn, fast.fn = object(), object()
        stuck.age = 10 * limit
        caplog.clear()
        with caplog.at_level("WARNING", logger=watchdog.__name__):
            watcher.check()
        assert len(stuck.abandoned) == 1
        assert any("no call of this function has finished yet" in m
                   for m in caplog.messages)
        # A setting bounds it.
        watcher = watchdog.HangWatchdog(
            lambda: [fast, stuck],
            CoordinatorConfig(hang_timeout=2.0, stuck_timeout=5.0))
        stuck.age = 6.0
        watcher.check()
        assert [state for _, state in stuck.abandoned][-1] is WorkerState.STUCK
        assert len(stuck.abandoned) == 2
    finally:
        server.stop(0)


class _Queue:
    """Records what the watchdog fails the job with."""

    def __init__(self):
        self.fatal = []

    def mark_fatal(self, count, error):
        self.fatal.append(error)


def test_hang_watchdog_names_a_silent_ps_and_gives_it_up_past_the_timeout(
        caplog):
    # Real probes: the worker answers at a real gRPC server; nothing listens
    # at the ps' address. The calls that wait for the ps are not the
    # worker's fault: the ps is named instead (at first, then at each
    # doubling of its silence), and given up as lost past
    # ps_recovery_timeout, failing the job with an error naming it.
    import grpc
    import portpicker

    from keras_ps.coordinator.config import CoordinatorConfig

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("localhost:0")
    server.start()
    ps_address = f"localhost:{portpicker.pick_unused_port()}"
    silent = {0: ps_address}
    try:
        step = object()
        worker = _CallingWorker(0, f"localhost:{port}", 5.0, fn=step,
                                per_closure=0.01)
        queue = _Queue()
        config = CoordinatorConfig(hang_timeout=2.0, ps_recovery_timeout=30.0)
        class Strategy:  # what fit marks under way
            pass
        strategy = Strategy()
        watcher = watchdog.HangWatchdog(
            lambda: [worker], config, lambda: dict(silent), queue,
            silent_ps=lambda: dict(silent),
            watched=lambda: watchdog.call_under_way(strategy))
        with caplog.at_level("WARNING", logger=watchdog.__name__):
            watcher.check()
            named = [m for m in caplog.messages if m.startswith("[chief] ps 0")]
            assert len(named) == 1 and f"ps 0 at {ps_address} has not " \
                "answered for 5s" in named[0], caplog.messages
            assert "KERAS_PS_PS_RECOVERY_TIMEOUT=30s" in named[0]
            # Past its stuck limit, the worker's call is still not given up
            # or blamed while the ps is silent.
            assert worker.abandoned == [] and queue.fatal == []
            assert not any(m.startswith("[worker:") for m in caplog.messages)
            caplog.clear()
            watcher.check()  # not logged again until its silence doubles
            assert caplog.messages == []
            # It answers again: logged, and forgotten.
            silent.clear()
            watcher.check()
            assert any("ps 0 answers again" in m for m in caplog.messages)
            # Within a fit call the ps are watched with no call waiting; one
            # silent for less than the hang timeout (a ps restarted at once
            # by its restart policy) and back: nothing said either way.
            caplog.clear()
            worker.age = 0.0
            with watchdog.ps_watched(strategy):
                silent[0] = ps_address
                watcher.check()
                assert list(watcher._silent_since) == [0]  # seen, not said
                silent.clear()
                watcher.check()
            assert caplog.messages == [] and watcher._silent_since == {}
            # A fit on another strategy (a later cluster of this process)
            # does not have this coordinator watch its own, gone, ps.
            with watchdog.ps_watched(Strategy()):
                silent[0] = ps_address
                watcher.check()
                assert watcher._silent_since == {}
            # Silent again, with calls that waited past the timeout: given up.
            silent[0] = ps_address
            worker.age = 31.0
            watcher.check()
        [error] = queue.fatal
        assert isinstance(error, errors.ParameterServerUnavailableError)
        assert f"Parameter server 0 at {ps_address} has not answered for 31s" \
            in str(error)
        assert "KERAS_PS_PS_RECOVERY_TIMEOUT" in str(error)
        assert worker.abandoned == []
    finally:
        server.stop(0)


def test_a_call_in_its_trace_is_not_stuck_on_its_worker(caplog):
    # Real probes at a real gRPC server. A trace waits while TF registers a
    # new function on every worker, a hung one too: on a worker that
    # answers, that wait is not a call stuck there (giving it up would
    # blame a healthy worker), and the log says what it waits for. On a
    # worker that does not answer, it is given up as hung like any call.
    import grpc
    import portpicker

    from keras_ps.coordinator.config import CoordinatorConfig

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("localhost:0")
    server.start()
    step = object()
    try:
        limit = watchdog.stuck_after(None, 0.5, 1)
        waiting = _CallingWorker(0, f"localhost:{port}", 10 * limit, fn=step,
                                 per_closure=0.5, tracing=True)
        silent = _CallingWorker(1, f"localhost:{portpicker.pick_unused_port()}",
                                5.0, fn=step, tracing=True)
        watcher = watchdog.HangWatchdog(lambda: [waiting, silent],
                                        CoordinatorConfig(hang_timeout=2.0))
        with caplog.at_level("WARNING", logger=watchdog.__name__):
            watcher.check()
        assert waiting.abandoned == []
        assert any(f"[worker:0] a new function has waited {10 * limit:.0f}s"
                   in m and "one does not answer" in m for m in caplog.messages)
        assert [state for _, state in silent.abandoned] == [WorkerState.HUNG]
        # Its trace done, the same call that long is given up as stuck.
        waiting.tracing = False
        watcher.check()
        assert [state for _, state in waiting.abandoned] == [WorkerState.STUCK]
    finally:
        server.stop(0)


class _IdleWorker:
    """A worker with no call, at a real address; records its moves."""

    def __init__(self, index, address):
        self.index, self.address = index, address
        self.state = WorkerState.HEALTHY
        self.moves = []

    def in_flight_call(self):
        return None

    def transition(self, state, reason):
        self.moves.append((state, reason))
        self.state = state


class _Packing:
    def __init__(self, fallback):
        self.fallback = fallback

    def has_fallback(self, fn):
        return self.fallback


@pytest.mark.parametrize("fallback", [True, False])
def test_a_trace_waiting_for_an_idle_silent_worker_sets_it_aside(fallback):
    # A trace waits for every worker; an idle worker that does not answer
    # has no call to age, so only the waiting trace shows it. It is set
    # aside as hung; the waiting call is given up too when its closures can
    # run elsewhere without a new trace (else nothing could run them).
    import grpc
    import portpicker

    from keras_ps.coordinator.config import CoordinatorConfig

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("localhost:0")
    server.start()
    try:
        waiting = _CallingWorker(0, f"localhost:{port}", 5.0, tracing=True)
        silent = _IdleWorker(1, f"localhost:{portpicker.pick_unused_port()}")
        answering = _IdleWorker(2, f"localhost:{port}")
        watcher = watchdog.HangWatchdog(
            lambda: [waiting, silent, answering],
            CoordinatorConfig(hang_timeout=2.0, probe_timeout=2.0),
            packing=_Packing(fallback))
        watcher.check()
        assert [state for state, _ in silent.moves] == [WorkerState.HUNG]
        assert "worker 0's trace has waited 5s for it" in silent.moves[0][1]
        assert answering.moves == []
        if fallback:
            assert [state for _, state in waiting.abandoned] == \
                [WorkerState.HUNG]
            assert "waited 5s for workers [1]" in waiting.abandoned[0][0]
        else:
            assert waiting.abandoned == []
        # A trace that waits while every other worker answers is left alone.
        quiet = watchdog.HangWatchdog(
            lambda: [waiting, answering],
            CoordinatorConfig(hang_timeout=2.0, probe_timeout=2.0),
            packing=_Packing(True))
        waiting.abandoned.clear()
        quiet.check()
        assert waiting.abandoned == [] and answering.moves == []
    finally:
        server.stop(0)


class _StateKeepingWorker(_CallingWorker):
    """A _CallingWorker with a state: a call given up leaves no call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state = WorkerState.HEALTHY

    def in_flight_call(self):
        if self.state is not WorkerState.HEALTHY:
            return None
        return super().in_flight_call()

    def abandon_in_flight(self, reason, state, call):
        super().abandon_in_flight(reason, state, call)
        self.state = state


def test_every_worker_stuck_fails_the_job_naming_each_call():
    # Real probes at a real gRPC server. Stuck workers come back only when
    # their calls return: once every member is stuck, the job fails. A
    # failed worker (which a restart brings back) or none stuck: it waits.
    import grpc

    from keras_ps.coordinator.config import CoordinatorConfig

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("localhost:0")
    server.start()
    address = f"localhost:{port}"

    def read_forever():
        pass

    try:
        queue = ClosureQueue()
        waiting = _closures(read_forever, 1)[0]
        queue.put(waiting)
        workers = [_StateKeepingWorker(i, address, 1.0, fn=read_forever)
                   for i in range(3)]
        watcher = watchdog.HangWatchdog(
            lambda: list(workers),
            CoordinatorConfig(hang_timeout=0.5, stuck_timeout=5.0),
            queue=queue)
        workers[2].state = WorkerState.LEFT  # not a member: not counted
        workers[0].age = 6.0
        watcher.check()
        assert [w.state for w in workers[:2]] == [WorkerState.STUCK,
                                                  WorkerState.HEALTHY]
        assert not queue.done()  # worker 1 trains on
        workers[1].state = WorkerState.FAILED
        watcher.check()
        assert not queue.done()  # a failed worker may be restarted
        workers[1].state = WorkerState.HEALTHY
        workers[1].age = 7.0
        watcher.check()
        with pytest.raises(StuckCallError) as raised:
            queue.done()
        message = str(raised.value)
        assert message.startswith(
            "Every worker has a call given up as stuck, so none is left to "
            "train (worker 0: a call of read_forever ran 6s (limit 5s) on a "
            "worker that answers; worker 1: a call of read_forever ran 7s "
            "(limit 5s) on a worker that answers;")
        assert "worker 2" not in message
        assert "KERAS_PS_STUCK_TIMEOUT" in message
        with pytest.raises(tf.errors.CancelledError):
            waiting.remote_value.fetch(timeout=1)
        # Whatever leaves the stuck ones alone fails the work queued later
        # too, at the next look: here the other worker leaving the cluster.
        assert queue.clear_after_fatal(timeout=1)
        queue.put(_closures(read_forever, 1)[0])
        workers[1].state, workers[1].age = WorkerState.HEALTHY, 0.0
        watcher.check()
        assert not queue.done()
        workers[1].state = WorkerState.LEFT
        watcher.check()
        with pytest.raises(StuckCallError, match=r"^Every worker has a call "
                           r"given up as stuck, so none is left to train "
                           r"\(worker 0: a call of read_forever ran 6s"):
            queue.done()
    finally:
        server.stop(0)


def test_the_watchdog_thread_outlives_a_failed_check(caplog):
    # Its thread, for real: the first look fails (here the workers cannot
    # be listed), is logged, and the next looks go on.
    from keras_ps.coordinator.config import CoordinatorConfig

    looks = []
    looked_again = threading.Event()

    def workers():
        looks.append(time.monotonic())
        if len(looks) == 1:
            raise RuntimeError("no list this time")
        if len(looks) >= 3:
            looked_again.set()
        return []

    watcher = watchdog.HangWatchdog(workers, CoordinatorConfig(hang_timeout=0.2))
    with caplog.at_level("ERROR", logger=watchdog.__name__):
        watcher.start()
        try:
            assert looked_again.wait(30)
        finally:
            watcher.stop()
    assert any("the hang watchdog's check failed" in r.getMessage()
               and r.exc_info and "no list this time" in str(r.exc_info[1])
               for r in caplog.records)


class _Hold:
    def release_early(self):
        pass


def _worker_running(queue, index, batch):
    """A real Worker whose call of `batch` is in flight."""
    from keras_ps.coordinator import worker as worker_lib
    services = types.SimpleNamespace(queue=queue)
    worker = worker_lib.Worker(services, index, f"localhost:{index + 1}")
    call = worker_lib.Call(batch)
    call.gate_hold = _Hold()
    worker._in_flight = call
    return worker, call


def test_a_closure_stuck_on_two_workers_fails_the_job_naming_it():
    queue = ClosureQueue()
    def read_forever():
        pass
    closures = _closures(read_forever, 2)
    for c in closures:
        queue.put(c)
    batch = queue.take(max_pack=2, num_takers=1)
    first, call = _worker_running(queue, 0, batch)
    first.abandon_in_flight("ran 200s", WorkerState.STUCK, call)
    assert first.state is WorkerState.STUCK
    # Requeued for the other workers; the call, if it returns, is dropped.
    assert queue.take(max_pack=2, num_takers=1) == closures
    assert not first._finish_call(call)
    # A call given up already is not given up again, nor a later one.
    first.abandon_in_flight("again", WorkerState.STUCK, call)
    second, call = _worker_running(queue, 1, closures)
    second.abandon_in_flight("ran 300s", WorkerState.STUCK, object())
    assert second.state is WorkerState.HEALTHY
    second.abandon_in_flight("ran 300s", WorkerState.STUCK, call)
    assert second.state is WorkerState.STUCK
    with pytest.raises(StuckCallError) as raised:
        queue.done()
    message = str(raised.value)
    assert "read_forever" in message and "workers [0, 1]" in message
    assert "ran 300s" in message and "KERAS_PS_STUCK_TIMEOUT" in message
    assert isinstance(raised.value, tf.errors.DeadlineExceededError)
    with pytest.raises(StuckCallError):
        closures[1].remote_value.fetch(timeout=1)


# -- where a lost ps answers again (ps_addresses) -------------------------------
class _Resolver(tf.distribute.cluster_resolver.ClusterResolver):
    def __init__(self, spec=None, error=None):
        self.spec, self.error = spec, error

    def cluster_spec(self):
        if self.error is not None:
            raise self.error
        return tf.train.ClusterSpec(self.spec)

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        return ""


@pytest.fixture
def grpc_server():
    import grpc
    import portpicker

    port = portpicker.pick_unused_port()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    server.add_insecure_port(f"localhost:{port}")
    server.start()
    yield f"localhost:{port}"
    server.stop(None)


def test_a_lost_ps_is_waited_for_where_the_resolver_names_it(grpc_server):
    import portpicker

    gone = f"localhost:{portpicker.pick_unused_port()}"  # nothing listens
    spec = {"ps": [grpc_server], "worker": ["localhost:1"]}
    deadline = time.monotonic() + 5
    assert ps_addresses.wait_for_ps(_Resolver(spec), 0, gone,
                                    deadline) == grpc_server
    # A resolver that fails, or names the lost address, leaves its address.
    for resolver in (_Resolver(error=RuntimeError("platform API down")),
                     _Resolver({"ps": [gone], "worker": ["localhost:1"]})):
        assert ps_addresses.wait_for_ps(resolver, 0, grpc_server,
                                        deadline) == grpc_server
        assert ps_addresses.wait_for_ps(
            resolver, 0, gone, time.monotonic() + 0.5) is None


def test_a_resolver_that_fails_or_watches_membership_names_no_ps(caplog):
    with caplog.at_level("INFO", logger="keras_ps.coordinator.ps_addresses"):
        assert ps_addresses.resolved_address(
            _Resolver(error=RuntimeError("platform API down")), 0) is None
    assert "named no address for ps 0 (RuntimeError: platform API down)" \
        in caplog.text
    # A membership watcher's cluster_spec() may wait for workers: it is
    # not asked. (This one would raise if asked: that would be logged.) It
    # names no ps unless it learns of ps moves (ps_address).
    caplog.clear()

    class Watcher(cluster_lib.MembershipWatcher, _Resolver):
        def watch(self, callback):
            raise AssertionError("not to be watched")

    watcher = Watcher(error=AssertionError("cluster_spec() asked"))
    with caplog.at_level("INFO", logger="keras_ps.coordinator.ps_addresses"):
        assert ps_addresses.resolved_address(watcher, 0) is None
    assert caplog.text == ""


def test_an_elastic_resolver_names_the_address_a_ps_announced(grpc_server):
    # ElasticClusterResolver is asked for the ps' announcements only: no
    # worker ever joins its rendezvous, so its cluster_spec() would fail.
    import portpicker
    from keras_ps.elastic import RendezvousClient
    from keras_ps.elastic import RendezvousConfig
    from keras_ps.elastic import RendezvousServer
    from keras_ps.elastic.resolver import ElasticClusterResolver

    gone = f"localhost:{portpicker.pick_unused_port()}"  # nothing listens
    rendezvous = RendezvousServer(RendezvousConfig(keepalive_timeout=3))
    endpoint = f"127.0.0.1:{rendezvous.start()}"
    resolver = ElasticClusterResolver(endpoint, ps=[gone, "localhost:2"],
                                      startup_timeout=0.5)
    ps = RendezvousClient(endpoint)
    try:
        assert ps_addresses.resolved_address(resolver, 0) == gone
        assert ps_addresses.wait_for_ps(
            resolver, 0, gone, time.monotonic() + 0.5) is None
        ps.announce_ps(0, grpc_server, "the-new-ps-0")
        assert ps_addresses.wait_for_ps(
            resolver, 0, gone, time.monotonic() + 5) == grpc_server
        assert resolver.ps_address(1) == "localhost:2"
        # Unrenewed, the announcement lapses; the resolver keeps the
        # address it learnt.
        wait_until(lambda: ps.list_members().ps == (), 30,
                   "the announcement to lapse")
        assert resolver.ps_address(0) == grpc_server
    finally:
        ps.close()
        resolver.close()
        rendezvous.stop(0)
