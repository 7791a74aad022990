"""Keras layers keras_ps adds to Keras' own: `DynamicEmbedding`, a table whose
rows are made for ids as training first meets them (admitted after a few
sightings, evicted by age and capacity), and `export_plain_model`, which turns
a model holding one into a plain Keras model that serves without keras_ps. The
table itself is the package `keras_ps.dynamic_embedding`.
"""

from keras_ps.dynamic_embedding import DynamicEmbedding
from keras_ps.dynamic_embedding import export_plain_model

__all__ = ["DynamicEmbedding", "export_plain_model"]
