"""Dynamic-vocabulary embedding tables: rows for ids as they arrive.

`DynamicEmbedding` maps raw keys to row slots of a preallocated table
sharded over the parameter servers (admission by count, eviction by age and
by capacity); `export_plain_model` turns a trained model into plain Keras.
"""

from keras_ps.dynamic_embedding.api import DynamicTableError
from keras_ps.dynamic_embedding.api import KeyDtypeError
from keras_ps.dynamic_embedding.api import TableConfig
from keras_ps.dynamic_embedding.export import export_plain_model
from keras_ps.dynamic_embedding.layer import DynamicEmbedding

__all__ = ["DynamicEmbedding", "DynamicTableError", "KeyDtypeError",
           "TableConfig", "export_plain_model"]
