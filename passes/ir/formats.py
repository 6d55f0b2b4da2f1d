"""Constants of the low-precision storage formats, defined once for the frontend (``frontend/lowprec.py``), the
passes and the kernels (``codegen/kernels/dequant/``): every layer may import ``passes.ir``."""

MXFP4_BLOCK = 32  # values per E8M0 scale
MXFP4_BYTES_PER_BLOCK = 16  # two E2M1 codes per byte
E8M0_BIAS = 127
E8M0_NAN = 0xFF
FP4_MAX = 6.0  # the largest E2M1 magnitude
FP8_E4M3_MAX = 448.0
FP8_BLOCK_SIZE = 128  # rows and columns of weight sharing one FP8 weight_scale_inv entry (DeepSeek-V3 layout)
