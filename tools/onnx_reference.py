"""The ONNX reference for ``dayzero compare model.onnx OUT``: onnxruntime on the model, or the model zoo's
recorded ``test_data_set_*`` outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from dayzero import UserError


def reference_outputs(path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The reference for ``dayzero compare model.onnx OUT``: onnxruntime on the model, in graph output order.

    When ``inputs`` is empty and the model directory has ``test_data_set_*/{input,output}_*.pb`` (the ONNX model
    zoo's layout), the first data set's outputs are returned; ``test_data_inputs(path)`` gives its inputs."""
    p = Path(path)
    if not inputs:
        sets = sorted(p.parent.glob("test_data_set_*"))
        if sets:
            return [numpy_helper.to_array(_read_tensor(f)) for f in sorted(sets[0].glob("output_*.pb"),
                                                                            key=_pb_index)]
    try:
        import onnxruntime as ort
    except ImportError:
        raise UserError("the ONNX reference needs onnxruntime: pip install 'dayzero[onnx]'") from None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {k: np.asarray(v) for k, v in inputs.items()})


def _pb_index(f: Path) -> int:
    return int(f.stem.rsplit("_", 1)[-1])


def _read_tensor(f: Path) -> onnx.TensorProto:
    t = onnx.TensorProto()
    t.ParseFromString(f.read_bytes())
    return t


def test_data_inputs(path) -> dict[str, np.ndarray] | None:
    """The inputs of the model's first ``test_data_set_*`` directory, keyed by graph input name (or None)."""
    p = Path(path)
    sets = sorted(p.parent.glob("test_data_set_*"))
    if not sets:
        return None
    model = onnx.load(str(p), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    files = sorted(sets[0].glob("input_*.pb"), key=_pb_index)
    out = {}
    for k, f in enumerate(files):
        t = _read_tensor(f)
        out[t.name or names[k]] = numpy_helper.to_array(t)
    return out


test_data_inputs.__test__ = False  # not a pytest test despite its name
