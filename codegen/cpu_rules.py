"""The rule-based default tier for CPU: ordered schedule rules, each returning None where it does not apply.

    dense_linear (x[.., k] . w[n, k])  ->  batched_matmul (a[.., m, k] . b[.., k, n])  ->  conv2d (NCHW)
    ->  row_reduction (softmax / norms: reductions over the last axis + an element-wise output)
    ->  dlight_reduction  ->  elementwise_rows (a row-broadcast operand)  ->  parallel_loops (the generic, last)

A rule takes the normalised kernel (an ``IRModule`` with ``main``) and the target and returns a scheduled module,
or None: "not mine". Whether a loop a rule marks parallel really runs on the thread pool is decided afterwards,
from the kernel's work, by ``parallel.py``. Vector width and register count come from the target (``Simd``:
AVX-512 16 fp32 lanes and 32 registers, AVX2 8 and 16), and the register tiles from them.

``dense_linear`` takes the ``linear`` lowering (``codegen/lower/linear.py``): a block ``C[.., m, n] +=
cast(X[.., m, k]) * cast(W[n, k])`` with float32 or bfloat16 inputs and a float32 accumulator, optionally followed
by elementwise epilogues (bias, cast). Two schedules, by the row count M (T; a symbol in prefill):

* few rows (GEMV, small GEMM): dot-product tiles. X and W are both contiguous along k, so k is vectorised: an
  MR x NR tile (4 x 4 on AVX-512; 1 x 8 for one row) keeps MR x NR vectors of partial sums, every loaded vector
  shared by 4 FMAs, summed across lanes once at the end; NB tiles of w per parallel task reuse the x tile::

    for nbo in parallel(N / (NB*NR)):  for mo in range(M / MR):  for nbi in range(NB):
        acc[MR, NR, LANES] = 0                                            # registers
        for ko in range(K / LANES):  acc[mi, ni, :] += X[mo*MR+mi, ko*LANES:+LANES] * W[.., ko*LANES:+LANES]
        C[mo*MR+mi, ..] = sum(acc[mi, ni, :])

* many rows (M >= PACK_MIN_ROWS): the packed GEMM. Per parallel task (NW = two vectors of output features) and k
  block of 256, w is packed to ``Wp[256, NW]`` (n contiguous, L1) and each of 12 x rows is broadcast against the
  two vectors of a Wp row; the 12 x NW tile of C stays in registers across the k block (the dot-product tile
  reads 4x the bytes per FMA from L2 and topped out at ~95 GFLOP/s a core here; this one at ~120, torch ~160).

Rows are padded to a multiple of the tile's MR (``pad_einsum``: a padded copy of the x tile, the tail rows of C
dropped), so no loop in the k loop has a predicate (a predicated split ran at half speed). A symbolic M gets both
schedules in one kernel, chosen at run time on M (``parallel.either``). K must take a lane width (4 at least) and
N, for the packed GEMM, a multiple of NW; otherwise the rule falls back to fewer lanes / the dot-product tiles / None.

``row_reduction`` takes a row's reductions (sum / max / min over the last axis, read contiguously, with any
element-wise prologue) and the element-wise output that reads them, per row::

    for row in parallel(rows):                                   # or, rows < cores: the row split over cores
        acc[ACCS*LANES] = init;  for ko in range(W / (ACCS*LANES)):  acc[:] op= f(x[row, ko*ACCS*LANES:+..])
        red[row] = reduce(acc)                                   # one per reduction, in order
        for jo in range(W / LANES):  out[row, jo*LANES:+LANES] = g(x[row, ..], red[row], ..)

with ``exp`` as TOPI's vectorising polynomial. A symbolic row width (attention's keys) goes on to dlight.

``batched_matmul`` takes mm / bmm / matmul (attention's scores and weighted sum when not hand-scheduled): B is
[.., k, n], already n contiguous, so the broadcast tile of the packed GEMM runs without packing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
import tvm.sym
import tvm_ffi
from tvm.ir.expr import Call, TensorLoad

from .parallel import cores_of, either, work, work_at

logger = logging.getLogger(__name__)

NR_GEMM = (4, 2, 1)  # w rows per dot-product tile: MR x NR accumulators of LANES floats (the widest dividing N)
NR_GEMV = (8, 4, 2, 1)  # w rows per tile of a one-row GEMV: NR accumulators, every x vector shared by NR FMAs
NB_CHOICES = (16, 8, 4, 2, 1)  # w tiles per parallel task (dot-product tiles): the x tile stays in L1 across them
PACK_KB = 256  # packed GEMM: k block (Wp[256, NW] fp32 = 32 KiB at NW = 32: L1)
PACK_MIN_ROWS = 64  # rows from which the packed GEMM pays for its packing (measured: 0.89x eager at 64 rows)
INPUT_DTYPES = ("float32", "bfloat16")
# what a schedule primitive raises on a kernel it cannot take (TVM's errors arrive as these Python types); a rule
# that raises one does not apply. (``tvm.error.TVMError``, named here before, does not exist in TVM 0.27: the
# except clause itself raised, and the kernel fell past every later rule to the generic loops.)
# conv2d: a 1x1 convolution packs x's column run per task (``[IC, OWT]``, read by every oc tile from L1) from
# this many input channels (256-channel 1x1s at 56x56: 1.9 -> 1.3 ms; at 64 channels the strided x rows stayed in
# L1 and packing cost 15%), while its weights stay in L2 (they are re-read once per task)
PACKED_1X1_MIN_IC = 128
PACKED_1X1_MAX_W_BYTES = 1 << 20
RULE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, tvm.error.InternalError)


@dataclass(frozen=True)
class Simd:
    """The target's fp32 vector width and vector register count, and the register tiles they give."""
    lanes: int  # fp32 lanes per vector: 16 (AVX-512), 8 (AVX2), 4 (SSE / NEON)
    regs: int  # vector registers: 32 (AVX-512, NEON), 16 (AVX2)

    @staticmethod
    def of(target: tvm.target.Target) -> Simd:
        from tvm.target.codegen import target_has_features

        def has(feature):
            try:
                return bool(target_has_features([feature], target))
            except Exception:  # noqa: BLE001 - a target LLVM knows no x86 features of (aarch64): none
                return False
        if has("avx512f"):
            return Simd(16, 32)
        if has("avx2") or has("avx"):
            return Simd(8, 16)
        return Simd(4, 32 if "aarch64" in str(target.attrs.get("mtriple", "")) else 16)

    @property
    def lane_choices(self) -> tuple[int, ...]:
        """Lane widths for k-vectorised partial sums, widest first (the widest dividing K is taken)."""
        return tuple(v for v in (16, 8, 4) if v <= self.lanes)

    @property
    def dot_mr(self) -> int:
        """x rows per dot-product tile: 4 x 4 accumulators + 8 loaded vectors fit 32 registers, 2 x 4 + 6 fit 16."""
        return 4 if self.regs >= 32 else 2

    @property
    def bcast_mr(self) -> int:
        """x rows per broadcast tile (packed GEMM, batched_matmul): 2 accumulators a row, plus 2 w vectors and the
        broadcast x: 12 rows in 32 registers, 6 in 16."""
        return 12 if self.regs >= 32 else 6

    @property
    def bcast_widths(self) -> tuple[int, int]:
        """Columns per broadcast tile: two vectors (the packed width), or one."""
        return 2 * self.lanes, self.lanes


