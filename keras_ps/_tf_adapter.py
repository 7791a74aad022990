"""Every use of TensorFlow internals (`tensorflow.python...`) in keras_ps.

TF 2.21 has no public API for these; each function says which one is missing.
tests/api/test_public_api.py (test_tf_internals_still_exist) exercises each so
a TF upgrade that moves them fails loudly there, not deep inside training.
Supported range: see setup.cfg.
"""

import ctypes
import functools
import importlib.util
import sys
import types
import weakref

# Imported on first use (see _internals), so that `server_modules` can run in
# a process that has not imported TensorFlow yet.

# Strategy plumbing: `tf.distribute.Strategy`/`StrategyExtended` are public
# classes, but the hooks a new strategy must override (`_create_variable`,
# `_update`, `_reduce_to`, `_call_for_each_replica`, ...) are their private
# methods. keras_ps/strategy/strategy.py overrides them; this test pins they exist.
STRATEGY_HOOKS = (
    "_create_variable", "_update", "_update_non_slot", "_reduce_to",
    "_gather_to_implementation", "_call_for_each_replica", "_local_results",
    "_use_merge_call", "_experimental_distribute_dataset",
    "_distribute_datasets_from_function",
    "_experimental_distribute_values_from_function", "_num_replicas_in_sync",
)

# ShardedVariable: `tf.__internal__.tracking.Trackable` and
# `tf.__internal__.CompositeTensor` are exported, but how an object saves
# itself is their private methods. keras_ps/tables/sharded_variable.py overrides
# these (a checkpoint, and a SavedModel, hold one full tensor);
# tests/sharding/test_tf_compat_sharded_variable.py pins they exist.
TRACKABLE_HOOKS = (
    "_serialize_to_tensors", "_restore_from_tensors", "_trackable_children",
    "_export_to_saved_model_graph",
)
# ShardedVariableSpec: the methods a `tf.TypeSpec` subclass must define.
TYPE_SPEC_HOOKS = ("_serialize", "_component_specs", "_to_components",
                   "_from_components")


@functools.lru_cache(maxsize=None)
def _internals():
    from tensorflow.python.eager import cancellation
    from tensorflow.python.eager import context
    from tensorflow.python.eager import executor
    from tensorflow.python.framework import ops
    from tensorflow.python import pywrap_tfe

    return types.SimpleNamespace(cancellation=cancellation, context=context,
                                 executor=executor, ops=ops, pywrap_tfe=pywrap_tfe)


def server_modules():
    """(server_lib, config_pb2): `tf.distribute.Server`'s module and TF's
    ConfigProto's, for a process that only serves. Missing public API: only
    `import tensorflow` reaches them, loading TF's whole Python API and Keras
    (2.3 s here). When TF is not imported yet, its package `__init__` is
    skipped for this import (a bare package stands in, then is removed): a
    task serves 0.4 s after it starts instead of 2.2 s, a joining or
    restarted worker steps that much sooner. Falls back to the full import."""
    stub = None
    if "tensorflow" not in sys.modules:
        spec = importlib.util.find_spec("tensorflow")
        stub = types.ModuleType("tensorflow")
        stub.__path__ = list(spec.submodule_search_locations)
        sys.modules["tensorflow"] = stub
    try:
        from tensorflow.core.protobuf import config_pb2
        from tensorflow.python.training import server_lib
    except Exception:
        if stub is None:
            raise
        for name in [n for n in sys.modules if n.startswith("tensorflow.")]:
            del sys.modules[name]
        del sys.modules["tensorflow"]
        stub = None
        import tensorflow  # noqa: F401  (the full import, then the same modules)
        from tensorflow.core.protobuf import config_pb2
        from tensorflow.python.training import server_lib
    finally:
        if stub is not None and sys.modules.get("tensorflow") is stub:
            del sys.modules["tensorflow"]
    return server_lib, config_pb2


def device_attributes(serialized):
    """The DeviceAttributes proto (a device of a task's GetStatus answer) in
    `serialized`: its `name` (the task's job, as the task was started) and
    `incarnation` (drawn anew each time the task's process starts). No
    public API describes a remote task's devices."""
    from tensorflow.core.framework import device_attributes_pb2
    return device_attributes_pb2.DeviceAttributes.FromString(serialized)


def update_server_def(server_def):
    """Pushes a new cluster to every task without restarting anyone. Public
    `tf.config.experimental_connect_to_cluster` only creates contexts;
    updating membership in place needs `context.update_server_def`."""
    _internals().context.context().update_server_def(server_def)


