"""codegen/cpu_rules.py: the CPU default tier. Each rule against its op's reference (the ATen call) at odd and
symbolic shapes (tails, T = 1, primes), taking the kernels it claims and returning None for the rest.

The kernels are the real ``linear`` lowering of an IR node, scheduled by the whole chain (``schedule_kernel``:
rule, then the work-size rule of ``parallel.py``), compiled for the host once per case.
"""

from __future__ import annotations

import pytest
import sympy
import torch
import tvm
from tvm import te

from dayzero.codegen import cpu_rules, program
from dayzero.codegen.program import Kernel
from dayzero.codegen.schedule import schedule_kernel
from dayzero.codegen.tuning import normalize
from dayzero.passes.ir import ops
from dayzero.passes.ir.node import Node, TensorType
from dayzero.targets.host import host_target_dict

TARGET = tvm.target.Target(host_target_dict())
SEQ = sympy.Symbol("seq", integer=True, positive=True)
g = torch.Generator().manual_seed(0)


def linear_node(lead, n, k, dtype="float32", bias=False) -> Node:
    """linear(x [*lead, k], w [n, k], b [n]) as the frontend builds it; lead may hold the symbol ``seq``."""
    shapes = [(*lead, k), (n, k)] + ([(n,)] if bias else [])
    ins = [Node.make("input", (), {"name": f"x{i}"}, [TensorType(dtype, s)]) for i, s in enumerate(shapes)]
    return Node.make("linear", ins, {"bias": bias}, [TensorType(dtype, (*lead, n))])


def compile_linear(node: Node):
    """(compiled kernel, its scheduled module): the node's kernel through the whole schedule chain."""
    func = program.make_prim_func(node, "k")
    mod = schedule_kernel(Kernel("k", "linear", func, "key", node=node), TARGET, None)
    return tvm.compile(mod, target=TARGET)["main"], mod


def check_linear(node: Node, lib, seq: int, tol=1e-4):
    """The kernel against the op's reference (F.linear on the same inputs) at seq."""
    tdt = getattr(torch, node.types[0].dtype)
    ins = [torch.randn(*[seq if d == SEQ else d for d in i.type.shape], generator=g).to(tdt) for i in node.inputs]
    ref = ops.get("linear").call(ins, node.attr)
    out = torch.empty_like(ref)
    lib(*ins, out)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("lead,n,k,seqs", [
    ((SEQ,), 67, 64, (1, 5, 17)),   # symbolic T: T = 1 and row tails; a prime N (column tail)
    ((1,), 64, 64, (1,)),           # decode's GEMV (T = 1)
    ((2, SEQ), 13, 40, (3,)),       # two leading dims fused into rows; K = 40 takes 8 lanes
])
def test_dense_linear_matches_the_reference(lead, n, k, seqs):
    node = linear_node(lead, n, k)
    lib, mod = compile_linear(node)
    assert "matmul_rf" in mod.script()  # the dense rule took it
    for seq in seqs:
        check_linear(node, lib, seq)


@pytest.mark.parametrize("lead,n,k,seqs", [
    ((SEQ,), 96, 80, (1, 13, 63, 64, 67, 100)),  # both variants of one kernel (at 64 rows); pad tails of 4 and 12
    ((2, SEQ), 64, 48, (5, 70)),                  # leading dims: rows are the last one; k takes the 16 lanes
    ((67,), 32, 20, (67,)),                       # static rows >= 64: the packed GEMM alone; k = 20 (4 lanes)
])
def test_dense_linear_packed_gemm_matches_the_reference(lead, n, k, seqs):
    node = linear_node(lead, n, k)
    lib, mod = compile_linear(node)
    assert "_global" in mod.script()  # the packed w (cache_read)
    for seq in seqs:
        check_linear(node, lib, seq)


