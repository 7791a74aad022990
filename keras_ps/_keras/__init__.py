"""Keras internals that keras_ps hooks, one module per concern."""