def eager_ops_as_plain_ops():
    """Has this process run its eager ops as plain ops, called after each
    connection. TF 2.21 wraps each eager op of a new kind in a function and
    registers it on every task with a synchronous RPC holding the GIL: a new
    `tf.unstack` size or metric shape froze the whole coordinator while a
    worker was stopped (SIGSTOP, a hung host). Plain ops are registered
    nowhere. Missing public API: no switch for the wrapping."""
    internals = _internals()
    context = internals.context.context()
    context.ensure_initialized()
    internals.pywrap_tfe.TFE_ContextSetRunEagerOpAsFunction(
        context._handle, False)


def register_functions_without_the_gil(section):
    """Has TF register each new function on the tasks without the GIL. TF
    2.21 does it with a synchronous RPC holding the GIL: a worker stopped
    during a trace froze every thread (the watchdog, the other workers'
    dispatch). The same C function through ctypes holds only the tracing
    thread. Missing public API: no switch. `section()` is entered around
    each call (the exit waits for it). Returns whether it is on (off: TF's C
    library or wrapper layout is unreadable)."""
    context_class, c_api = _internals().context.Context, _c_api()
    if c_api is not None and context_class.add_c_function.__module__ != __name__:
        def add_c_function(context, c_func):
            context.ensure_initialized()
            status = c_api.TF_NewStatus()
            try:
                with section():
                    c_api.TFE_ContextAddFunction(
                        _CAPSULE_POINTER(context._handle, None),
                        _pybind_pointer(c_func), status)
                if code := c_api.TF_GetCode(status):
                    from tensorflow.python.framework import errors_impl
                    raise errors_impl.exception_type_from_error_code(code)(
                        None, None, c_api.TF_Message(status).decode())
            finally:
                c_api.TF_DeleteStatus(status)
        context_class.add_c_function = add_c_function
    return c_api is not None


def _pybind_pointer(wrapped):  # pybind11 keeps it after the object header
    return ctypes.c_void_p.from_address(id(wrapped) + object.__basicsize__).value


_CAPSULE_POINTER = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object,
    ctypes.c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))


@functools.lru_cache(maxsize=None)
def _c_api():
    """TF's C API through ctypes, or None: not loadable, or the address read
    from a TF_Function's wrapper does not name the function."""
    import tensorflow as tf
    from tensorflow.core.framework import function_pb2
    from tensorflow.python.client import pywrap_tf_session as session

    try:
        lib = ctypes.CDLL(f"{tf.sysconfig.get_lib()}/libtensorflow_cc.so.2")
        p = ctypes.c_void_p
        for name, args, result in (
                ("TF_NewStatus", [], p), ("TF_DeleteStatus", [p], None),
                ("TF_GetCode", [p], ctypes.c_int),
                ("TF_Message", [p], ctypes.c_char_p),
                ("TF_FunctionName", [p], ctypes.c_char_p),
                ("TFE_ContextAddFunction", [p, p, p], None)):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = result
    except (OSError, AttributeError):
        return None
    probe = function_pb2.FunctionDef(signature={"name": "keras_ps_address_probe"})
    c_func = session.TF_FunctionImportFunctionDef(probe.SerializeToString())
    try:
        pointer = _pybind_pointer(c_func)
        named = pointer and lib.TF_FunctionName(pointer) == b"keras_ps_address_probe"
    finally:
        session.TF_DeleteFunction(c_func)
    return lib if named else None


def own_executor():
    """A context manager giving the calling thread its own synchronous eager
    executor. With the shared default executor, an error of a call to one
    (dead) worker can surface in another worker thread's next call, which
    then retries a step that had run (no public API for executors)."""
    return executor_scope(new_executor(asynchronous=False))


def new_executor(asynchronous=True):
    """A new eager executor (no public API for executors). Asynchronous: ops
    run under it (see `executor_scope`) return at once and run in order on
    its own thread, so a slow or hung remote task never blocks the caller.
    Synchronous: ops run on the caller's thread, each sent alone (one to a
    ps restarted since raises; an asynchronous one was seen to hang)."""
    return _internals().executor.new_executor(
        enable_async=asynchronous, enable_streaming_enqueue=asynchronous)


def clear_executor_error(executor):
    """Forgets the error an asynchronous executor holds (a call to a task
    that died), so that destroying it later does not raise it again."""
    executor.clear_error()


def executor_scope(executor):
    """Makes `executor` the calling thread's eager executor for the block."""
    return _internals().context.executor_scope(executor)


