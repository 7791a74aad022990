"""Keras layers keras_ps adds to Keras' own: `DynamicEmbedding`, a table whose
rows are made for ids as training first meets them (admitted after a few
sightings, evicted by age and capacity), and `export_plain_model`, which turns
a model holding one into a plain Keras model that serves without keras_ps. The
table itself lives with the other tables, in `keras_ps.tables.dynamic`.
"""

from keras_ps.tables.dynamic import DynamicEmbedding
from keras_ps.tables.dynamic import export_plain_model

__all__ = ["DynamicEmbedding", "export_plain_model"]
