"""Keras hooks that make TF-style user code behave as under TF's own strategy.

Every use of a Keras internal here is pinned in
tests/api/test_keras_internals.py (section "compat"). The strategy calls
`install()` with the test that tells its own strategies apart (this module
sits below the strategy and does not import it). Models not built under a
keras_ps strategy go through Keras unchanged.
"""

import functools
import weakref

import keras
import tensorflow as tf
from keras.src.trainers import trainer as trainer_lib

from keras_ps.tables import partitioners
from keras_ps import _keras as hooks

# (owner, attribute) of every Keras internal this module wraps.
COMPAT_TARGETS = ((trainer_lib.Trainer, "compile"),)


def _never(strategy):
    del strategy
    return False


_is_keras_ps_strategy = _never


def _keras_ps_strategy(model):
    """The keras_ps strategy `model` was created under, or None."""
    strategy = getattr(model, "_distribute_strategy", None)
    return strategy if _is_keras_ps_strategy(strategy) else None


# -- Section: model state on the ps whatever the scope at compile time ---------
# Missing public API: Keras 3's `compile()` creates the loss tracker (and, for
# a string optimizer, the optimizer with its `iterations`) under whatever
# scope is current, and an optimizer object remembers the strategy current at
# its construction; tf_keras' compile entered the model's strategy scope
# itself. Compiled outside `strategy.scope()`, these variables stayed on the
# coordinator, where workers updated them with non-atomic read-then-write
# (fit(epochs=10, steps_per_epoch=10) on 3 workers ended with
# `iterations == 66`). We wrap `Trainer.compile`: for a model created under a
# keras_ps strategy it runs inside that strategy's scope, then moves every
# not-yet-used optimizer or metric variable made outside it to a ps.
def _scoped_compile(keras_compile):
    @functools.wraps(keras_compile)
    def compile(self, *args, **kwargs):
        strategy = _keras_ps_strategy(self)
        if strategy is None:
            _refuse_model_made_outside(self, tf.distribute.get_strategy())
            return keras_compile(self, *args, **kwargs)
        with strategy.scope():
            result = keras_compile(self, *args, **kwargs)
        _compiles[self] = _compiles.get(self, 0) + 1
        place_model_state(self, strategy)
        return result

    return compile


def _refuse_model_made_outside(model, current):
    """A model created outside a keras_ps strategy's scope and compiled
    inside it would train on the coordinator, its weights never on a ps
    (Keras 3 keeps the strategy current when the model was created), without
    a word; tf_keras refuses it at compile() too."""
    if not _is_keras_ps_strategy(current):
        return
    where = ""
    if model.weights:
        first = model.weights[0]
        device = getattr(getattr(first, "value", None), "device", "") or "?"
        where = f" (its weight {first.path!r} is on {device})"
    raise ValueError(
        f"Model {model.name!r} was created outside `strategy.scope()` of the "
        f"keras_ps strategy that compile() runs under{where}: its weights "
        "would not live on the parameter servers, and fit would train it on "
        "the coordinator. Create the model inside `with strategy.scope():` "
        "(compile() may then run inside or outside it).")


# How many times each keras_ps model was compiled. Keras drops its traced
# `train_function` and `test_function` at every `compile()`; keras_ps keeps
# its own traced steps across fit/evaluate calls while this count holds.
_compiles = weakref.WeakKeyDictionary()


def compile_count(model):
    """How many times `model` was compiled under a keras_ps strategy."""
    return _compiles.get(model, 0)


def _on_ps(inner):
    return "/job:ps/" in (getattr(inner, "device", "") or "")


def _optimizers(model):
    optimizer = getattr(model, "optimizer", None)
    out = []
    while optimizer is not None and optimizer not in out:
        out.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)  # loss scaling
    return out


def _metric_objects(model):
    found = []
    loss_tracker = getattr(model, "_loss_tracker", None)
    if loss_tracker is not None:
        found.append(loss_tracker)
    compile_metrics = getattr(model, "_compile_metrics", None)
    if compile_metrics is not None:
        for name in ("_user_metrics", "_user_weighted_metrics"):
            for item in tf.nest.flatten(getattr(compile_metrics, name, None)):
                if isinstance(item, keras.metrics.Metric):
                    found.append(item)
        found.extend(getattr(compile_metrics, "metrics", []) or [])
    return found


