"""dayzero's own ops, declared in one place: arguments (in call order, tensor or attr), reference, aliasing, doc.

Every op that is not ATen's is here: the program's leaves (``input``, ``weight``, ``state``), multi-output access
(``getitem``), state writes (``assign``, ``state_index_put``, ``paged_state_index_put``) and the fused ops the
pattern passes create (routed experts, dense linear over low-precision weights, attention over a KV cache). The
shape/dtype rule of an op is its reference run on ``meta`` tensors (``meta_ok``); ops bound by the runtime or
writing in place give their output types explicitly when a pass builds them.

The references live beside this file by family (``reference_attention.py``, ``reference_moe.py``,
``reference_dequant.py``); their kernels are listed in the kernel table. A pass that creates one of these ops
imports only its name; the registry (``ops.py``) starts with every op declared here.

Attrs of a paged reader (passes/paged_kv.py): ``paged`` (block size), ``length`` (logical rows), ``per_token``
(the batched decode step: one table row per query); the block table is the op's last input.
"""

from __future__ import annotations

import torch

from dayzero import InternalError
from .collective import (all_gather_reference, all_reduce_reference, all_to_all_reference,
                         group_rank_reference)
from .opdef import ATTR, OPT_TENSOR, TENSOR, OpDef
from .reference_attention import (by_row, by_token, compressed_reference, dense_reference, indexer_reference,
                                  mla_dense_reference, mla_sparse_reference, paged_write_reference, sparse_reference)
from .reference_dequant import dequant_reference, linear_reference
from .reference_fused import fused_reference
from .reference_moe import moe_fp8_reference, moe_mxfp4_reference, moe_reference, moe_workspace_reference


# what an ``input`` is when the runtime, not the caller, passes it (attr ``kind``; absent for the model's inputs)
BLOCK_TABLE = "block_table"  # a paged cache's block table (passes/paged_kv.py): one per window class
INPUT_KINDS = (BLOCK_TABLE,)


def _no_ref(name):
    def ref(inputs, attrs):
        raise InternalError(f"{name} has no reference: it is bound by the runtime")
    return ref


def _state_index_put(ins, a):
    # the ATen op takes None for an open dim
    return torch.ops.aten.index_put_(ins[0], [ins[1 + a["indices"][:k + 1].count(True) - 1] if p else None
                                              for k, p in enumerate(a["indices"])], ins[-1])


# a paged cache (passes/paged_kv.py): attr paged = block size, attr length = logical rows, the block table last
PAGED = ("paged", OPT_TENSOR)
# the MLA attentions' leading arguments: queries, the latent cache and its rotary keys, kv_b_proj, positions
_MLA_CACHE = (("q", TENSOR), ("latent", TENSOR), ("rope_k", TENSOR), ("w_kv", TENSOR), ("qpos", TENSOR))

# the routed experts' common arguments
_ROUTING = (("x", TENSOR), ("topk_ids", TENSOR), ("topk_weights", TENSOR))
_MOE_ATTRS = (("act", ATTR), ("inter", ATTR), ("gate_up_bias", ATTR), ("down_bias", ATTR))
_MXFP4_EXPERTS = (("gate_up_blocks", TENSOR), ("gate_up_scales", TENSOR), ("b_gate_up", OPT_TENSOR),
                  ("down_blocks", TENSOR), ("down_scales", TENSOR), ("b_down", OPT_TENSOR))


# ---- the expert workspace's layout (moe_experts_mxfp4_ws: what its kernel and the pass agree on) -------------

WORKSPACE_META_HEAD = 4  # the cache state's header: tick, hits, conversions, unused
# the workspace's storage dtype per compute dtype (fp8 is stored as its e4m3 bytes and decoded with integer ops)
WORKSPACE_STORAGE = {"float32": "float32", "bfloat16": "bfloat16", "float8_e4m3fn": "uint8"}


def workspace_slot_elems(H: int, GU: int, I: int) -> int:
    """Elements of one converted expert: gate/up [GU, H] then down [H, I]."""
    return GU * H + H * I


def workspace_slot_bytes(H: int, GU: int, I: int, compute_dtype: str) -> int:
    return workspace_slot_elems(H, GU, I) * {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}[compute_dtype]