def test_dense_linear_picks_its_schedule_by_rows():
    """GEMV / small GEMM: the dot-product tiles; many rows: the packed GEMM; a symbolic row count: both, behind
    one run-time check on the rows."""
    def scheduled(lead, n, k):
        return cpu_rules.dense_linear(normalize(program.make_prim_func(linear_node(lead, n, k), "k")), TARGET).script()

    few = scheduled((16,), 64, 64)
    assert "matmul_rf" in few and "_global" not in few
    many = scheduled((128,), 64, 64)
    assert "_global" in many and "matmul_rf" not in many
    both = scheduled((SEQ,), 64, 64)
    assert "_global" in both and "matmul_rf" in both and f"if seq >= T.int64({cpu_rules.PACK_MIN_ROWS})" in both
    # N not a multiple of the packed tile's width: the dot-product tiles at every row count
    assert "_global" not in scheduled((SEQ,), 40, 64)


def test_dense_linear_bf16_packed_gemm_with_bias():
    node = linear_node((SEQ,), 64, 32, dtype="bfloat16", bias=True)
    lib, mod = compile_linear(node)
    assert "_global" in mod.script()
    for seq in (3, 77):
        check_linear(node, lib, seq, tol=2e-2)


def test_dense_linear_bf16_with_bias_accumulates_in_fp32():
    node = linear_node((SEQ,), 19, 32, dtype="bfloat16", bias=True)
    lib, mod = compile_linear(node)
    assert "matmul_rf" in mod.script()
    check_linear(node, lib, 7, tol=2e-2)


def test_dense_linear_returns_none_where_it_does_not_apply():
    def mod_of(node):
        return normalize(program.make_prim_func(node, "k"))

    # K prime (no lane width divides it): the rule declines; the generic rules still compute it (checked below)
    assert cpu_rules.dense_linear(mod_of(linear_node((SEQ,), 8, 37)), TARGET) is None
    # a matmul whose second operand is [k, n] (mm's layout), an elementwise op, a row reduction: not a linear
    a, b = te.placeholder((4, 8), name="a"), te.placeholder((8, 5), name="b")
    kk = te.reduce_axis((0, 8), "k")
    mm = te.compute((4, 5), lambda i, j: te.sum(a[i, kk] * b[kk, j], axis=kk), name="mm")
    assert cpu_rules.dense_linear(normalize(te.create_prim_func([a, b, mm])), TARGET) is None
    ew = te.compute((4, 8), lambda i, j: a[i, j] * 2.0, name="ew")
    assert cpu_rules.dense_linear(normalize(te.create_prim_func([a, ew])), TARGET) is None
    row = te.compute((4,), lambda i: te.sum(a[i, kk], axis=kk), name="row")
    assert cpu_rules.dense_linear(normalize(te.create_prim_func([a, row])), TARGET) is None
    # an integer linear: not fp32 / bf16 inputs
    assert cpu_rules.dense_linear(mod_of(linear_node((3,), 4, 8, dtype="int32")), TARGET) is None


def test_a_linear_the_dense_rule_declines_still_matches_through_the_generic_rules():
    node = linear_node((SEQ,), 8, 37)
    lib, mod = compile_linear(node)
    assert "matmul_rf" not in mod.script()
    check_linear(node, lib, 3)


def mm_node(op, a_shape, b_shape, out_shape, dtype="float32") -> Node:
    """mm / bmm / matmul(a, b) as the frontend builds it; shapes may hold the symbol ``seq``."""
    ins = [Node.make("input", (), {"name": f"x{i}"}, [TensorType(dtype, s)]) for i, s in enumerate((a_shape, b_shape))]
    return Node.make(op, ins, {}, [TensorType(dtype, out_shape)])


def compile_node(node: Node):
    func = program.make_prim_func(node, "k")
    mod = schedule_kernel(Kernel("k", node.op, func, "key", node=node), TARGET, None)
    return tvm.compile(mod, target=TARGET)["main"], mod