def get_server_def():
    return _internals().context.context().get_server_def()


def capture_call_time_value(closure, spec, name):
    """A placeholder in the current tf.function graph fed by `closure()` at
    every call (no public API; TF's own worker-index helper uses it)."""
    graph = _internals().ops.get_default_graph()
    return graph.capture_call_time_value(closure, spec, key=name)


def inside_function():
    return _internals().ops.inside_function()


def new_cancellation_manager():
    """A manager whose `start_cancel()` cancels the calls made through its
    `get_cancelable_function(concrete_function)`, remote ones included (no
    public API; TF's own coordinator cancels in-flight functions this way
    after an error)."""
    return _internals().cancellation.CancellationManager()


def resource_variable_saveable(variable, slice_spec, name):
    """A checkpoint saveable writing `variable` as the slice `slice_spec` of
    the entry `name` (no public API: `tf.train.Checkpoint` saves slices only
    through TF's saveable objects)."""
    from tensorflow.python.training.saving import saveable_object_util

    return saveable_object_util.ResourceVariableSaveable(
        variable, slice_spec, name)


def in_save_context():
    """True while `tf.saved_model.save` traces and exports (no public API
    tells; TF's own ShardedVariable asks the same function)."""
    from tensorflow.python.saved_model import save_context

    return save_context.in_save_context()


def uninitialized_variable(**kwargs):
    """A resource variable with a shape and no value, allocating nothing
    (no public API: `tf.Variable` always makes an initial value)."""
    from tensorflow.python.ops import resource_variable_ops

    return resource_variable_ops.UninitializedVariable(**kwargs)


def write_variable_proto(variable, proto, options):
    """Writes `variable` into a SavedModel object proto as a variable node
    (no public API: TF's save calls `_write_object_proto` on any object
    that acts as a resource variable; a ShardedVariable answers with its
    full-shape copy, as TF's own does)."""
    from tensorflow.python.ops import resource_variable_ops

    resource_variable_ops.write_object_proto_for_resource_variable(
        variable, proto, options, enforce_naming=False)


def waiting_restorations(trackable):
    """{child name: checkpoint positions} a `tf.train.Checkpoint.restore`
    left on `trackable` for children not made yet (live dict). No public
    API: TF keeps them in `_deferred_dependencies`, matched by name only."""
    return trackable._deferred_dependencies


def restore_waiting(trackable, name, child):
    """Restores into `child` what waits on `trackable` under `name`, as TF
    does when `trackable` tracks a new child under that name."""
    trackable._handle_deferred_dependencies(name=name, trackable=child)


def sleep_dataset(microseconds):
    """A dataset transformation waiting `microseconds` before each element
    (TF's non-public test op; for benchmarks and tests of slow input). Only
    over input that runs no function (`map` or a record dataset of a
    filename tensor runs one; see `sleep_ticks`): it holds its lock while
    its input makes an element and its cancel callback takes it, so a step
    cancelled meanwhile (a ps lost) deadlocks the worker for good."""
    from tensorflow.python.data.experimental.ops import testing

    return testing.sleep(microseconds)


