"""Values of the ONNX importer: what is known at import (``Known``), element types, and the ``Unsupported`` signal.

Shared by the shape folding (``fold.py``), the converters (``converters.py``) and the importer (``importer.py``).
"""

from __future__ import annotations

import numpy as np
import onnx

# ONNX TensorProto elem type -> IR dtype name
ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
           11: "float64", 16: "bfloat16", 17: "float8_e4m3fn", 19: "float8_e5m2"}
NUMPY_DTYPES = {"float32": np.float32, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
       "int64": np.int64, "bool": np.bool_, "float16": np.float16, "float64": np.float64}
INT4_SIGNED = {onnx.TensorProto.INT4: True, onnx.TensorProto.UINT4: False}  # -> signed


class Known:
    """A value known at import: a numpy array, object-typed when entries are symbolic sizes (``torch.SymInt``)."""

    def __init__(self, value: np.ndarray, name: str = "", proto: onnx.TensorProto | None = None):
        self.value = value
        self.name = name
        self.proto = proto  # the initializer, when packed sub-byte storage must be read as stored

    @property
    def symbolic(self) -> bool:
        return self.value.dtype == object and any(not isinstance(v, (int, np.integer)) for v in self.value.flat)



class Unsupported(Exception):
    """This node's attributes ask for a variant dayzero does not map (named in the message)."""