def _strip_cast(e):
    while isinstance(e, tvm.tirx.Cast):
        e = e.value
    return e


def _var_of(e):
    """The block iterator an index is (None for any other expression)."""
    return e if isinstance(e, tvm.tirx.Var) else None


def _same(a, b) -> bool:
    return a is not None and b is not None and a.same_as(b)


def _product_reduction(sch, block_rv):
    """(iterators, a load, b load) when the block is ``C[..] += cast(a[..]) * cast(b[..])`` over spatial
    iterators and one reduction iterator, last, with fp32 / bf16 inputs and a fp32 accumulator; else None."""
    block = sch.get(block_rv)
    iters = list(block.iter_vars)
    kinds = [iv.iter_type for iv in iters]
    if len(iters) < 3 or kinds[-1] != tvm.tirx.IterVar.CommReduce or any(
            k != tvm.tirx.IterVar.DataPar for k in kinds[:-1]):
        return None
    body = block.body
    if not isinstance(body, tvm.tirx.BufferStore) or block.init is None:
        return None
    if body.buffer.dtype != "float32" or not isinstance(body.value, tvm.tirx.Add):
        return None
    acc, prod = body.value.a, body.value.b
    if not (isinstance(acc, TensorLoad) and acc.source.same_as(body.buffer)):
        return None
    if isinstance(prod, Call) and prod.op.name == "tirx.if_then_else":  # a masked reduction (extent 0)
        return None
    if not isinstance(prod, tvm.tirx.Mul):
        return None
    x, w = _strip_cast(prod.a), _strip_cast(prod.b)
    if not (isinstance(x, TensorLoad) and isinstance(w, TensorLoad)):
        return None
    if x.source.dtype not in INPUT_DTYPES or w.source.dtype not in INPUT_DTYPES:
        return None
    return iters, x, w


def _dense_block(sch, block_rv):
    """(N, K, W buffer) when the block is ``C[lead.., n] += cast(X[lead.., k]) * cast(W[n, k])`` with fp32/bf16
    inputs and a fp32 accumulator and static N and K; else None."""
    found = _product_reduction(sch, block_rv)
    if found is None:
        return None
    iters, x, w = found
    lead, n, k = [iv.var for iv in iters[:-2]], iters[-2].var, iters[-1].var
    xi, wi = [_var_of(i) for i in x.indices], [_var_of(i) for i in w.indices]
    if len(wi) != 2 or not (_same(wi[0], n) and _same(wi[1], k)):
        return None
    if len(xi) != len(lead) + 1 or not _same(xi[-1], k) or not all(_same(a, b) for a, b in zip(xi, lead)):
        return None
    if not all(isinstance(iv.dom.extent, tvm.tirx.IntImm) for iv in iters[-2:]):
        return None
    return int(iters[-2].dom.extent), int(iters[-1].dom.extent), w.source