def workspace_meta_len(slots: int) -> int:
    """int64 elements of the cache state: the header, then per slot its (layer, expert) key and last use."""
    return WORKSPACE_META_HEAD + 2 * slots


_LINEAR_DOCS = {
    "int4": "y [T, N] = x [T, K] @ W.T, W decoded from packed uint8 [R, C/2] (low nibble first), scales fp32 and "
            "optional zero points fp32 [R/block, C] (block_axis 0) or [R, C/block] (1); [R, C] = [N, K] (layout "
            "nk) or [K, N] (kn); W = ((float(code [^ 8 if signed]) - offset) - zp) * scale",
    "mxfp4": "y [T, N] = x [T, K] @ W.T, W MXFP4: blocks uint8 [N, K/32, 16], E8M0 scales uint8 [N, K/32]",
    "fp8": "y [T, N] = x [T, K] @ W.T, W float8_e4m3fn [N, K] times scale_inv fp32 [ceil(N/128), ceil(K/128)]",
    "bf16": "y [T, N] = x [T, K] @ W.T, W bfloat16 [N, K] as the checkpoint stores it (exact in fp32: the fp32 "
            "accumulation sees the very values an upcast copy would hold); attr groups G > 1 (a grouped projection): "
            "x [T, G K], row group g (rows [g N/G, (g+1) N/G)) reads x's columns [g K, (g+1) K)",
}
_LINEAR_WEIGHTS = {
    "int4": (("packed", TENSOR), ("scales", TENSOR), ("zero_points", OPT_TENSOR), ("layout", ATTR), ("block", ATTR),
             ("block_axis", ATTR), ("signed", ATTR), ("offset", ATTR)),
    "mxfp4": (("blocks", TENSOR), ("scales", TENSOR)),
    "fp8": (("weight", TENSOR), ("scale_inv", TENSOR)),
    "bf16": (("weight", TENSOR), ("groups", ATTR)),
}


