"""What every `fit` loop does at the end of an epoch and of training (the
steps loop in keras_ps/training.py and the shards loop in keras_ps/shards/fit.py)."""

import keras


def validation_logs(model, validation_data, batch_size, steps):
    """`val_`-prefixed metrics of `model.evaluate` on `validation_data`
    (evaluated on the workers: the model's evaluate is keras_ps')."""
    val_x, val_y, val_w = keras.utils.unpack_x_y_sample_weight(
        validation_data) if isinstance(validation_data, tuple) else (
        validation_data, None, None)
    logs = model.evaluate(val_x, val_y, sample_weight=val_w,
                          batch_size=batch_size, steps=steps, verbose=0,
                          return_dict=True)
    return {f"val_{k}": v for k, v in logs.items()}


def end_training(model, callback_list, epochs, training_logs):
    """Finalizes the optimizer's variables, ends the callbacks; the history."""
    if isinstance(model.optimizer, keras.optimizers.Optimizer) and epochs > 0:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callback_list.on_train_end(logs=training_logs)
    return model.history