def _tile(m_extent, n_extent: int, simd: Simd) -> tuple[int, int, int]:
    """(MR x rows, NR w rows, NB w tiles per task) for a dense block of ``m_extent`` rows (an int, or a symbolic
    expression) and ``n_extent`` output features."""
    mr = 1 if isinstance(m_extent, int) and m_extent == 1 else simd.dot_mr
    nr = next(v for v in (NR_GEMV if mr == 1 else NR_GEMM) if n_extent % v == 0)
    nb = next(v for v in NB_CHOICES if (n_extent // nr) % v == 0)
    return mr, nr, nb


def _match(sch, simd: Simd):
    """(dense block, epilogue blocks, N, K, lanes, W buffer) when the kernel is one dense block of the ``linear``
    form plus elementwise epilogues and K takes a lane width; else None."""
    one = _one_block(sch, _dense_block)
    if one is None:
        return None
    blocks, block, (n_extent, k_extent, w_buf) = one
    lanes = next((v for v in simd.lane_choices if k_extent % v == 0), None)
    if lanes is None:
        return None
    others = [b for b in blocks if not b.same_as(block)]
    if any(sch.get(b).init is not None for b in others):  # only elementwise epilogues
        return None
    return block, others, n_extent, k_extent, lanes, w_buf


def _rows(sch, block):
    """The dense block's row count (its last leading iterator's extent): an int, or a symbolic expression."""
    dom = sch.get(block).iter_vars[-3].dom.extent
    return int(dom) if isinstance(dom, tvm.tirx.IntImm) else dom


def _pad_rows(sch, block, mr: int) -> bool:
    """Rows padded to a multiple of ``mr`` (X_pad with zero rows, C_pad whose tail rows are dropped), so no loop
    of the tile has a predicate; False when they already are one."""
    rows = _rows(sch, block)
    if mr == 1 or (isinstance(rows, int) and rows % mr == 0):
        return False
    sch.pad_einsum(block, [1] * (len(sch.get(block).iter_vars) - 3) + [mr, 1, 1])
    return True


def _parallel_epilogues(sch, blocks) -> None:
    for b in blocks:
        ls = sch.get_loops(b)
        sch.parallel(sch.fuse(*ls) if len(ls) > 1 else ls[0])


def _dot_tiles(mod: tvm.IRModule, simd: Simd) -> tvm.IRModule:
    """The dot-product tiles (GEMV, small GEMM): k vectorised in LANES partial sums, an MR x NR register tile."""
    sch = tvm.s_tir.Schedule(mod)
    block, others, n_extent, _, lanes, _ = _match(sch, simd)
    mr, nr, nb = _tile(_rows(sch, block), n_extent, simd)
    padded = _pad_rows(sch, block, mr)
    n_lead = len(sch.get(block).iter_vars) - 3
    k = sch.get_loops(block)[-1]
    ko, ki = sch.split(k, [None, lanes])
    rf = sch.rfactor(ki, factor_axis=n_lead + 2)  # the partial sums [.., m, n, lanes]: lanes contiguous
    *outer, m, n, ko, ki = sch.get_loops(rf)
    nbo, nbi, ni = sch.split(n, [None, nb, nr])
    mo, mi = sch.split(m, [None, mr])
    sch.reorder(nbo, *outer, mo, nbi, ko, mi, ni, ki)
    sch.vectorize(ki)
    sch.unroll(mi)
    sch.unroll(ni)
    sch.reverse_compute_at(block, nbi)
    lanes_loop, *outputs = _below(sch, block, nbi)
    sch.reorder(*outputs, lanes_loop)  # each output sums its lanes at once
    sch.set_scope(rf, 0, "local")
    if padded:
        x_pad = sch.get_producers(rf)[0]
        sch.compute_at(x_pad, mo)  # the tile's MR x rows, copied once and reused by the NB w tiles
        sch.vectorize(sch.split(sch.get_loops(x_pad)[-1], [None, lanes])[1])
        sch.reverse_compute_at(sch.get_consumers(block)[0], nbi)
    sch.parallel(nbo)
    sch.decompose_reduction(rf, ko)  # the accumulators' zeroing, before the k loop
    _parallel_epilogues(sch, others)
    return sch.mod


def _packed_tiles(mod: tvm.IRModule, simd: Simd) -> tvm.IRModule:
    """The packed GEMM (many rows): per task and k block, w packed into ``Wp[KB, NW]`` (n contiguous, NW two
    vectors); each of MR x rows (``simd.bcast_mr``) broadcast against the two vectors of a Wp row; the MR x NW
    tile of C stays in registers across the k block."""
    sch = tvm.s_tir.Schedule(mod)
    block, others, n_extent, k_extent, lanes, w_buf = _match(sch, simd)
    mr, nw = simd.bcast_mr, simd.bcast_widths[0]
    padded = _pad_rows(sch, block, mr)
    kb = max(d for d in range(1, PACK_KB + 1) if k_extent % d == 0)
    w_read = next(i for i, r in enumerate(sch.get(block).reads) if r.source.same_as(w_buf))
    wp = sch.cache_read(block, w_read, "global")
    sch.transform_layout(wp, ("write", 0), lambda n, k: (n // nw, k, n % nw))
    *outer, m, n, k = sch.get_loops(block)
    no, ni = sch.split(n, [None, nw])
    mo, mi = sch.split(m, [None, mr])
    ko, ki = sch.split(k, [None, kb])
    sch.reorder(no, *outer, ko, mo, ki, mi, ni)
    sch.vectorize(ni)
    sch.unroll(mi)
    sch.compute_at(wp, ko)
    sch.parallel(no)
    if padded:
        x_pad, c_pad = sch.get_producers(block)[0], sch.get_consumers(block)[0]
        _parallel_epilogues(sch, [x_pad])
        sch.reverse_compute_at(c_pad, no)
    sch.decompose_reduction(block, ko)
    _parallel_epilogues(sch, others)
    return sch.mod


def dense_linear(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule | None:
    """GEMM / GEMV of the ``linear`` form (module docstring): the dot-product tiles below PACK_MIN_ROWS rows, the
    packed GEMM from there (a symbolic row count gets both, chosen at run time); None when the kernel is not one
    block of that form plus elementwise epilogues."""
    simd = Simd.of(target)
    sch = tvm.s_tir.Schedule(mod)
    found = _match(sch, simd)
    if found is None:
        return None
    block, _, n_extent, *_ = found
    rows = _rows(sch, block)
    if n_extent % simd.bcast_widths[0] or (isinstance(rows, int) and rows < PACK_MIN_ROWS):
        return _dot_tiles(mod, simd)
    if isinstance(rows, int):
        return _packed_tiles(mod, simd)
    packed, dot = _packed_tiles(mod, simd)["main"], _dot_tiles(mod, simd)["main"]
    return tvm.IRModule({"main": either(rows >= PACK_MIN_ROWS, packed, dot)})


def _kn_block(sch, block_rv, widths: tuple[int, ...]):
    """N when the block is ``C[lead.., m, n] += cast(A[lead'.., m, k]) * cast(B[lead''.., k, n])`` (mm / bmm /
    matmul: B's rows along k, n contiguous; A's and B's leading indices the block's or 0, broadcast) with fp32 /
    bf16 inputs, a fp32 accumulator and a static N that a vector width divides; else None."""
    found = _product_reduction(sch, block_rv)
    if found is None:
        return None
    iters, a, b = found
    lead, m, n, k = [iv.var for iv in iters[:-3]], iters[-3].var, iters[-2].var, iters[-1].var
    if len(a.indices) < 2 or len(b.indices) < 2:
        return None
    if not (_same(_var_of(a.indices[-2]), m) and _same(_var_of(a.indices[-1]), k)
            and _same(_var_of(b.indices[-2]), k) and _same(_var_of(b.indices[-1]), n)):
        return None
    for t in (a, b):
        extra = list(t.indices[:-2])
        if len(extra) > len(lead):
            return None
        for i, v in zip(extra, lead[len(lead) - len(extra):]):
            if not (_same(_var_of(i), v) or (isinstance(i, tvm.tirx.IntImm) and i.value == 0)):
                return None
    if not isinstance(iters[-2].dom.extent, tvm.tirx.IntImm):
        return None
    n_extent = int(iters[-2].dom.extent)
    return n_extent if n_extent % min(widths) == 0 else None


def batched_matmul(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule | None:
    """mm / bmm / matmul with B laid out [k, n] (attention's scores against a transposed K, its weighted sum of
    V): B's rows are already n contiguous, so no packing: an MR x NW tile of C in registers across the whole
    k loop (``simd.bcast_mr`` rows, NW one or two vectors), each A element broadcast against a B row; rows
    padded to MR (no predicate); the batch and column tiles are the parallel loop. None for any other kernel."""
    simd = Simd.of(target)
    sch = tvm.s_tir.Schedule(mod)
    blocks = sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []
    found = [(blk, _kn_block(sch, blk, simd.bcast_widths)) for blk in blocks]
    found = [(blk, n) for blk, n in found if n is not None]
    if len(found) != 1:
        return None
    block, n_extent = found[0]
    others = [blk for blk in blocks if not blk.same_as(block)]
    if any(sch.get(blk).init is not None for blk in others):  # only elementwise epilogues
        return None
    nw, mr = next(v for v in simd.bcast_widths if n_extent % v == 0), simd.bcast_mr
    padded = _pad_rows(sch, block, mr)
    *outer, m, n, k = sch.get_loops(block)
    no, ni = sch.split(n, [None, nw])
    mo, mi = sch.split(m, [None, mr])
    sch.reorder(*outer, no, mo, k, mi, ni)
    sch.vectorize(ni)
    sch.unroll(mi)
    task = sch.fuse(*outer, no) if outer else no
    sch.parallel(task)
    if padded:
        x_pad, c_pad = sch.get_producers(block)[0], sch.get_consumers(block)[0]
        if len(sch.get_producers(block)) > 1:  # B padded too? (only rows are): not expected
            return None
        sch.compute_at(x_pad, mo)
        sch.reverse_compute_at(c_pad, mo)
    sch.decompose_reduction(block, k)
    _parallel_epilogues(sch, others)
    return sch.mod


ROW_OUT_UNROLL = 4  # output vectors per step of a row (independent exp chains: 16x4096 softmax 46 -> 38 us a core)
ROW_ACCS = (4, 2, 1)  # vector accumulators per row reduction (4 hide the add's latency), the most dividing the row


def _loads(expr) -> list:
    found = []
    tvm_ffi.structural_walk(expr, [(TensorLoad, found.append)])
    return found


def _uses(expr, var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.tirx.Var, lambda v: found.append(v) if v.same_as(var) else None)])
    return bool(found)


def _contiguous_along(block, var) -> bool:
    """Every read of ``block`` that ``var`` indexes has it in its last index only, as ``var + (terms without
    var)`` (a vector of consecutive ``var`` is one contiguous load), and so has its write when ``var`` is
    spatial."""
    loads = _loads(block.body.value) + ([block.body] if any(iv.var.same_as(var) and
                                                                 iv.iter_type == tvm.tirx.IterVar.DataPar
                                                                 for iv in block.iter_vars) else [])
    for ld in loads:
        if not ld.indices:  # a scalar
            continue
        if any(_uses(i, var) for i in ld.indices[:-1]):
            return False
        if _uses(ld.indices[-1], var) and _uses(tvm.sym.Analyzer().simplify(ld.indices[-1] - var), var):
            return False
    return True


def _row_blocks(sch):
    """(reduction blocks, row maps, output block, leading dims s) when the kernel is row reductions over its last
    axis (``S.. R`` each, sum / max / min, reading rows contiguously; keepdim's unit dims allowed) and row maps
    (element-wise ``S^(s+1)`` blocks kept as buffers: softmax's exp) feeding one element-wise output block
    (``S^(s+1)``) over the same rows and row width; else None."""
    blocks = sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []
    if len(blocks) < 2:
        return None
    *inner, out = blocks
    maps = [b for b in inner if sch.get(b).init is None]
    reds = [b for b in inner if sch.get(b).init is not None]
    if not reds:
        return None
    out_b = sch.get(out)
    s = len(out_b.iter_vars) - 1
    if s < 0 or out_b.init is not None or not isinstance(out_b.body, tvm.tirx.BufferStore):
        return None
    if any(iv.iter_type != tvm.tirx.IterVar.DataPar for iv in out_b.iter_vars):
        return None
    if not _contiguous_along(out_b, out_b.iter_vars[-1].var) or len(sch.get_loops(out)) != s + 1:
        return None
    ana = tvm.sym.Analyzer()

    def rows_of(ivs):
        return [iv.dom.extent for iv in ivs if not (isinstance(iv.dom.extent, tvm.tirx.IntImm)
                                                    and iv.dom.extent.value == 1)]
    rows, width = rows_of(out_b.iter_vars[:-1]), out_b.iter_vars[-1].dom.extent
    for blk_rv in inner:  # each over the output's rows and row width: a reduction of it, or a map (every dim)
        b = sch.get(blk_rv)
        ivs, reduces = b.iter_vars, b.init is not None
        if (not isinstance(b.body, tvm.tirx.BufferStore) or len(sch.get_loops(blk_rv)) != len(ivs)
                or ivs[-1].iter_type != (tvm.tirx.IterVar.CommReduce if reduces else tvm.tirx.IterVar.DataPar)
                or any(iv.iter_type != tvm.tirx.IterVar.DataPar for iv in ivs[:-1])
                or (not reduces and len(ivs) != len(out_b.iter_vars))
                or len(rows_of(ivs[:-1])) != len(rows)
                or not all(ana.can_prove_equal(a, c) for a, c in zip(rows_of(ivs[:-1]), rows))
                or not ana.can_prove_equal(ivs[-1].dom.extent, width)
                or not _contiguous_along(b, ivs[-1].var)):
            return None
    return reds, maps, out, s


def fast_exp(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """Every float32 ``exp`` of ``func`` as TOPI's ``fast_exp`` (range reduction + a degree-5 polynomial, ~2e-7
    relative error, inputs clamped to +-88.38): it vectorises, where LLVM calls the scalar ``expf`` for each lane
    of a vector ``exp`` (measured here: 5.6 ns vs 0.7 ns an element)."""
    from tvm import te, topi

    p = te.placeholder((1,), "float32", name="p")
    x = tvm.tirx.Var("x", "float32")
    template = tvm_ffi.structural_mutate(topi.fast_exp(p).op.body[0], [
        (Call, lambda c, m: x if c.op.name == "te.tensor_load" else m.default_mutate(c))])
    exp = tvm.ir.Op.get("tirx.exp")

    def on_call(c, m):
        if not (c.op.same_as(exp) and c.ty.dtype == "float32"):
            return m.default_mutate(c)
        v = tvm.tirx.Var("x", "float32")
        return tvm.tirx.Let(v, m.mutate(c.args[0]), tvm_ffi.structural_mutate(template, [
            (tvm.tirx.Var, lambda e, _: v if e.same_as(x) else e)]))
    return func.with_body(tvm_ffi.structural_mutate(func.body, [(Call, on_call)]))


def _row_factor(width: int, lanes: int) -> int:
    """Elements per step of a row reduction: ROW_ACCS vectors, the most whose product divides the width at
    least twice, else the widest power of two that does (1 for an odd width: a serial reduction). (A predicated
    tail does not survive: ``compute_at`` regenerates the partial sums' loops without the split's predicate.)"""
    for f in [accs * lanes for accs in ROW_ACCS] + [v for v in (8, 4, 2) if v < lanes]:
        if width % f == 0 and width >= 2 * f:
            return f
    return 1


def _vector_partials(sch, rf, anchor, lanes: int) -> None:
    """An rfactor block's partial sums in registers: its lanes loop innermost, as vectors (unrolled over the
    accumulators), zeroed before the reduction loop. Its two loops under ``anchor`` are the ones ``compute_at``
    regenerated, in its iterators' order (all its loops when there is no anchor: a 1-D kernel's rfactor keeps the
    split's order); the lanes iterator is the last index of the partials it writes."""
    blk = sch.get(rf)
    lane_var = blk.writes[0].region[-1].min
    inner = [iv for iv in blk.iter_vars if iv.iter_type == tvm.tirx.IterVar.CommReduce or iv.var.same_as(lane_var)]
    loops = [lp for lp in (_below(sch, rf, anchor) if anchor is not None else sch.get_loops(rf))
             if not _unit(sch.get(lp).extent)]
    if len(loops) != 2 or len(inner) != 2:
        raise ValueError(f"partial sums {blk.name_hint}: {len(loops)} loops under the row, not 2")
    ko, ki = loops if anchor is None or inner[0].iter_type == tvm.tirx.IterVar.CommReduce else loops[::-1]
    sch.reorder(ko, ki)
    acc, vec = sch.split(ki, [None, lanes])
    sch.unroll(acc)
    sch.vectorize(vec)
    sch.set_scope(rf, 0, "local")
    sch.decompose_reduction(rf, ko)


def _unit(extent) -> bool:
    return isinstance(extent, tvm.tirx.IntImm) and extent.value == 1


def row_reduction(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule | None:
    """Row reductions with their element-wise prologue / epilogue (softmax, RMSNorm, layer norm, their fused
    kernels): each reduction over the row's last axis in ACCS x LANES vector partial sums (``rfactor``, registers),
    summed across lanes once a row; the output's row vectorised; all of a row's blocks under one row loop, which
    is the parallel one (kept parallel by ``parallel.py`` where the work pays). Fewer rows than cores with a
    static count (one row: decode's vocabulary softmax): each row is split across the cores instead, every
    reduction as per-core partials (a second ``rfactor``) and the output's row in core-sized pieces. ``exp`` is
    TOPI's vectorising ``fast_exp``. None for any other kernel."""
    simd = Simd.of(target)
    sch = tvm.s_tir.Schedule(mod)
    found = _row_blocks(sch)
    if found is None:
        return None
    reds, maps, out, s = found
    width = sch.get(out).iter_vars[-1].dom.extent
    if not isinstance(width, tvm.tirx.IntImm):
        return None  # a symbolic row (attention's keys): dlight's rule
    width = int(width)
    rows = 1
    for iv in sch.get(out).iter_vars[:-1]:
        rows = rows * iv.dom.extent
    rows = tvm.sym.Analyzer().simplify(rows) if s else tvm.tirx.const(1, "int64")
    cores = max(1, cores_of(target))
    split_rows = (isinstance(rows, tvm.tirx.IntImm) and int(rows) < cores and width % cores == 0
                  and _row_factor(width // cores, simd.lanes) > 1)
    factor = _row_factor(width // cores if split_rows else width, simd.lanes)
    lanes = min(factor, simd.lanes)
    rfs, cores_rfs = [], []
    for r in reds if factor > 1 else ():  # an odd width: serial reductions, the output still vectorised
        *lead, k = sch.get_loops(r)
        if split_rows:
            kp, ko, ki = sch.split(k, [cores, None, factor])
            rf_core = sch.rfactor(kp, factor_axis=len(lead))  # per-core partials [rows.., cores]
            cores_rfs.append(rf_core)
            ki = sch.get_loops(rf_core)[-1]
            rfs.append(sch.rfactor(ki, factor_axis=len(lead) + 1))  # per core, its vector partials [.., cores, F]
        else:
            ko, ki = sch.split(k, [None, factor])
            rfs.append(sch.rfactor(ki, factor_axis=len(lead)))  # vector partials [rows.., F]
    loops = sch.get_loops(out)
    row = sch.fuse(*loops[:s]) if s > 1 else (loops[0] if s else None)
    if split_rows:
        return _split_row_schedule(sch, out, maps, rfs, cores_rfs, cores, lanes)
    unroll = ROW_OUT_UNROLL if width % (ROW_OUT_UNROLL * simd.lanes) == 0 else 1

    def vectorize_row(col):
        _, unr, vec = sch.split(col, [None, unroll, simd.lanes])
        sch.vectorize(vec)
        sch.unroll(unr)
    vectorize_row(loops[-1])
    if row is not None:  # a 1-D kernel (one row, serial): its blocks stay at the root, one after the other
        for b in reversed(sch.get_child_blocks(sch.get_sblock("root"))[:-1]):
            sch.compute_at(b, row)
        sch.parallel(row)
    for m in maps:  # under the row, its buffer one row (compacted), written by vectors
        vectorize_row(sch.get_loops(m)[-1])
    for rf in rfs:
        _vector_partials(sch, rf, row, lanes)
    return tvm.IRModule({"main": fast_exp(sch.mod["main"])})


def _split_row_schedule(sch, out, maps, rfs, cores_rfs, cores: int, lanes: int) -> tvm.IRModule:
    """Few rows: per reduction, each core's vector partials (``rfs``) computed under its task of the per-core
    partials (``cores_rfs``), the cores' results combined serially; the output's row and each row map's in
    ``cores`` parallel pieces of vectors."""
    for b in [*maps, out]:
        task, _, vec = sch.split(sch.get_loops(b)[-1], [cores, None, lanes])
        sch.vectorize(vec)
        sch.parallel(task)
    cores_loops = []
    for rf, rf_core in zip(rfs, cores_rfs):
        core = sch.get_loops(rf_core)[-2]
        sch.compute_at(rf, core)
        sch.parallel(core)
        cores_loops.append(core)
    for rf, core in zip(rfs, cores_loops):
        _vector_partials(sch, rf, core, lanes)
    return tvm.IRModule({"main": fast_exp(sch.mod["main"])})


def _conv_block(sch, block_rv):
    """(OC, OW, X buffer) when the block is a 2-D convolution ``C[n, oc, oh, ow] += cast(X[n, rc, oh*s + kh*d, ow*s + kw*d])
    * cast(W[oc, rc, kh, kw])`` (or X's row split into its stride's phases, ``X[n, rc, oh*s + kh*d, kw*d % s,
    ow + kw*d // s]``) (no groups: X's channel is the reduction's own) with fp32 / bf16 inputs, a fp32
    accumulator and static extents but the batch; else None."""
    block = sch.get(block_rv)
    iters = list(block.iter_vars)
    kinds = [iv.iter_type for iv in iters]
    if len(iters) != 7 or kinds != [tvm.tirx.IterVar.DataPar] * 4 + [tvm.tirx.IterVar.CommReduce] * 3:
        return None
    if not all(isinstance(iv.dom.extent, tvm.tirx.IntImm) for iv in iters[1:]):  # the batch may be a symbol
        return None
    body = block.body
    if not isinstance(body, tvm.tirx.BufferStore) or block.init is None or body.buffer.dtype != "float32":
        return None
    if not isinstance(body.value, tvm.tirx.Add) or not isinstance(body.value.b, tvm.tirx.Mul):
        return None
    acc, prod = body.value.a, body.value.b
    if not (isinstance(acc, TensorLoad) and acc.source.same_as(body.buffer)):
        return None
    x, w = _strip_cast(prod.a), _strip_cast(prod.b)
    if not (isinstance(x, TensorLoad) and isinstance(w, TensorLoad)) or len(x.indices) < 4 or len(w.indices) != 4:
        return None
    if x.source.dtype not in INPUT_DTYPES or w.source.dtype not in INPUT_DTYPES:
        return None
    n, oc, _, _, rc, kh, kw = [iv.var for iv in iters]
    if not all(_same(_var_of(i), v) for i, v in zip(w.indices, (oc, rc, kh, kw))):
        return None
    if not (_same(_var_of(x.indices[0]), n) and _same(_var_of(x.indices[1]), rc)):
        return None  # grouped / depthwise: X's channel depends on oc (declined: the generic loops take it)
    return int(iters[1].dom.extent), int(iters[3].dom.extent), x.source


def _conv_tile(oc: int, ow: int, simd: Simd) -> tuple[int, int]:
    """(MR output channels, OWT output columns) of the register tile: OWT the widest divisor of OW up to two
    vectors (no tail, no predicate: 56 -> 28, 7 -> 7), MR the most output channels dividing OC whose MR x
    vectors(OWT) accumulators leave registers for the loaded x vectors and the broadcast weight."""
    owt = max(d for d in range(1, min(ow, simd.lanes) + 1) if ow % d == 0)
    vecs = -(-owt // simd.lanes) + (1 if owt % simd.lanes and owt > simd.lanes else 0)  # LLVM's split of a tail
    budget = simd.regs - vecs - 2
    mr = next(m for m in (16, 12, 8, 6, 4, 3, 2, 1) if oc % m == 0 and m * vecs <= budget)
    return mr, owt


def conv2d(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule | None:
    """Direct NCHW 2-D convolution (``convolution`` lowering, ``codegen/lower/nn.py``): a register tile of MR
    output channels x OWT output columns (``_conv_tile``), accumulated in registers over the whole reduction
    (input channel, kernel row, kernel column; the column loop unrolled): each x vector (a run of the input row,
    contiguous at stride 1) is shared by MR FMAs, each weight broadcast by vectors(OWT). Parallel over (n, oc
    tile, oh); the bias / cast epilogue is written from the registers. The padded copy of x (the lowering's
    ``pad``) runs parallel over its rows first::

        for n, oco, oh in parallel:  for owo:
            acc[MR, OWT] = 0                                                    # registers
            for rc, kh, kw:  acc[oci, :] += X[n, rc, oh*s + kh, (owo*OWT + :)*s + kw] * W[oco*MR + oci, rc, kh, kw]
            Y[n, oco*MR + oci, oh, owo*OWT + :] = epilogue(acc[oci, :])

    A 1x1 of many input channels and weights that stay in L2 runs ``for n, oh in parallel: for owo: Xp[IC, OWT]
    = x's column run; for oco: ...`` instead (``PACKED_1X1_*``): its x rows lie a whole plane apart.

    None for any other kernel (grouped and depthwise convolutions included)."""
    simd = Simd.of(target)
    sch = tvm.s_tir.Schedule(mod)
    one = _one_block(sch, _conv_block)
    if one is None:
        return None
    blocks, block, (oc_extent, ow_extent, x_buf) = one
    others = [b for b in blocks if not b.same_as(block)]
    if any(sch.get(b).init is not None for b in others):  # only the pad copy and elementwise epilogues
        return None
    producers = [b for b in others if any(c.same_as(block) for c in sch.get_consumers(b))]
    consumers = [b for b in others if not any(p.same_as(b) for p in producers)]
    mr, owt = _conv_tile(oc_extent, ow_extent, simd)
    iters = sch.get(block).iter_vars
    ic_extent, taps = int(iters[4].dom.extent), int(iters[5].dom.extent) * int(iters[6].dom.extent)
    packed = taps == 1 and ic_extent >= PACKED_1X1_MIN_IC and oc_extent * ic_extent * 4 <= PACKED_1X1_MAX_W_BYTES
    acc = sch.cache_write(block, 0, "local")
    n, oc, oh, ow, rc, kh, kw = sch.get_loops(block)
    oco, oci = sch.split(oc, [None, mr])
    owo, owi = sch.split(ow, [None, owt])
    if packed:  # x's column run packed once per task, [IC, OWT] (L1), read by every oc tile
        sch.reorder(n, oh, owo, oco, rc, kh, kw, oci, owi)
        x_read = next(i for i, r in enumerate(sch.get(block).reads) if r.source.same_as(x_buf))
        xc = sch.cache_read(block, x_read, "global")
        sch.compute_at(xc, owo)
        sch.vectorize(sch.get_loops(xc)[-1])
        task, tile = sch.fuse(n, oh), oco
    else:
        sch.reorder(n, oco, oh, owo, rc, kh, kw, oci, owi)
        task, tile = sch.fuse(n, oco, oh), owo
    sch.vectorize(owi)
    sch.unroll(oci)
    sch.unroll(kw)
    sch.parallel(task)
    epilogue = consumers[0] if len(consumers) == 1 else None
    if epilogue is not None and len(sch.get_consumers(acc)) == 1:
        sch.reverse_compute_inline(epilogue)  # the write-back from registers computes the epilogue itself
        consumers = []
    sch.reverse_compute_at(acc, tile)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.decompose_reduction(block, rc)
    _parallel_epilogues(sch, producers + consumers)
    return sch.mod


def _row_broadcast(block) -> bool:
    """Whether an elementwise block reads some buffer that does not vary along its last iterator (a per-channel
    scale [C, 1, 1] against an NCHW value: a broadcast along the row)."""
    last = block.iter_vars[-1].var
    return any(not any(_uses(r.min, last) for r in region.region) for region in block.reads)


def elementwise_rows(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule | None:
    """Elementwise kernels (every block spatial, no reduction) of which some block reads an operand broadcast
    along its rows (BatchNorm's folded per-channel scale and shift, a bias over NCHW): the leading loops fused and
    parallel, the last dim vectorised, whole up to four vectors (56: no tail loop) or in runs of a vector, so a
    broadcast operand is one scalar per vector. (parallel_loops vectorises the flat index: the channel of each
    lane is then its own quotient and the scale a gather; a [1, 256, 56, 56] scale-shift-add-relu ran 3x slower
    than torch.) None for any other kernel."""
    simd = Simd.of(target)
    sch = tvm.s_tir.Schedule(mod)
    blocks = sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []
    if not blocks:
        return None
    for b in blocks:
        blk = sch.get(b)
        if blk.init is not None or len(blk.iter_vars) < 2 or len(sch.get_loops(b)) != len(blk.iter_vars):
            return None
        if any(iv.iter_type != tvm.tirx.IterVar.DataPar for iv in blk.iter_vars):
            return None
        if not isinstance(blk.iter_vars[-1].dom.extent, tvm.tirx.IntImm) or int(blk.iter_vars[-1].dom.extent) < 4:
            return None
    if not any(_row_broadcast(sch.get(b)) for b in blocks):
        return None
    runs = []
    for b in blocks:
        extent = int(sch.get(b).iter_vars[-1].dom.extent)
        runs.append(extent if extent <= 4 * simd.lanes else
                    max(d for d in range(1, simd.lanes + 1) if extent % d == 0))
    if min(runs) < 4:  # a wide row of a prime length: no vector run divides it
        return None
    for b, run in zip(blocks, runs):
        *lead, last = sch.get_loops(b)
        if run != int(sch.get(last).extent):
            last = sch.split(last, [None, run])[1]
        sch.vectorize(last)
        sch.parallel(sch.fuse(*lead) if len(lead) > 1 else lead[0])
    return sch.mod


def dlight_reduction(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule | None:
    """dlight's CPU reduction rule (row reductions: softmax, norms), ``exp`` as ``fast_exp`` (LLVM calls the
    scalar ``expf`` per lane). Not ``dl.cpu.GEMV``: it vectorises across strided rows with a 256-step unroll, LLVM
    then spends 10-40 s on one small expert bmm, and the code is no faster than parallel loops."""
    from tvm.s_tir import dlight as dl

    before = _work_at(mod["main"])
    # on a module of its own: dlight's rule rewrites the module it is given in place (the later rules got it). A new
    # IRModule over the same (immutable) functions is enough; a TVMScript round trip cost 0.35 s per kernel.
    with target:
        out = dl.ApplyDefaultSchedule(dl.cpu.Reduction())(tvm.IRModule(dict(mod.functions_items())))
    attrs = out["main"].attrs
    if attrs is None or "tirx.is_scheduled" not in attrs:
        return None
    after = _work_at(out["main"])
    if before is not None and after is not None and after > 2 * before:
        return None  # a schedule may only reorder work: e.g. one row's reductions recomputed for every column
    return tvm.IRModule({"main": fast_exp(out["main"])})


def _work_at(func: tvm.tirx.PrimFunc, symbol_size: int = 1024) -> int | None:
    """The innermost iterations of ``func`` (``parallel.work``) with every symbol at ``symbol_size``; None where
    they cannot be counted. (dlight's reduction rule put a one-row softmax's max and sum inside the loop over the
    row's columns: 201,088^2 iterations for a vocabulary, minutes a call.)"""
    w = work(func.body)
    return None if w is None else work_at(w, symbol_size)


def parallel_loops(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The generic rule, last: the leading spatial loops of every block fused and parallel; a pure elementwise
    block's inner loop vectorised. Always applies (a function it cannot analyse stays as it is)."""
    from tvm.s_tir.dlight.analysis import normalize_prim_func

    sch = tvm.s_tir.Schedule(mod)
    try:
        infos = normalize_prim_func(sch)
    except Exception:  # noqa: BLE001 - an unusual function: leave it unscheduled (still correct on CPU)
        infos = None
    if not infos:
        return mod
    for info in infos:
        kinds = info.dom_kind()
        n_s = len(kinds) - len(kinds.lstrip("S"))
        if n_s == 0:
            continue
        try:
            loops = sch.get_loops(info.block_rv)[:n_s]
            fused = sch.fuse(*loops) if n_s > 1 else loops[0]
            extent = sch.get(fused).extent
            if kinds == "S" * len(kinds) and isinstance(extent, tvm.tirx.IntImm) and extent.value % 16 == 0:
                outer, inner = sch.split(fused, [None, 16])
                sch.parallel(outer)
                sch.vectorize(inner)
            else:
                sch.parallel(fused)
        except Exception as err:  # noqa: BLE001 - best effort; the block stays serial
            logger.debug("cpu fallback left block %s serial: %s", info.name, err)
    return sch.mod


# the CPU default tier, in order: the first that returns a module schedules the kernel
CPU_DEFAULT_RULES = (dense_linear, batched_matmul, conv2d, row_reduction, dlight_reduction, elementwise_rows,
                     parallel_loops)


def cpu_default_rule(mod: tvm.IRModule, target: tvm.target.Target) -> tuple[str, tvm.IRModule]:
    """(name, scheduled module) of the first of ``CPU_DEFAULT_RULES`` that takes the (normalised) kernel; a rule
    that trips on an unusual kernel counts as not applying (("none", mod) when none does)."""
    for rule in CPU_DEFAULT_RULES:
        try:
            out = rule(mod, target)
        except RULE_ERRORS as err:
            logger.debug("cpu rule %s failed: %s", rule.__name__, err)
            continue
        if out is not None:
            return rule.__name__, out
    return "none", mod


def cpu_default(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The module of ``cpu_default_rule``."""
    return cpu_default_rule(mod, target)[1]


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001 - a function without a root block (written scheduled): not this rule's
        return False


def _one_block(sch, matcher):
    """(the root's child blocks, the one of them ``matcher(sch, block)`` takes, what it returned); None where it
    takes none or several."""
    blocks = sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []
    found = [(b, m) for b in blocks if (m := matcher(sch, b)) is not None]
    return (blocks, *found[0]) if len(found) == 1 else None


def _below(sch, block, loop) -> list:
    """The loops of ``block`` inside ``loop``."""
    loops = sch.get_loops(block)
    at = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(loop)))
    return loops[at + 1:]