DAYZERO_OPS: tuple[OpDef, ...] = (
    # ---- program leaves and structure -------------------------------------------------------------------------
    OpDef("input", args=(("name", ATTR), ("kind", ATTR)), reference=_no_ref("input"), meta_ok=False,
          doc="a program input; attr name; attr kind (one of INPUT_KINDS) when the runtime passes it: "
              "'block_table' for a paged cache's block table (passes/paged_kv.py); absent for the model's own inputs"),
    OpDef("weight", args=(("name", ATTR), ("shard", ATTR)), reference=_no_ref("weight"), meta_ok=False,
          doc="a parameter, buffer or constant, bound at load time; attr name (key in the weights manifest); attr "
              "shard (group, dim, parts) when each rank holds part group_rank of ``parts`` equal slices of the "
              "named tensor along dim (passes/shard.py; the node's shape is the slice)"),
    OpDef("state", args=(("name", ATTR), ("zone", ATTR)), reference=_no_ref("state"), meta_ok=False,
          doc="a persistent mutable buffer shared by the programs of an artifact (KV cache, cross-layer state);"
              " attrs name, zone (kv_cache | cross_layer_state); zero when a request starts"),
    OpDef("getitem", args=(("index", ATTR),), view=True, reference=lambda ins, a: ins[0][a["index"]],
          doc="output #index of a multi-output node"),
    # ---- state writes -----------------------------------------------------------------------------------------
    OpDef("assign", reference=lambda ins, a: ins[0].copy_(ins[1]), inplace=True, meta_ok=False,
          doc="state := value (whole tensor), at the end of the program; output aliases the state"),
    OpDef("state_index_put", args=(("indices", ATTR),), inplace=True, meta_ok=False, reference=_state_index_put,
          doc="state[..., idx, ...] = values in place (index_put into a state buffer); attr indices: which "
              "dims are indexed; inputs: state, index tensors, values; output aliases the state"),
    OpDef("paged_state_index_put", args=(("state", TENSOR), ("idx", TENSOR), ("values", TENSOR), ("table", TENSOR),
                                         ("dim", ATTR), ("block_size", ATTR)),
          inplace=True, meta_ok=False, reference=paged_write_reference,
          doc="state[.., table[idx // bs] * bs + idx % bs, ..] = values in place (dim = the position dim, bs = "
              "block_size): a KV-cache write into a paged pool; output aliases the state. A per-token table "
              "[S, NT] (attr per_token) maps values[.., s, ..] through its row s"),
    OpDef("scatter_inplace", args=(("x", TENSOR), ("index", TENSOR), ("src", TENSOR), ("dim", ATTR)),
          inplace=True, meta_ok=False, reference=lambda ins, a: ins[0].scatter_(a["dim"], ins[1], ins[2]),
          doc="x.scatter_(dim, index, src) into a program input's own buffer (passes/inplace_input.py): "
              "x[.., index[i], ..] = src[i] along dim for every i of index; output aliases x"),
    # ---- a group of element-wise / injective ops with at most one row reduction (passes/fuse.py) -------------
    OpDef("fused", args=(("body", ATTR),), reference=fused_reference,
          doc="one kernel for a group of ops: inputs are the group's external values; attr body = ((op, args, "
              "attrs, dtype, shape), ...) in topological order, args indexing the inputs then earlier entries; "
              "the output is the last entry's value"),
    # ---- collectives over a named group of the device mesh (passes/ir/collective.py; run by the runtime) -----
    OpDef("all_reduce", args=(("x", TENSOR), ("group", ATTR), ("size", ATTR), ("reduce", ATTR)),
          reference=all_reduce_reference,
          doc="sum of x over the ranks of mesh axis ``group`` (``size`` ranks; attr reduce 'sum'); out as x"),
    OpDef("all_gather", args=(("x", TENSOR), ("group", ATTR), ("size", ATTR), ("dim", ATTR)),
          reference=all_gather_reference,
          doc="the group's x concatenated along ``dim`` in group-rank order; out dim ``dim`` is size times x's"),
    OpDef("all_to_all", args=(("x", TENSOR), ("group", ATTR), ("size", ATTR)),
          reference=all_to_all_reference,
          doc="x [size*n, ..]: chunk j goes to group rank j, out chunk i came from group rank i; out as x"),
    OpDef("group_rank", args=(("group", ATTR), ("size", ATTR)), reference=group_rank_reference,
          doc="int64 [1]: this rank's index in its group on mesh axis ``group`` (``size`` ranks)"),
    # ---- routed experts (passes/moe.py, passes/dequant.py, passes/expert_workspace.py) ------------------------
    OpDef("moe_experts", args=(*_ROUTING, ("w_gate_up", TENSOR), ("b_gate_up", OPT_TENSOR), ("w_down", TENSOR),
                               ("b_down", OPT_TENSOR), ("layout", ATTR), *_MOE_ATTRS),
          reference=moe_reference,
          doc="routed experts (an id outside [0, E) is another rank's expert: not computed, adds nothing): "
              "x [T,H], topk_ids int [T,k], topk_weights [T,k], w_gate_up [E,GU,H] (nk) or "
              "[E,H,GU] (kn), [b_gate_up [E,GU]], w_down [E,H,I] (nk) or [E,I,H] (kn), [b_down [E,H]]; attrs "
              "layout, act (expression over G's columns, see passes/moe.py), inter I, gate_up_bias, down_bias"),
    OpDef("moe_experts_mxfp4", args=(*_ROUTING, *_MXFP4_EXPERTS, *_MOE_ATTRS),
          reference=moe_mxfp4_reference,
          doc="moe_experts with MXFP4 expert matrices as published (layout nk): gate_up_blocks uint8 "
              "[E,GU,H/32,16], gate_up_scales uint8 [E,GU,H/32], down_blocks [E,H,I/32,16], down_scales [E,H,I/32]; "
              "other args as moe_experts; optional attr int8 (passes/expert_workspace.int8_activations): x and "
              "act(...) rounded to int8 per 32-block before their GEMMs (reference_moe.int8_blocks_ref)"),
    OpDef("moe_experts_fp8", args=(*_ROUTING, ("gate_up_weight", TENSOR), ("gate_up_scale", TENSOR),
                                   ("b_gate_up", OPT_TENSOR), ("down_weight", TENSOR), ("down_scale", TENSOR),
                                   ("b_down", OPT_TENSOR), ("layout", ATTR), *_MOE_ATTRS, ("gate_up_block", ATTR),
                                   ("down_block", ATTR)),
          reference=moe_fp8_reference,
          doc="moe_experts with FP8 expert matrices: gate_up_weight float8_e4m3fn [E,GU,H] (nk) or [E,H,GU] (kn), "
              "gate_up_scale fp32 [E, ceil(d1/br), ceil(d2/bc)] with (br, bc) = gate_up_block; down_weight / "
              "down_scale / down_block likewise; W[e,i1,i2] = E4M3(weight[e,i1,i2]) * scale[e, i1 // br, i2 // bc]; "
              "other args as moe_experts"),
    OpDef("moe_experts_mxfp4_ws", args=(*_ROUTING, *_MXFP4_EXPERTS, ("layer", TENSOR), ("workspace", TENSOR),
                                        ("cache_state", TENSOR), *_MOE_ATTRS, ("compute_dtype", ATTR),
                                        ("cache", ATTR)),
          reference=moe_workspace_reference,
          doc="moe_experts_mxfp4 computed from converted copies of the routed experts in a workspace (state, zone "
              "dequant_workspace; [slots, workspace_slot_elems] of WORKSPACE_STORAGE[compute_dtype]) with an "
              "optional LRU cache of converted experts (cache_state int64 [workspace_meta_len(slots)]); layer "
              "int32 [1] keys the cache"),
    # ---- a low-precision weight as stored, typed (the frontend's binding: frontend/lowprec.py) ----------------
    OpDef("dequant", args=(("data", TENSOR), ("scale", TENSOR), ("format", ATTR), ("block", ATTR),
                           ("transposed", ATTR), ("out_dtype", ATTR)),
          reference=dequant_reference,
          doc="a low-precision weight as stored -> float32: format mxfp4 (data uint8 [.., O, G, 16], scale E8M0 "
              "uint8 [.., O, G], block 32: W [.., O, 32G]) or fp8 (data float8_e4m3fn [.., R, C], scale fp32 "
              "[.., ceil(R/br), ceil(C/bc)], block (br, bc): W [.., R, C]); transposed swaps W's last two axes; "
              "out_dtype float32. passes/dequant.py fuses it into its consumer; alone it lowers elementwise"),
    # ---- dense linear over stored low-precision weights (passes/dequant.py) ----------------------------------
    *(OpDef(f"dequant_linear_{fmt}", args=(("x", TENSOR), *_LINEAR_WEIGHTS[fmt], ("N", ATTR), ("K", ATTR)),
            reference=linear_reference(fmt), doc=_LINEAR_DOCS[fmt]) for fmt in _LINEAR_WEIGHTS),
    # ---- attention over a KV cache (passes/sparse_attention.py, passes/compressed_attention.py) --------------
    OpDef("cache_attention", args=(("q", TENSOR), ("k", TENSOR), ("v", TENSOR), ("qpos", TENSOR),
                                   ("sinks", OPT_TENSOR), ("scale", ATTR), ("window", ATTR), ("per_row", ATTR),
                                   ("ring", ATTR), PAGED),
          reference=by_token("cache_attention", by_row(dense_reference, (3,))),
          doc="causal attention over a KV cache: q [B,Hq,S,D], k [B,Hkv,L,D], v [B,Hkv,L,Dv], qpos int [S] (each "
              "query's position), [sinks [Hq]]; attrs scale, window (0 = unbounded), sinks (bool), per_row (S == 1 "
              "and qpos int [B]: row b's query at qpos[b]), ring (with per_row: k / v hold the window ending at the "
              "query, row j at position qpos[b]-(L-1)+j); reads rows [max(0, qpos-window+1), qpos] only; "
              "out [B,Hq,S,Dv]"),
    OpDef("sparse_attention", args=(("q", TENSOR), ("k", TENSOR), ("v", TENSOR), ("qpos", TENSOR), ("idx", TENSOR),
                                    ("scale", ATTR), PAGED),
          reference=by_token("sparse_attention", sparse_reference),
          doc="attention over selected cache rows (DSA): q [B,Hq,S,D], k [B,Hkv,L,D], v [B,Hkv,L,Dv], qpos int "
              "[S], idx int [B,S,k] (selected rows, shared by the heads); attr scale; reads rows idx[b,s,:] <= "
              "qpos[s] only; out [B,Hq,S,Dv]"),
    OpDef("mla_sparse_attention", args=(*_MLA_CACHE, ("idx", TENSOR), ("scale", ATTR), ("nope", ATTR), PAGED),
          reference=by_token("mla_sparse_attention", mla_sparse_reference),
          doc="DSA over an MLA latent cache with the up-projection absorbed: q [B,H,S,nope+Dr], latent [B,1,L,R], "
              "rope_k [B,1,L,Dr], w_kv [H*(nope+Dv), R] (kv_b_proj), qpos int [S], idx int [B,S,k]; attrs scale, "
              "nope; = sparse_attention over K = [latent W_uk^T | rope_k], V = latent W_uv^T (mla_expand), but "
              "reads only the k selected latent rows; out [B,H,S,Dv]"),
    OpDef("mla_attention", args=(*_MLA_CACHE, ("scale", ATTR), ("nope", ATTR), PAGED),
          reference=by_token("mla_attention", mla_dense_reference),
          doc="causal MLA over a latent cache with the up-projection absorbed (DeepSeek-V3, Kimi-K2: MLA without "
              "an indexer): q [B,H,S,nope+Dr], latent [B,1,L,R], rope_k [B,1,L,Dr], w_kv [H*(nope+Dv), R], qpos "
              "int [S]; = cache_attention over K = [latent W_uk^T | rope_k], V = latent W_uv^T (mla_expand) for "
              "rows <= qpos, without expanding the cache; out [B,H,S,Dv]"),
    OpDef("dsa_indexer_topk", args=(("q", TENSOR), ("w", TENSOR), ("keys", TENSOR), ("qpos", TENSOR),
                                    ("scale", ATTR), ("k", ATTR), ("sorted", ATTR), ("fill", ATTR), ("rate", ATTR),
                                    ("per_row", ATTR), PAGED),
          reference=by_token("dsa_indexer_topk", by_row(indexer_reference, (3,))),
          doc="DSA lightning indexer: q [B,S,Hi,Di], w [B,S,Hi] (head weights), keys [B,L,Di] (index-key cache: "
              "a key per position, or per rate positions), qpos int [S]; attrs scale, k, sorted, fill, rate (1: "
              "DeepSeek-V3.2; R: DeepSeek-V4's compressed keys); score[b,s,j] = sum_h w·relu(scale q_h·keys_j) for "
              "j < (qpos[s] + 1) // rate else fill; out int64 [B,S,k] = torch.topk(score, k).indices (torch's tie "
              "order); reads only the visible key rows; per_row (S == 1 and qpos int [B]: row b's query at qpos[b])"),
    OpDef("compressed_attention", args=(("q", TENSOR), ("kv", TENSOR), ("qpos", TENSOR), ("entries", TENSOR),
                                        ("sinks", TENSOR), ("idx", OPT_TENSOR), ("epos", OPT_TENSOR),
                                        ("scale", ATTR), ("window", ATTR), ("rate", ATTR), ("per_row", ATTR),
                                        ("ring", ATTR), PAGED),
          reference=by_row(compressed_reference, (2, 5)),
          doc="DeepSeek-V4 compressed attention with sinks, K = V: q [B,H,S,D], kv [B,Hkv,L,D] (sliding state, "
              "every position), qpos int [S], entries [B,Hkv,E,D] (compressed entries), sinks [H], and either idx "
              "int [B,S,K] (CSA: the selected entries, those in [0, E) count; distinct per query, from a top-k) or "
              "epos int [S] (HCA: entries e < (epos+1)//rate); attrs scale, window (0 = unbounded), rate (HCA; 0 "
              "for CSA), idx / epos (bool), per_row (S == 1 and qpos, epos int [B]: row b's query at qpos[b]), "
              "ring (with per_row: kv holds the window ending at the query, row j at position qpos[b]-(L-1)+j); "
              "reads window rows [max(0, qpos-window+1), qpos] and the selected / valid entries only; out "
              "[B,H,S,D]; a paged kv (passes/paged_kv.py): attrs paged (block size), length, the block table last"),
)
