"""keras_ps layers: `DynamicEmbedding` and its export to plain Keras."""

from keras_ps.tables.dynamic import DynamicEmbedding
from keras_ps.tables.dynamic import export_plain_model

__all__ = ["DynamicEmbedding", "export_plain_model"]
