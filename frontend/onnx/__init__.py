"""ONNX frontend: ``model.onnx`` -> dayzero IR (``importer.trace_onnx``); shape folding in ``fold``, one converter
per ONNX op in ``converters``, the importer's values in ``values``."""