def check_node(node: Node, lib, seq: int, tol=1e-4):
    """The kernel against the op's reference (the ATen call on the same inputs) at seq."""
    tdt = getattr(torch, node.types[0].dtype)
    ins = [torch.randn(*[seq if d == SEQ else d for d in i.type.shape], generator=g).to(tdt) for i in node.inputs]
    ref = ops.get(node.op).call(ins, node.attr)
    out = torch.empty_like(ref)
    lib(*ins, out)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("op,a,b,out,seqs", [
    ("bmm", (3, SEQ, 37), (3, 37, 48), (3, SEQ, 48), (1, 12, 13, 29)),    # scores: rows padded to 12, k prime
    ("bmm", (2, 5, SEQ), (2, SEQ, 64), (2, 5, 64), (1, 17)),              # weighted sum: k = seq, symbolic
    ("matmul", (2, 3, SEQ, 16), (3, 16, 32), (2, 3, SEQ, 32), (7,)),      # b broadcast over a's leading dim
    ("mm", (24, 8), (8, 16), (24, 16), (1,)),                              # static rows, a multiple of 12
])
def test_batched_matmul_matches_the_reference(op, a, b, out, seqs):
    node = mm_node(op, a, b, out)
    lib, mod = compile_node(node)
    assert cpu_rules.cpu_default_rule(normalize(program.make_prim_func(node, "k")), TARGET)[0] == "batched_matmul"
    for seq in seqs:
        check_node(node, lib, seq)


def test_batched_matmul_bf16_accumulates_in_fp32():
    node = mm_node("bmm", (2, SEQ, 32), (2, 32, 16), (2, SEQ, 16), dtype="bfloat16")
    lib, _ = compile_node(node)
    check_node(node, lib, 5, tol=2e-2)


def test_batched_matmul_returns_none_where_it_does_not_apply():
    def mod_of(node):
        return normalize(program.make_prim_func(node, "k"))

    # n not a multiple of 16 lanes: declined, and the generic rules still compute it
    odd = mm_node("bmm", (2, 5, 8), (2, 8, 20), (2, 5, 20))
    assert cpu_rules.batched_matmul(mod_of(odd), TARGET) is None
    lib, _ = compile_node(odd)
    check_node(odd, lib, 1)
    # a linear (w [n, k]) is dense_linear's, a row reduction and an elementwise op no one's here
    assert all(cpu_rules.batched_matmul(mod, TARGET) is None for mod in other_kernels())


def other_kernels() -> list:
    """A linear (w [n, k]), a lone row sum (no element-wise output) and an element-wise op, normalised."""
    a = te.placeholder((4, 32), name="a")
    kk = te.reduce_axis((0, 32), "k")
    row = te.compute((4,), lambda i: te.sum(a[i, kk], axis=kk), name="row")
    ew = te.compute((4, 32), lambda i, j: a[i, j] * 2.0, name="ew")
    return [normalize(program.make_prim_func(linear_node((SEQ,), 32, 32), "k")),
            normalize(te.create_prim_func([a, row])), normalize(te.create_prim_func([a, ew]))]


AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})


