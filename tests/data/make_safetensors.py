#!/usr/bin/env python3
"""Writes tests/data/reference.safetensors with the reference writer (huggingface's safetensors
package, pinned below, numpy only): one tensor per dtype Linum reads, with values test_safetensors.cpp
recomputes (arange-based), and metadata.

    pip install safetensors==0.8.0 numpy ml_dtypes
    python3 tests/data/make_safetensors.py
"""
import os

import ml_dtypes
import numpy as np
import safetensors
from safetensors.numpy import save_file

assert safetensors.__version__ == "0.8.0", safetensors.__version__
HERE = os.path.dirname(os.path.abspath(__file__))


def ar(shape, dtype, scale=1.0, offset=0.0):
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float64) * scale + offset).reshape(shape).astype(dtype)


tensors = {
    "encoder.layer.0.weight": ar((3, 4), np.float32, 0.25, -1.0),        # F32
    "encoder.layer.0.bias": ar((4,), ml_dtypes.bfloat16, 0.5, -1.0),     # BF16
    "half": ar((2, 3), np.float16, 0.125, -0.25),                        # F16
    "double": ar((5,), np.float64, 0.5, 1.0),                            # F64 (exact in float32)
    "ids": ar((2, 2), np.int64, 1000, -1500),                            # I64 (fits int32)
    "bytes": ar((6,), np.uint8, 40, 0),                                  # U8
    "mask": np.array([True, False, True]),                               # BOOL
    "count": np.array(7, np.int32),                                      # I32, 0-d
    "empty": np.zeros((0, 3), np.float32),                               # no elements
}
save_file(tensors, os.path.join(HERE, "reference.safetensors"), metadata={"format": "np", "written_by": "safetensors 0.8.0"})
print("wrote", os.path.join(HERE, "reference.safetensors"))