def _relocate(variable, strategy):
    """Re-creates the tf.Variable inside keras.Variable `variable` on a ps,
    with its current value."""
    inner = variable._value
    with tf.init_scope(), strategy.scope(), partitioners.no_partitioning():
        moved = tf.Variable(
            inner.read_value(), trainable=inner.trainable,
            name=inner.name.split(":")[0], aggregation=inner.aggregation,
            synchronization=inner.synchronization)
    variable._initialize(moved)


def place_model_state(model, strategy):
    """Puts every optimizer and metric variable of `model` on a ps.

    Variables made outside `strategy.scope()` (an unbuilt optimizer's
    `iterations`, learning rate and loss-scale state; metric variables) are
    re-created on a ps with their current values; the optimizer then
    updates through `strategy`.

    Raises:
        ValueError: the optimizer was built (has slots) off the ps.
    """
    for optimizer in _optimizers(model):
        off_ps = [v for v in optimizer.variables
                  if v._value is not None and not _on_ps(v._value)]
        # Made at construction, before any slot: iterations, the learning
        # rate, a loss-scale wrapper's own state.
        own = {id(getattr(optimizer, "_iterations", None)),
               id(getattr(optimizer, "_learning_rate", None))}
        if hasattr(optimizer, "inner_optimizer"):
            own.update(id(v) for v in optimizer._variables)
        slots = [v for v in off_ps if id(v) not in own]
        if optimizer.built and slots:
            raise ValueError(
                "The optimizer of a model created under a keras_ps "
                "ParameterServerStrategy was built (its slot variables "
                "created) outside strategy.scope(), so its state lives on the "
                "coordinator instead of the parameter servers. Received: "
                f"optimizer={optimizer.name!r} with "
                f"{slots[0].path!r} on {slots[0]._value.device}. Pass compile() "
                "a new optimizer (or a string such as 'adam'), or build it "
                "under `with strategy.scope():`.")
        for variable in off_ps:
            _relocate(variable, strategy)
        if hasattr(optimizer, "_distribution_strategy"):
            optimizer._distribution_strategy = strategy
    for metric in _metric_objects(model):
        if not isinstance(metric, keras.metrics.Metric):
            continue
        for variable in metric.variables:
            if variable._value is not None and not _on_ps(variable._value):
                _relocate(variable, strategy)


# -- Section: an optimizer made outside the scope, in a custom loop ------------
# Missing public API: a Keras 3 optimizer keeps the strategy current when it
# was made (`_distribution_strategy`) and makes its slots and applies its
# updates through it; made outside `strategy.scope()` that is TF's default
# strategy. Its slots made under the scope then fail with TF's "Mixing
# different tf.distribute.Strategy objects" (TF's own coordinator, which
# traces under the scope, fails so at the first step), its updates inside
# `strategy.run` with "Must not nest tf.distribute.Strategy scopes", and in
# a step traced outside the scope it trains with its state on the
# coordinator. `compile()` moves such an optimizer to the ps (see
# place_model_state); in a custom loop it is refused where it applies
# gradients to a weight on a ps (`apply`, which `apply_gradients` calls:
# when the step is traced, before it runs), or makes a slot under the
# scope. A slot made outside the scope is let be: Keras builds a throwaway
# optimizer so when it clones a model (`clone_model`,
# keras_ps.layers.export_plain_model).
def refuse_optimizer_made_outside(optimizer, variables, scope_only=False):
    """Raises ValueError when `optimizer` was made outside a keras_ps
    strategy's scope and is used under such a scope, or (unless
    `scope_only`) for a weight in `variables` on a ps. The hooks on the
    Keras functions call it: keras_ps._keras.grouped_reads' on
    `Optimizer.apply`, keras_ps._keras.sharding's (`scope_only`) where a
    slot is made."""
    made_under = getattr(optimizer, "_distribution_strategy", None)
    if made_under is None or _is_keras_ps_strategy(made_under):
        return
    on_ps = [v for v in variables if _on_ps(_tf_variable(v))]
    if not _is_keras_ps_strategy(tf.distribute.get_strategy()) and (
            scope_only or not on_ps):
        return  # a model of its own, outside keras_ps
    where = " under the scope of a keras_ps strategy"
    if on_ps:
        name = getattr(on_ps[0], "path", None) or on_ps[0].name
        where = f" for {name!r}, a weight on {_tf_variable(on_ps[0]).device}"
    raise ValueError(
        f"Optimizer {optimizer.name!r} was created outside "
        "`strategy.scope()`: it updates through the strategy current when it "
        f"was made ({type(made_under).__name__}), not the keras_ps strategy, "
        "so its state (`iterations`, its slots) would not live on the "
        "parameter servers, and TF fails with 'Mixing different "
        "tf.distribute.Strategy objects'. Received: optimizer="
        f"{optimizer.name!r} ({type(optimizer).__name__}) used{where}. Fix: "
        "create the optimizer inside `with strategy.scope():` (a model's "
        "compile() does it for the optimizer it is given).")