def test_simd_widths_come_from_the_target():
    assert cpu_rules.Simd.of(tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})) == cpu_rules.Simd(16, 32)
    avx2 = cpu_rules.Simd.of(AVX2)
    assert avx2 == cpu_rules.Simd(8, 16) and avx2.bcast_mr * 2 + 3 <= 16 and avx2.lane_choices == (8, 4)
    assert cpu_rules.Simd.of(tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"})).lanes == 4  # SSE only


@pytest.mark.skipif(not tvm.target.codegen.target_has_features(["avx2"], TARGET), reason="host without AVX2")
def test_an_avx2_target_gets_avx2_tiles_that_compute_the_reference():
    """Both contraction rules on an AVX2 target (this host runs its code): 8 lanes, 2 x rows per dot-product
    tile, 6 per broadcast tile, against the reference."""
    node = linear_node((SEQ,), 32, 24)
    func = program.make_prim_func(node, "k")
    mod = schedule_kernel(Kernel("k", "linear", func, "key", node=node), AVX2, None)
    script = mod.script()
    assert "T.vectorized(T.int64(8))" in script and "T.vectorized(T.int64(16))" in script  # 8 lanes; NW = 16
    assert "T.unroll(T.int64(6))" in script and "T.unroll(T.int64(2))" in script
    lib = tvm.compile(mod, target=AVX2)["main"]
    for seq in (5, 70):
        check_linear(node, lib, seq)
    node = mm_node("bmm", (2, SEQ, 24), (2, 24, 8), (2, SEQ, 8))
    mod = schedule_kernel(Kernel("k", "bmm", program.make_prim_func(node, "k"), "key", node=node), AVX2, None)
    check_node(node, tvm.compile(mod, target=AVX2)["main"], 7)


def softmax_node(shape) -> Node:
    x = Node.make("input", (), {"name": "x0"}, [TensorType("float32", shape)])
    return Node.make("softmax.int", [x], {"dim": -1, "dtype": None}, [TensorType("float32", shape)])


def test_dlight_reduction_declines_a_schedule_that_multiplies_the_work():
    """One row: dlight's rule recomputed the row's max and sum for every column (width^2 iterations: minutes for
    a 201K vocabulary); the rule declines it and the kernel still matches through the generic rule. Several
    rows, and a symbolic row count, keep dlight's schedule."""
    def rule_of(node):
        return cpu_rules.cpu_default_rule(normalize(program.make_prim_func(node, "k")), TARGET)[0]

    def dlight(node):
        return cpu_rules.dlight_reduction(normalize(program.make_prim_func(node, "k")), TARGET)

    one = softmax_node((1, 1000))
    assert dlight(one) is None
    assert dlight(softmax_node((16, 1000))) is not None and dlight(softmax_node((SEQ, 1000))) is not None
    # in the chain, dlight now gets the row reductions row_reduction declines: a symbolic row width
    assert rule_of(softmax_node((16, SEQ))) == "dlight_reduction"


def test_a_declined_dlight_schedule_leaves_the_kernel_to_the_next_rule_untouched():
    mod = normalize(program.make_prim_func(softmax_node((1, 64)), "k"))
    before = mod.script()
    assert cpu_rules.dlight_reduction(mod, TARGET) is None
    assert mod.script() == before  # dlight rewrote it in place: parallel_loops got the quadratic schedule


def row_node(op, shape, width_attrs=True) -> Node:
    """softmax / log_softmax over the last dim, or rms_norm / layer_norm (weight, and bias for layer_norm) over
    it, as the frontend builds them; shape may hold the symbol ``seq``."""
    w = shape[-1]
    specs = [shape] + ([(w,)] if op in ("rms_norm", "layer_norm") else []) + ([(w,)] if op == "layer_norm" else [])
    ins = [Node.make("input", (), {"name": f"x{i}"}, [TensorType("float32", s)]) for i, s in enumerate(specs)]
    attrs = {"softmax.int": {"dim": -1, "dtype": None}, "_log_softmax": {"dim": -1, "half_to_float": False},
             "rms_norm": {"normalized_shape": [w], "weight": True, "eps": 1e-6},
             "layer_norm": {"normalized_shape": [w], "weight": True, "bias": True, "eps": 1e-5,
                            "cudnn_enable": True}}[op]
    return Node.make(op, ins, attrs, [TensorType("float32", shape)])


@pytest.mark.parametrize("op,shape,seqs", [
    ("softmax.int", (SEQ, 1000), (1, 5, 17)),  # symbolic rows; 1000 takes 8-lane partials
    ("softmax.int", (3, 4096), (1,)),          # 4 accumulators x 16 lanes
    ("_log_softmax", (2, SEQ, 96), (3,)),      # two leading dims fused into the row loop
    ("rms_norm", (SEQ, 64), (1, 7)),
    ("rms_norm", (SEQ, 37), (5,)),             # a prime width: serial reductions, the output vectorised with a tail
    ("layer_norm", (SEQ, 48), (1, 6)),         # two reductions, the second reading the first
    ("softmax.int", (1001,), (1,)),            # 1-D, an odd width: no row loop, serial reductions
    ("rms_norm", (96,), (1,)),                 # 1-D: the blocks one after the other at the root
])
def test_row_reduction_matches_the_reference(op, shape, seqs):
    node = row_node(op, shape)
    assert cpu_rules.cpu_default_rule(normalize(program.make_prim_func(node, "k")), TARGET)[0] == "row_reduction"
    lib, mod = compile_node(node)
    assert "_rf_local" in mod.script() or shape[-1] in (37, 1001)  # vector partial sums in registers
    for seq in seqs:
        check_node(node, lib, seq, tol=1e-5)


def test_row_reduction_splits_one_row_across_the_cores():
    """One row (decode's vocabulary softmax) on a 4-core target: every reduction as per-core partials of vector
    partials, the cores' loops parallel, the output's row in 4 parallel pieces; against the reference (with the
    largest logit in the last core's piece, so a core's partial max must reach the result)."""
    four = tvm.target.Target(dict(host_target_dict(), **{"num-cores": 4}))
    node = row_node("softmax.int", (1, 1 << 17))  # work enough for parallel.py to keep the cores' loops
    func = program.make_prim_func(node, "k")
    mod = schedule_kernel(Kernel("k", node.op, func, "key", node=node), four, None)
    script = mod.script()
    assert "mx_rf_rf_local" in script and "se_rf_rf_local" in script
    assert script.count("T.parallel(T.int64(4))") == 4  # the two reductions' cores, the exp row's, the output's
    lib = tvm.compile(mod, target=four)["main"]
    x = torch.randn(1, 1 << 17, generator=g)
    x[0, -100] = 30.0
    out = torch.empty_like(x)
    lib(x, out)
    torch.testing.assert_close(out, torch.softmax(x, -1), rtol=1e-5, atol=1e-7)


def exps(script: str) -> int:
    """exp calls in a kernel's TVMScript: ``T.exp`` or, after ``fast_exp``, its polynomial (one ``T.Let`` each)."""
    return script.count("T.exp(") + script.count("T.Let(")


@pytest.mark.parametrize("shape,rule", [((3, 4096), "row_reduction"), ((1, 1 << 17), "row_reduction"),
                                        ((16, SEQ), "dlight_reduction")])
def test_softmax_computes_each_exp_once(shape, rule):
    """softmax's exp is read by the row sum and by the output: inlined into both, every element's exp (a
    polynomial an element, most of the kernel's work) was computed twice. It is a stage of its own (a row of it
    under the row loop), on every route."""
    node = softmax_node(shape)
    assert cpu_rules.cpu_default_rule(normalize(program.make_prim_func(node, "k")), TARGET)[0] == rule
    lib, mod = compile_node(node)
    script = mod.script()
    assert exps(script) == script.count('T.sblock("E")') >= 1  # in the exp stage only (once per run-time variant)
    for seq in (1, 7):
        check_node(node, lib, seq, tol=1e-5)


def test_row_reduction_returns_none_where_it_does_not_apply():
    def mod_of(node):
        return normalize(program.make_prim_func(node, "k"))

    # a symbolic row width (attention's keys) and a reduction over the first dim (a column: strided rows)
    assert cpu_rules.row_reduction(mod_of(softmax_node((16, SEQ))), TARGET) is None
    col = Node.make("softmax.int", [Node.make("input", (), {"name": "x0"}, [TensorType("float32", (64, 8))])],
                    {"dim": 0, "dtype": None}, [TensorType("float32", (64, 8))])
    assert cpu_rules.row_reduction(mod_of(col), TARGET) is None
    lib, _ = compile_node(col)  # still computed, by the rules after it
    check_node(col, lib, 1)
    assert all(cpu_rules.row_reduction(mod, TARGET) is None for mod in other_kernels())


def test_fast_exp_keeps_softmax_finite_at_the_extremes():
    """fast_exp clamps its input to +-88.38: a row with -inf entries (a mask) gives ~0 there, a row of huge
    logits stays finite, as the reference does."""
    node = row_node("softmax.int", (SEQ, 64))
    lib, _ = compile_node(node)
    x = torch.randn(3, 64, generator=g)
    x[0, :32] = -float("inf")
    x[1] *= 1e4
    x[2, 5] = 1e30
    out = torch.empty_like(x)
    lib(x, out)
    torch.testing.assert_close(out, torch.softmax(x, -1), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("shape", [(96,), (1, 96)])
def test_row_reduction_on_one_core_keeps_one_serial_row(shape):
    """A 1-core target: no row split; a 1-D kernel (no row loop) keeps its blocks at the root, in order."""
    one = tvm.target.Target(dict(host_target_dict(), **{"num-cores": 1}))
    node = row_node("rms_norm", shape)
    func = program.make_prim_func(node, "k")
    assert cpu_rules.cpu_default_rule(normalize(func), one)[0] == "row_reduction"
    mod = schedule_kernel(Kernel("k", node.op, func, "key", node=node), one, None)
    assert "_rf_local" in mod.script() and "_rf_rf" not in mod.script()
    check_node(node, tvm.compile(mod, target=one)["main"], 1, tol=1e-5)


def conv_node(n, c, hw, oc, k, stride=1, pad=0, groups=1, bias=True, dtype="float32") -> Node:
    """convolution(x [n, c, h, w], w [oc, c/groups, k, k], b [oc]?) as the frontend builds it."""
    h, w = hw
    shapes = [(n, c, h, w), (oc, c // groups, k, k)] + ([(oc,)] if bias else [])
    ins = [Node.make("input", (), {"name": f"x{i}"}, [TensorType(dtype, s)]) for i, s in enumerate(shapes)]
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    attrs = {"bias": bias, "stride": [stride, stride], "padding": [pad, pad], "dilation": [1, 1],
             "transposed": False, "output_padding": [0, 0], "groups": groups}
    return Node.make("convolution", ins, attrs, [TensorType(dtype, (n, oc, oh, ow))])


@pytest.mark.parametrize("n,c,hw,oc,k,stride,pad,bias", [
    (1, 5, (11, 13), 6, 3, 1, 1, True),    # 3x3 s1, odd sizes: OW 13 a prime (the tile is the whole row), OC 6
    (2, 7, (9, 10), 12, 3, 2, 1, False),   # 3x3 s2 (strided x reads), batch 2, no bias
    (1, 9, (5, 7), 10, 1, 1, 0, True),     # 1x1 s1 (no padded copy)
    (1, 3, (23, 21), 8, 7, 2, 3, True),    # the 7x7 s2 stem: 3 input channels
    (1, 4, (34, 34), 5, 3, 1, 1, True),    # OW 34 = 2 x 17: a tile of 17 columns, OC 5 a prime
    (SEQ, 8, (6, 32), 16, 3, 1, 1, True),  # a symbolic batch (an ONNX export's dynamic batch), checked at 1 and 3
    (1, 6, (9, 11), 8, 1, 2, 0, True),     # a strided 1x1 (ResNet's downsample): x sampled once, then stride 1
    (2, 5, (7, 8), 4, 1, 2, 1, False),     # a strided 1x1 with padding: the sampled border reads zeros
])
def test_conv2d_matches_the_reference(n, c, hw, oc, k, stride, pad, bias):
    node = conv_node(n, c, hw, oc, k, stride, pad, bias=bias)
    assert cpu_rules.cpu_default_rule(normalize(program.make_prim_func(node, "k")), TARGET)[0] == "conv2d"
    lib, mod = compile_node(node)
    assert "conv_local" in mod.script()  # the register tile
    for batch in ((1, 3) if n == SEQ else (n,)):
        check_node(node, lib, batch, tol=1e-4)


def test_conv2d_bf16_accumulates_in_fp32():
    node = conv_node(1, 6, (9, 9), 8, 3, 1, 1, dtype="bfloat16")
    lib, mod = compile_node(node)
    assert "conv_local" in mod.script()
    check_node(node, lib, 1, tol=2e-2)


def test_conv2d_tile_fits_the_registers():
    avx512, avx2 = cpu_rules.Simd(16, 32), cpu_rules.Simd(8, 16)
    assert cpu_rules._conv_tile(64, 56, avx512) == (16, 14)  # OW 56: 14 columns (no tail), 16 channels
    assert cpu_rules._conv_tile(64, 112, avx512) == (16, 16)
    assert cpu_rules._conv_tile(512, 7, avx2) == (8, 7)  # 12 fit 13 free registers but do not divide 512
    assert cpu_rules._conv_tile(5, 13, avx512) == (1, 13)  # OC a prime: one channel a tile
    for oc, ow, simd in ((64, 56, avx2), (48, 28, avx2), (96, 112, avx512)):
        mr, owt = cpu_rules._conv_tile(oc, ow, simd)
        assert oc % mr == 0 and ow % owt == 0 and mr * -(-owt // simd.lanes) + 2 < simd.regs


def test_conv2d_returns_none_where_it_does_not_apply():
    def mod_of(node):
        return normalize(program.make_prim_func(node, "k"))

    # grouped and depthwise: declined, and the generic rules still compute them
    for node in (conv_node(1, 6, (7, 7), 4, 3, 1, 1, groups=2), conv_node(1, 4, (6, 6), 4, 3, 2, 1, groups=4)):
        assert cpu_rules.conv2d(mod_of(node), TARGET) is None
        lib, _ = compile_node(node)
        check_node(node, lib, 1)
    # a linear, a matmul, a row reduction, an elementwise op: not a convolution
    assert cpu_rules.conv2d(mod_of(linear_node((SEQ,), 32, 32)), TARGET) is None
    assert cpu_rules.conv2d(mod_of(mm_node("bmm", (2, 5, 8), (2, 8, 16), (2, 5, 16))), TARGET) is None
    a = te.placeholder((4, 32), name="a")
    kk = te.reduce_axis((0, 32), "k")
    assert cpu_rules.conv2d(normalize(te.create_prim_func([a, te.compute((4,), lambda i: te.sum(a[i, kk], axis=kk))])),
                            TARGET) is None
    assert cpu_rules.conv2d(normalize(te.create_prim_func([a, te.compute((4, 32), lambda i, j: a[i, j] * 2.0)])),
                            TARGET) is None


def scale_shift_node(shape, scale_shape) -> Node:
    """relu(x * scale + shift + r): BatchNorm folded by the ONNX importer, a residual add and a relu, as the fuse
    pass makes them one ``fused`` node (scale and shift [C, 1, 1] against x [N, C, H, W]: broadcast along rows)."""
    shapes = [shape, scale_shape, scale_shape, shape]
    ins = [Node.make("input", (), {"name": f"x{i}"}, [TensorType("float32", s)]) for i, s in enumerate(shapes)]
    body = (("mul.Tensor", (0, 1), (), "float32", shape), ("add.Tensor", (4, 2), (("alpha", 1),), "float32", shape),
            ("add.Tensor", (5, 3), (("alpha", 1),), "float32", shape), ("relu", (6,), (), "float32", shape))
    return Node.make("fused", ins, {"body": body}, [TensorType("float32", shape)])


@pytest.mark.parametrize("shape,scale", [
    ((1, 8, 7, 56), (8, 1, 1)),     # a row of 56: vectorised whole
    ((2, 3, 5, 96), (3, 1, 1)),     # a row of 96: in runs of 16
    ((SEQ, 6, 9, 13), (6, 1, 1)),   # a symbolic batch, a row of 13
])
def test_elementwise_rows_matches_the_reference(shape, scale):
    node = scale_shift_node(shape, scale)
    assert cpu_rules.cpu_default_rule(normalize(program.make_prim_func(node, "k")), TARGET)[0] == "elementwise_rows"
    lib, _ = compile_node(node)
    for seq in (1, 2):
        ins = [torch.randn(*[seq if d == SEQ else d for d in i.type.shape], generator=g) for i in node.inputs]
        out = torch.empty_like(ins[0])
        lib(*ins, out)
        torch.testing.assert_close(out, torch.relu(ins[0] * ins[1] + ins[2] + ins[3]))


def test_elementwise_rows_returns_none_where_it_does_not_apply():
    def rule(node):
        return cpu_rules.elementwise_rows(normalize(program.make_prim_func(node, "k")), TARGET)

    assert rule(scale_shift_node((1, 4, 6, 67), (4, 1, 1))) is None  # a prime row over 64: no vector run
    assert rule(scale_shift_node((1, 4, 6, 3), (4, 1, 1))) is None    # a row shorter than 4
    a, b = te.placeholder((4, 32), name="a"), te.placeholder((32,), name="b")
    kk = te.reduce_axis((0, 32), "k")
    assert cpu_rules.elementwise_rows(normalize(te.create_prim_func(  # no broadcast along the row
        [a, b, te.compute((4, 32), lambda i, j: a[i, j] * b[j])])), TARGET) is None
    assert cpu_rules.elementwise_rows(normalize(te.create_prim_func(  # a reduction
        [a, te.compute((4,), lambda i: te.sum(a[i, kk], axis=kk))])), TARGET) is None
    assert rule(conv_node(1, 4, (6, 6), 4, 3, 1, 1)) is None  # a convolution (its bias broadcasts, but it reduces)


@pytest.mark.parametrize("n,c,hw,oc", [
    (1, 131, (5, 9), 6),      # a prime channel count, OW 9
    (SEQ, 128, (4, 12), 8),   # a symbolic batch
])
def test_conv2d_wide_1x1_packs_x_and_matches_the_reference(n, c, hw, oc):
    node = conv_node(n, c, hw, oc, 1)
    lib, mod = compile_node(node)
    assert "_global" in mod.script() and "conv_local" in mod.script()  # x's column run packed; the register tile
    for batch in ((1, 2) if n == SEQ else (n,)):
        check_node(node, lib, batch, tol=1e-4)
    narrow = conv_node(1, 64, (5, 9), 6, 1)  # 64 input channels: no packing (x's rows stay in L1)
    assert "_global" not in cpu_rules.conv2d(normalize(program.make_prim_func(narrow, "k")), TARGET).script()


@pytest.mark.skipif(not tvm.target.codegen.target_has_features(["avx2"], TARGET), reason="host without AVX2")
def test_conv2d_on_an_avx2_target_gets_avx2_tiles_that_compute_the_reference():
    """8 lanes and 16 registers: a 3x3 s2 of OW 12 takes 6-column tiles (12's widest divisor up to 8) and 12
    output channels (12 x 1 accumulators + a loaded vector + the broadcast weight fit 16 registers)."""
    node = conv_node(1, 5, (11, 24), 24, 3, 2, 1)
    func = program.make_prim_func(node, "k")
    mod = schedule_kernel(Kernel("k", "convolution", func, "key", node=node), AVX2, None)
    assert "T.vectorized(T.int64(6))" in mod.script() and "T.unroll(T.int64(12))" in mod.script()
    check_node(node, tvm.compile(mod, target=AVX2)["main"], 1)