def sleep_ticks(microseconds):
    """An endless dataset of zeros, each after `microseconds`: zip it with
    records to slow them down (a sleep over nothing that runs a function,
    so cancelling a step never deadlocks it; see `sleep_dataset`)."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensors(tf.constant(0, tf.int8)).repeat() \
        .apply(sleep_dataset(microseconds))


def plain_variable(**kwargs):
    """A tf.Variable made on the device in scope, past every variable creator
    in scope (a strategy's too): no public way skips the creator stack."""
    from tensorflow.python.ops import resource_variable_ops
    return resource_variable_ops.ResourceVariable(**kwargs)


def rebind_variable(variable, donor):
    """Points `variable` at `donor`'s resource, in place: a restarted ps lost
    its variables' resources, and the Python objects (held by layers,
    optimizers, checkpoints) get new ones. No public API: a resource
    variable keeps its resource in `_handle`, a cached read in
    `_cached_value`. The donor can be dropped: the resource lives on.
    Returns the handle it had (traced functions captured it)."""
    old, variable._handle = variable._handle, donor._handle
    variable._cached_value = None
    return old


def traced_once_each(function):
    """Marks `function` (a `tf.function`) as one of many made from one Python
    function on purpose, each traced for its own inputs (a dataset function
    per `fit` call, a backup function per group of variables); returns it.
    TF warns "... triggered tf.function retracing ... creating @tf.function
    repeatedly in a loop" when one Python function is traced 5 times within
    a few calls; here that is the design, and the warning would send a user
    after a mistake they did not make. Missing public API: no option says
    so; TF skips the warning for `_omit_frequent_tracing_warning`."""
    function._omit_frequent_tracing_warning = True
    return function


# tf.functions that capture no variable (they take them as arguments): their
# traces stay valid whatever retrace_all_functions is called for.
_captures_nothing = weakref.WeakSet()


def keep_traces(function):
    """Marks `function` (a `tf.function` that takes every variable it uses
    as an argument) as one `retrace_all_functions` leaves alone; returns
    it."""
    _captures_nothing.add(function)
    return function


def _all_of(kind):
    """Every live object of class `kind` or a subclass. type(), not
    isinstance(): some objects refuse __class__ (numpy's NpzFile fields)."""
    import gc
    # An ABC's subclass check is slow: once per type.
    is_kind = functools.lru_cache(maxsize=None)(lambda c: issubclass(c, kind))
    for obj in gc.get_objects():
        if is_kind(type(obj)):
            yield obj


def retrace_all_functions():
    """Drops the traced graphs of every `tf.function` of this process (but
    those given to `keep_traces`), so each traces again at its next call
    (a step traced before a table was tracked does not mark its rows). No
    public API: `tf.function` keeps its traces in `_function_cache`."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function
    functions = [f for f in _all_of(polymorphic_function.Function)
                 if f not in _captures_nothing]
    for function in functions:
        function._function_cache.clear()
    return len(functions)


def rebind_captures(handles):
    """Feeds every trace that captured a handle in `handles` ({id(old): (old,
    new)}, see `rebind_variable`) the new one: a trace captures a variable's
    handle by value, its graph is the same with the new one, and nothing is
    traced again. Returns how many traces changed. No public API: a trace's
    captures and its graph's record of them (read when it is saved)."""
    from tensorflow.python.eager.polymorphic_function import concrete_function
    changed = 0
    for trace in _all_of(concrete_function.ConcreteFunction):
        new = [handles[id(c)][1] if id(c) in handles else c
               for c in trace._captured_inputs]
        if any(n is not c for n, c in zip(new, trace._captured_inputs)):
            trace.set_external_captures(new)
            changed += 1
        pairs = trace.graph.captures
        if any(id(external) in handles for external, _ in pairs):
            trace.graph.function_captures.reset_captures(
                [handles[id(e)][1] if id(e) in handles else e for e, _ in pairs],
                [internal for _, internal in pairs])
    return changed


# -- The order of one traced step (keras_ps.shards.step_order) -----------------
# Missing public API: which resources an op reads or writes, as automatic
# control dependencies see them (a step's order must match theirs), whether
# they count an op as stateful, an op kept out of their chain of stateful
# ops, and a control input added to an op already made.
def resource_inputs(op):
    """[(resource tensor, read_only)] of `op`, as automatic control
    dependencies count them."""
    from tensorflow.python.framework import auto_control_deps as acd
    return [(tensor, kind == acd.ResourceType.READ_ONLY)
            for tensor, kind in acd._get_resource_inputs(op)]  # pylint: disable=protected-access


def op_is_stateful(op):
    """Whether automatic control dependencies chain `op` with other stateful ops."""
    from tensorflow.python.framework import auto_control_deps
    return auto_control_deps.op_is_stateful(op)


def run_independently(op):
    """Keeps `op` out of its graph's chain of stateful ops (if it has one)."""
    manager = getattr(op.graph, "experimental_acd_manager", None)
    if manager is not None:
        manager.run_independently(op)


def add_control_input(op, control):
    """Makes `op`, already in its graph, run after `control`."""
    op._add_control_input(control)  # pylint: disable=protected-access


# -- A gradient given by hand (keras_ps.tables._grouped_transfers) -------------
# Missing public API: `tf.custom_gradient` passes its inputs through an
# IdentityN made where it is called (the worker), so a ps tensor given to it
# would cross to the worker only to carry the gradient. These record ops on
# the active gradient tapes directly, as `tf.custom_gradient` does inside.
def stop_recording():
    """No gradient tape records the ops made inside."""
    from tensorflow.python.eager import record
    return record.stop_recording()


def record_operation(op_type, outputs, inputs, backward):
    """Records on every active gradient tape one op from `inputs` to
    `outputs` whose gradient is `backward(*output_gradients)` (one gradient
    per input)."""
    from tensorflow.python.eager import record
    record.record_operation(op_type, outputs, inputs, backward)
