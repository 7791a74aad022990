"""Dynamic-vocabulary embedding tables: rows for ids as they arrive.

`DynamicEmbedding` maps raw keys to row slots of a preallocated table
sharded over the parameter servers (admission by count, eviction by age and
by capacity); `export_plain_model` turns a trained model into plain Keras.
"""

from keras_ps.tables.dynamic.api import DynamicTableError, KeyDtypeError, TableConfig
from keras_ps.tables.dynamic.export import export_plain_model
from keras_ps.tables.dynamic.layer import DynamicEmbedding

__all__ = ["DynamicEmbedding", "DynamicTableError", "KeyDtypeError",
           "TableConfig", "export_plain_model"]