def refuse_slot_outside_scope(optimizer, reference):
    """Raises RuntimeError when `optimizer`, made under a keras_ps strategy,
    is about to make a slot for `reference` outside that strategy's scope:
    TF refuses it there ("Need to be inside strategy.scope()"), naming
    neither the optimizer nor the fix. `coordinator.schedule` traces outside
    the scope (one coordinator may run functions of models made under
    several strategies of its cluster, whose optimizers would refuse to
    update under another's scope), so a step whose first apply_gradients
    builds the optimizer meets this."""
    made_under = getattr(optimizer, "_distribution_strategy", None)
    if not _is_keras_ps_strategy(made_under) or (
            tf.distribute.get_strategy().extended is made_under.extended):
        return
    name = getattr(reference, "path", None) or reference.name
    raise RuntimeError(
        f"Optimizer {optimizer.name!r} makes its slot for {name!r} outside "
        "the scope of the keras_ps strategy it was created under, which TF "
        "refuses ('Need to be inside \"with strategy.scope()\"'). A step "
        "given to coordinator.schedule is traced outside the scope (TF's "
        "coordinator traces inside it), so an optimizer built by the first "
        "apply_gradients of a scheduled step cannot make its slots there. "
        "Fix: build the optimizer before the first schedule, "
        "`with strategy.scope(): optimizer.build(model.trainable_variables)`"
        ", or run the step's body with strategy.run(...).")


def _tf_variable(variable):
    return variable._value if isinstance(variable, keras.Variable) else variable


def install(is_keras_ps_strategy):
    """Installs the compat hooks, once.

    Args:
        is_keras_ps_strategy: `strategy -> bool`.
    """
    global _is_keras_ps_strategy
    _is_keras_ps_strategy = is_keras_ps_strategy
    for (owner, name), wrap in zip(COMPAT_TARGETS, (_scoped_compile,)):
        hooks.wrap(owner, name, wrap)


# -- Section: lazily built models under a variable_partitioner -----------------
# Missing public API: Keras builds an unbuilt model inside
# `backend.compute_output_spec` (`Trainer._symbolic_build`), where weights are
# created in a stateless, symbolic scope without their tf.Variable (tf_keras
# built with eager variables). A sharded weight steps out of that scope to
# make its shards (keras_ps._keras.sharding); before that symbolic build,
# keras_ps also builds such a model by one eager call on a batch of zeros
# shaped like the input (batch size 1) on the coordinator, under the
# strategy's scope, so that every weight is made eagerly, as tf_keras did.
def _zeros_like_spec(spec):
    if not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None:
        return None
    shape = [1 if d is None else d for d in spec.shape.as_list()]
    return tf.zeros(shape, dtype=spec.dtype)


def build_eagerly(model, strategy, element_spec):
    """Builds an unbuilt `model` with eager variables when `strategy` splits
    variables. A no-op for a built model, without a partitioner, or when the
    input is not plain tensors (ragged, sparse, unknown rank)."""
    if strategy.variable_partitioner is None:
        return
    if all(layer.built for layer in model._flatten_layers()):
        return
    x, _, _ = keras.utils.unpack_x_y_sample_weight(
        tuple(element_spec) if isinstance(element_spec, (tuple, list))
        else element_spec)
    inputs = tf.nest.map_structure(_zeros_like_spec, x)
    if any(leaf is None for leaf in tf.nest.flatten(inputs)) or not \
            tf.nest.flatten(inputs):
        return
    with tf.init_scope(), strategy.scope():
        model(inputs, training=False)
