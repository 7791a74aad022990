"""Each public name imports in a fresh process; each TF internal we use exists."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_public_names_import_in_fresh_process():
    code = (
        "import keras_ps, keras_ps.partitioners, keras_ps.coordinator, keras_ps.callbacks, keras_ps.elastic, keras_ps.shards\n"
        "assert keras_ps.optimizers.LazyAdam is not None\n"
        "for mod in (keras_ps, keras_ps.partitioners, keras_ps.coordinator, keras_ps.callbacks, keras_ps.elastic, keras_ps.shards):\n"
        "    for name in mod.__all__:\n"
        "        assert getattr(mod, name) is not None, (mod, name)\n"
        "print('ok', len(keras_ps.__all__))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, timeout=100)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_tf_internals_still_exist(tmp_path):
    """Fails loudly when a TF upgrade moves an internal keras_ps relies on."""
    from keras_ps import _tf_adapter
    from keras_ps import _exit_guard
    import tensorflow as tf

    for hook in _tf_adapter.STRATEGY_HOOKS:
        assert hasattr(tf.compat.v1.distribute.StrategyExtended, hook), hook
    assert hasattr(tf.compat.v1.distribute.StrategyExtended, "call_for_each_replica")
    @tf.function
    def f():
        return _tf_adapter.capture_call_time_value(
            lambda: tf.constant(7, tf.int64), tf.TensorSpec([], tf.int64), "k")

    assert f().numpy() == 7
    assert callable(_tf_adapter.update_server_def)
    assert callable(_tf_adapter._internals().pywrap_tfe
                    .TFE_ContextSetRunEagerOpAsFunction)
    assert callable(_tf_adapter.get_server_def)
    # TF's C function, called without the GIL: its library loads, and the
    # address read from a function's Python wrapper names that function.
    assert _tf_adapter.register_functions_without_the_gil(
        _exit_guard.tf_section) is True
    with _tf_adapter.own_executor():
        assert tf.add(1, 2).numpy() == 3
    executor = _tf_adapter.new_executor()
    with _tf_adapter.executor_scope(executor):
        total = tf.add(1, 2)
    executor.wait()
    assert total.numpy() == 3
    _tf_adapter.clear_executor_error(executor)
    assert _tf_adapter.inside_function() is False
    # A gradient given by hand: the op made inside stop_recording has none
    # of its own; the recorded one's is the given function.
    x = tf.constant(2.0)
    with tf.GradientTape() as tape:
        tape.watch(x)
        with _tf_adapter.stop_recording():
            y = x * 3.0
        _tf_adapter.record_operation("Test", [y], [x], lambda dy: [dy * 5.0])
    assert tape.gradient(y, x).numpy() == 5.0
    # A restore leaves the value of a list entry not made yet waiting on the
    # list, by index; it fills the variable given for that index later.
    saved = tf.Module()
    saved.values = [tf.Variable(3.0)]
    path = tf.train.Checkpoint(m=saved).write(str(tmp_path / "ckpt"))
    fresh = tf.Module()
    fresh.values = []
    tf.train.Checkpoint(m=fresh).read(path)
    assert list(_tf_adapter.waiting_restorations(fresh.values)) == ["0"]
    later = tf.Variable(0.0)
    _tf_adapter.restore_waiting(fresh.values, "0", later)
    assert later.numpy() == 3.0
    assert not _tf_adapter.waiting_restorations(fresh.values)


def _retracing_warnings(make, caplog):
    """TF's "triggered tf.function retracing" warnings while 7 functions
    made by `make` from one Python function are each traced once."""
    import logging

    import tensorflow as tf

    def add_one(x):
        return x + 1

    caplog.set_level(logging.WARNING, logger="tensorflow")
    caplog.clear()
    for i in range(7):
        assert make(tf.function(add_one))(tf.constant(i)).numpy() == i + 1
    return [r for r in caplog.records if "retracing" in r.getMessage()]


def test_functions_traced_once_each_do_not_warn_of_retracing(caplog):
    """keras_ps makes a tf.function per fit call's dataset and per backup
    group from one Python function; TF would warn the user to stop creating
    tf.functions in a loop. The control (untagged) shows the warning is
    real, so a TF upgrade that renames the attribute fails here."""
    from keras_ps import _tf_adapter

    assert _retracing_warnings(lambda function: function, caplog), (
        "TF no longer warns of one Python function traced 7 times")
    assert _retracing_warnings(_tf_adapter.traced_once_each, caplog) == []


def test_tf_internals_of_ps_recovery_still_exist():
    """A variable given a new resource in place, and traced functions that
    captured the old one fed the new one (without a new trace) or traced
    again: what a ps recovery relies on."""
    from keras_ps import _tf_adapter
    import tensorflow as tf

    with tf.variable_creator_scope(lambda next_creator, **kw: 1 / 0):
        # Past every creator in scope (this one would fail).
        variable = _tf_adapter.plain_variable(initial_value=1.0)
    other = _tf_adapter.plain_variable(initial_value=10.0)
    traces = []

    @tf.function
    def read():
        traces.append(1)
        return variable.read_value() + other.read_value()

    assert read().numpy() == 11.0
    old = _tf_adapter.rebind_variable(
        variable, _tf_adapter.plain_variable(initial_value=5.0))
    assert variable.numpy() == 5.0
    assert read().numpy() == 11.0  # the trace still holds the old resource
    assert _tf_adapter.rebind_captures({id(old): (old, variable.handle)}) >= 1
    assert read().numpy() == 15.0 and len(traces) == 1
    # The graph's record of its captures names the new handle (a SavedModel
    # of the function maps captures to variables by it).
    [trace] = read._list_all_concrete_functions()
    assert [id(e) for e, _ in trace.graph.captures] == [
        id(variable.handle), id(other.handle)]
    variable.assign_add(1.0)
    assert read().numpy() == 16.0
    _tf_adapter.rebind_variable(
        variable, _tf_adapter.plain_variable(initial_value=2.0))
    assert _tf_adapter.retrace_all_functions() >= 1
    assert read().numpy() == 12.0 and len(traces) == 2


def test_tf_internals_of_step_order_still_exist():
    """What keras_ps.shards.step_order asks of automatic control
    dependencies: an op's resource inputs (read or written), whether an op is
    chained as stateful, an op kept out of the chain, a control input added
    to an op already made."""
    from keras_ps import _tf_adapter
    import tensorflow as tf

    variable = tf.Variable(1.0)
    seen = {}

    @tf.function
    def f():
        read = variable.read_value()
        write = variable.assign_add(1.0)
        seen["read"] = _tf_adapter.resource_inputs(read.op.inputs[0].op)
        seen["write"] = _tf_adapter.resource_inputs(write.op)
        seen["stateful"] = _tf_adapter.op_is_stateful(write.op)
        with tf.control_dependencies(None):
            gate = tf.raw_ops.Assert(condition=tf.constant(True),
                                     data=[tf.constant(1)])
        _tf_adapter.run_independently(gate)
        _tf_adapter.add_control_input(write.op, gate)
        seen["controls"] = list(write.op.control_inputs)
        seen["gate"] = gate
        return write

    f()
    assert [read_only for _, read_only in seen["read"]] == [True]
    assert [read_only for _, read_only in seen["write"]] == [False]
    assert seen["stateful"] is True
    assert seen["gate"] in seen["controls"]


def test_every_error_class_is_a_picklable_keras_ps_error():
    import inspect
    import pickle

    import keras_ps
    from keras_ps import elastic
    from keras_ps import errors
    from keras_ps.sidecar import evaluator

    found = []
    for module in (errors, elastic.api, evaluator):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (issubclass(cls, BaseException) and cls.__name__[0] != "_" and
                    cls.__module__.startswith("keras_ps")):
                found.append(cls)
    assert len(found) >= 15, found
    for cls in found:
        assert issubclass(cls, keras_ps.KerasPSError), cls
        error = cls("what went wrong")
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is cls and "what went wrong" in str(again)


def test_setup_cfg_lists_every_package():
    # A regular (non-editable) install, as the Docker image makes, installs
    # only the packages setup.cfg lists.
    import configparser
    import os

    from _paths import REPO

    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    listed = set(config["options"]["packages"].split())
    found = {os.path.relpath(root, REPO).replace(os.sep, ".")
             for root, _, files in os.walk(os.path.join(REPO, "keras_ps"))
             if "__init__.py" in files}
    assert found <= listed, sorted(found - listed)
    assert "keras_ps.callbacks" in listed


def _documented_imports():
    """`import keras_ps...` and `from keras_ps... import ...` lines of the
    README, docs/*.md and tutorials/*, as written (one line each)."""
    import glob
    import os
    import re

    from _paths import REPO

    paths = ([os.path.join(REPO, "README.md")]
             + glob.glob(os.path.join(REPO, "docs", "*.md"))
             + glob.glob(os.path.join(REPO, "tutorials", "*")))
    pattern = re.compile(
        r"^\s*((?:from keras_ps[\w.]* import [\w, ]+)|"
        r"(?:import (?:[\w.]+(?: as \w+)?, )*keras_ps[\w.]*(?: as \w+)?"
        r"(?:, [\w.]+(?: as \w+)?)*))\s*(?:#.*)?$", re.M)
    found = set()
    for path in filter(os.path.isfile, paths):
        with open(path) as f:
            found.update(m.group(1).strip() for m in pattern.finditer(f.read()))
    return sorted(found)


def test_every_documented_import_works_in_a_fresh_process():
    lines = _documented_imports()
    assert len(lines) >= 5, lines
    code = "".join(
        f"try:\n    {line}\nexcept Exception as e:\n"
        f"    failures.append(({line!r}, repr(e)))\n" for line in lines)
    result = subprocess.run(
        [sys.executable, "-c", "failures = []\n" + code + "print(failures)"],
        capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", (lines, result.stdout)
