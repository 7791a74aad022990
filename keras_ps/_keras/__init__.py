"""keras_ps' hooks into Keras internals, one module per concern."""
