"""Export an upstream causal LM *with its KV cache as state*: one program for cache-filling prefill and decode.

``export_with_cache(model, max_cache_len, batch_size=1, max_seq=32)`` returns ``(ep, info)``: ``ep`` is a
decomposed (``frontend.torch_export.decompose``) ExportedProgram of
``(input_ids [B, seq] int64, cache_position [seq] int64) -> logits [B, seq, V]`` whose KV cache tensors are buffers
``cache_{layer}_{keys|values|indexer_keys}`` (DeepSeek-V4: ``keys`` and ``{compressor|indexer}_*``, v4_cache.py);
after decomposition every cache write is an out-of-place ``aten.index_put`` (V4's pending / overlap windows: a
whole-buffer ``copy``) whose result is a ``BUFFER_MUTATION`` graph output (``info.buffer_mutations``: buffer -> output
node; ``info.mutation_output_index``: buffer -> flat output index; mutations come first, the logits last).
``info.cache`` gives per layer the buffer name, shape, dtype, position dim and layer type (+ sliding window).
Prefill: ``cache_position = arange(P)``; decode step i: ``cache_position = [P + i]``. ``seq`` is a symbolic dim in
``[min_seq, max_seq]``; ``max_seq=1`` gives the fixed-shape decode program. The buffers are non-persistent: they
live in ``ep.constants`` and are shared by every ``ep.module()`` (``reset_cache`` zeroes them). ``to_graph``
translates these programs (the cache tensors arrive as ``weight`` nodes; the IR has no state kind yet).

Root cause of the upstream failure (``TorchExportableModuleWithStaticCache`` + ``run_decompositions`` ->
``AssertionError: expected compiled_fn to be GraphModule, got <class 'function'>``, torch 2.13):
non-strict ``torch.export`` swaps a module's registered parameters/buffers for fake tensors *by attribute*
(``torch.nn.utils.stateless._reparametrize_module`` in ``export/_trace.py``). The wrapper registers the cache
tensors as buffers, but ``StaticCache.layers[i].keys / .values / .cumulative_length`` still point at the *real*
tensors, so the traced ``index_copy_`` / ``add_`` / ``copy_`` hit real tensors, which export lifts as
``CONSTANT_TENSOR`` inputs (``...self_attn.lifted_tensor_N``), and the output signature has only USER_OUTPUT. At
``run_decompositions`` those constants and the registered buffers are *the same tensor objects*, passed twice as
flat inputs and mutated: aot_autograd's ``AOTDedupeWrapper`` (duplicate mutated args; measured keep_arg_mask drops
the six lifted constants as dupes of the six cache buffers) wraps the graph in a Python function, which
``aot_stage2_export`` rejects. Not the masking utils, not sdpa vs eager, not grad mode (``torch.no_grad()`` fails
the same way).

The strategy that works (``CacheStep``): a dayzero wrapper holding transformers' own ``StaticCache`` whose layer
tensors are registered as buffers *and re-bound onto the cache layers at the top of every forward*
(``layer.keys = self.cache_0_keys``): under export that attribute read returns the fake buffer, so writes are
functionalised into BUFFER_MUTATIONs. ``cumulative_length`` (and ``indexer_cumulative_length``) are not state: each
call sets them to a fresh ``cache_position[0].clone()``, so the write offset and the mask/rope positions come from
the input (as upstream's executorch wrapper intends with its ``copy_``), and nothing else is mutated.
Layer tensors are allocated by one eager 1-token forward and zeroed (``early_initialization`` assumes one head_dim
for keys and values and knows nothing of MLA latents or indexer keys).

Per architecture (tiny checkpoints, transformers 5.24, fp32; tests/test_decode_export.py):
* qwen3_moe: works. Greedy tokens == ``generate()``; logits over prefill 12 + 18 steps match the cache-less
  forward to ~1e-6. Decode graph (max_seq=1, max_cache_len=48, 2 layers): 260 call_function nodes; per layer 2
  ``index_put`` [1,2,48,16] <- [1,2,1,16] at cache_position; ``scaled_dot_product_attention`` q [1,4,1,16],
  k/v [1,4,48,16] (GQA by expand+clone of the whole cache), bool mask [1,1,1,48] from ``le(arange, pos)``.
* gpt_oss: works. The upstream ``StaticSlidingWindowLayer`` is replaced by a full-length ``StaticLayer``: the
  sliding layer keeps a Python-int ``cumulative_length_int`` and branches on it (not full / becoming full / full:
  roll + copy_) and sizes the mask from it (``get_mask_sizes``), so an exported graph would bake in the cache phase
  seen at trace time. With a full-length cache the window is applied by the sliding-window mask only (same keys,
  same sinks: logits match to ~1e-6 past the window; disabling the window changes logits by 2.9). Cost: the
  sliding layers' cache holds max_cache_len positions, not the window (a later ring-buffer pass can fix that).
  Decode graph: 333 nodes; eager attention with sinks: ``bmm`` [4,1,16]x[4,16,48] -> scores, ``cat`` sink ->
  ``softmax`` [1,4,1,49], ``bmm`` [4,1,48]x[4,48,16]; sliding mask from ``le``/``sub``/``bitwise_and``.
* deepseek_v32: works (``StaticIndexedLayer``: MLA latent keys [1,1,48,32] = ``k_pass``, values [1,1,48,8] =
  ``k_rot``, indexer keys [1,48,16] with position dim 1). Decode graph: 443 nodes; per layer 3 ``index_put``;
  ``expand_kv`` rebuilds full K [1,4,48,24] / V [1,4,48,16] from the whole latent cache every step
  (``slice_scatter``); the indexer scores all 48 positions (``bmm`` [1,8,16]x[1,16,48], relu, weighted head sum
  [1,1,48]), ``topk`` 4, ``scatter`` into a bool mask, then dense ``scaled_dot_product_attention`` q [1,4,1,24] over
  k [1,4,48,24] with mask [1,1,1,48] = causal & selected.
* deepseek_v4: works through dayzero-owned fixed-size cache layers (``frontend/v4_cache.py``), chosen when the
  config's layer types include compressed attention. Upstream's own layers (``DeepseekV4HCACache`` /
  ``DeepseekV4CSACache``) subclass ``DynamicSlidingWindowLayer`` and cannot be static (``StaticCache(config)`` raises
  ``KeyError: 'heavily_compressed_attention'``; upstream sets ``_can_compile_fullgraph = False``): their state is
  cat-grown (sliding K=V, ``compressed_kv``), the pending-window buffers hold ``position mod compress_rate`` tokens,
  ``entry_count`` is a Python int and the compressors branch on those lengths (``chunk_kv.shape[1] > 0``,
  ``seq_len == 1`` returns no block bias, ``prior_kv is None``). dayzero's layers implement the same cache-side
  API (``update``, ``store_compression_weights``, ``update_overlap_state``, ``update_compressor_states``) over
  fixed tensors: a full-length K=V buffer (window by mask), per compressor a one-window pending ring, E + 1
  entry rows (validity = upstream's causal rule ``entry < (p + 1) // rate``) and the CSA overlap; the compressor
  always pools the open window into a would-be entry at its own row, so one decode graph serves every phase. The
  upstream compressor / indexer / attention code runs unmodified; for one query the HCA compressor returns no
  block bias, so a pre-hook adds upstream's causal bias over the entries to the mask. The prefill exports with a
  free ``seq`` in [1, max] (no padding to the compression rate, and none is allowed: a padded tail would be taken
  for the open window's tokens). Tiny V4 (3 layers: HCA, CSA, sliding; max_cache_len 48): 16 state tensors;
  decode writes one row of each layer's K=V and of each compressor's entries, and copies the pending / overlap
  windows (rate rows each); greedy tokens == ``generate()``; logits over chunked prefills (mid-window second
  turns) + single steps match the cache-less forward to ~3e-6.

Decode attention is dense: at seq=1 every architecture above attends over all ``max_cache_len`` cache positions,
with invalid (and, for V3.2, unselected; for gpt-oss, out-of-window) positions masked, and the GQA / MLA expansion
materialises the whole cache each step. Later passes should turn these into reads of only the valid / selected
positions (mask = ``kv_idx <= cache_position`` [and window, and top-k scatter]).

Limits: all rows of a batch share ``cache_position`` (same-length prompts; different lengths need per-row
positions and a padding mask: the batched decode step instead puts one token per request along ``seq``, each at its
own position, passes/token_positions.py). DeepSeek-V4, whose compressor states are per request, batches along
``B`` instead: ``RowDecodeStep`` takes one token per row, each row at its own position, with the requests' states
as inputs and outputs (v4_cache.py's row layers).
``cache_position`` must be contiguous ``arange(start, start+seq)`` (the write uses
``cache_position[0] + arange(seq)``), and ``start + seq <= max_cache_len`` (past the end, ``index_put`` raises IndexError).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from dayzero import UserError

# cache-layer attribute -> (buffer suffix, position dim of that tensor)
_LAYER_TENSORS = (("keys", "keys", 2), ("values", "values", 2), ("indexer_keys", "indexer_keys", 1))


@dataclass
class CacheTensor:
    """One cache tensor: the exported program's buffer, its shape and which dim is the token position."""

    layer: int
    kind: str  # "keys" | "values" | "indexer_keys" | compressor state ("compressor_entries", ...: v4_cache.py)
    buffer: str  # buffer name in the ExportedProgram's state_dict
    shape: tuple[int, ...]
    dtype: str
    position_dim: int | None  # None: not indexed by token position (a compressor's pending window / overlap)
    layer_type: str  # the config's layer type ("full_attention", "sliding_attention", "indexed_attention", ...)
    sliding_window: int | None = None  # set when only the last `sliding_window` positions are attended
    compress_rate: int | None = None  # compressed entries: one row per `compress_rate` positions (position_dim)


@dataclass
class DecodeExportInfo:
    """What the runtime needs to drive the exported program as prefill + decode."""

    max_cache_len: int
    batch_size: int
    max_seq: int
    inputs: tuple[str, ...]  # user inputs in order: input_ids [B, seq] int64, cache_position [seq] int64
    cache: list[CacheTensor] = field(default_factory=list)
    # buffer name -> name of the graph output (fx node) that holds its new value (OutputKind.BUFFER_MUTATION)
    buffer_mutations: dict[str, str] = field(default_factory=dict)
    # buffer name -> index of that output in the flat graph outputs (mutations come first, then the logits)
    mutation_output_index: dict[str, int] = field(default_factory=dict)
    user_output_index: int = -1
    notes: list[str] = field(default_factory=list)


class CacheStep(torch.nn.Module):
    """``(input_ids [B, seq], cache_position [seq]) -> logits [B, seq, V]`` writing K/V into transformers' own cache.

    The cache object is transformers' :class:`~transformers.StaticCache` (layers ``StaticLayer`` /
    ``StaticIndexedLayer``); its tensors are registered here as buffers **and re-bound to the layers at the top of
    every forward**, so that under ``torch.export`` (non-strict, which swaps module buffers for fake tensors by
    attribute) the cache writes hit the lifted buffers, not the real tensors the cache object still points at.
    The write offset comes from ``cache_position[0]`` each call (a fresh tensor, not state).
    """

    def __init__(self, model: torch.nn.Module, max_cache_len: int, batch_size: int = 1):
        super().__init__()
        from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer

        from dayzero.frontend import v4_cache

        self.model = model
        cfg = model.config.get_text_config(decoder=True)
        self.layer_types = list(getattr(cfg, "layer_types", None) or [])
        if v4_cache.is_compressed_cache_config(cfg):
            # compressed attention (DeepSeek-V4): transformers' caches for it are dynamic; dayzero's fixed-size
            # counterpart runs the same upstream compressor code at every position (frontend/v4_cache.py)
            cache = v4_cache.CompressedAttentionCache(cfg, max_cache_len)
            self._hooks = v4_cache.install_decode_validity_bias(model)
        else:
            try:
                cache = StaticCache(config=cfg, max_cache_len=max_cache_len)
            except KeyError as e:
                raise UserError(f"{cfg.model_type}: no static cache layer for layer type {e}: its cache is dynamic "
                                f"(see frontend/decode_export.py)") from None
            for i, layer in enumerate(cache.layers):
                if isinstance(layer, StaticSlidingWindowLayer):
                    # a full-length static layer: the window is applied by the sliding-window mask instead
                    cache.layers[i] = StaticLayer(max_cache_len)
                elif type(layer).__name__ not in ("StaticLayer", "StaticIndexedLayer"):
                    raise UserError(f"layer {i}: cache layer {type(layer).__name__} has no static export path")
        self.layer_types += ["full_attention"] * (len(cache.layers) - len(self.layer_types))
        self.cache = cache
        self.max_cache_len = max_cache_len
        self.batch_size = batch_size
        self._allocate(batch_size)

    @torch.no_grad()
    def _allocate(self, batch_size: int) -> None:
        # Let every layer allocate its tensors at their real shapes (MLA latents, indexer keys, compressor state...)
        # by running one token eagerly, then zero them: simpler and more general than early_initialization, which
        # assumes one head_dim for keys and values and knows nothing of indexer keys.
        ids = torch.zeros((batch_size, 1), dtype=torch.long, device=self.model.device)
        self._bind_offset(torch.zeros(1, dtype=torch.long))
        self.model(input_ids=ids, cache=self.cache, use_cache=True)
        self.names: list[tuple[int, str, str]] = []  # (layer, attribute, buffer name)
        self.position_dims: dict[str, int | None] = {}  # buffer name -> its token-position dim (None: not one)
        for i, layer in enumerate(self.cache.layers):
            attrs = layer.state_attrs() if hasattr(layer, "state_attrs") else [(a, d) for a, _, d in _LAYER_TENSORS]
            for attr, pos_dim in attrs:
                t = getattr(layer, attr, None)
                if isinstance(t, torch.Tensor):
                    t.zero_()
                    name = f"cache_{i}_{attr}"
                    self.register_buffer(name, t, persistent=False)
                    self.names.append((i, attr, name))
                    self.position_dims[name] = pos_dim

    def _bind_offset(self, cache_position: torch.Tensor) -> None:
        for layer in self.cache.layers:
            start = cache_position[0].clone()
            layer.cumulative_length = start
            if hasattr(layer, "indexer_cumulative_length"):
                layer.indexer_cumulative_length = start.clone()
            if hasattr(layer, "bind_positions"):  # compressed-attention layers (v4_cache.py)
                layer.bind_positions(cache_position)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for i, attr, name in self.names:
            setattr(self.cache.layers[i], attr, getattr(self, name))
        self._bind_offset(cache_position)
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True,
                         position_ids=cache_position.unsqueeze(0).expand(input_ids.shape[0], -1))
        return out.logits


class RowDecodeStep(torch.nn.Module):
    """DeepSeek-V4's batched decode step: ``(input_ids [B, 1], positions [B], *states) -> (logits [B, 1, V],
    *new states)``, batch row b is request b, its one token at ``positions[b]``.

    ``states`` are the tensors of ``step`` (a :class:`CacheStep` of the same model: same names, order and shapes
    but the batch dim), row b request b's, passed in and returned (the step is a function of them: the caller
    gathers each request's state and scatters the new one back). The sliding K=V states (``keys``) hold only the
    window that ends at each row's token: ``window_rows`` = min(window, max_cache_len) rows, row j of request b
    at position ``positions[b] - (window_rows - 1) + j`` (rows before position 0 are masked), the last row the
    token's own (written by the step), so a step moves ``window_rows`` rows of a request, not ``max_cache_len``;
    the compressed entries, pending rings and overlaps are whole. The cache is
    ``v4_cache.RowCompressedAttentionCache`` (the single-request step's rules row by row); the sliding-window
    mask over the held rows (``positions[b] - (window_rows - 1) + j >= 0``) is handed to the model as its
    prebuilt mask; upstream's compressor, indexer and attention code runs unmodified."""

    def __init__(self, step: CacheStep):
        super().__init__()
        from dayzero.frontend import v4_cache

        self.model = step.model
        cfg = self.model.config.get_text_config(decoder=True)
        if not v4_cache.is_compressed_cache_config(cfg):
            raise UserError(f"{cfg.model_type}: the per-row decode step is DeepSeek-V4's (compressed attention)")
        self.cache = v4_cache.RowCompressedAttentionCache(cfg, step.max_cache_len)
        self._hooks = self.cache.install_rope_offsets(self.model)
        self.names = list(step.names)
        self.window_rows = min(int(cfg.sliding_window), step.max_cache_len)
        self.state_shapes = [self.row_shape(attr, tuple(getattr(step, name).shape)) for _, attr, name in self.names]

    def row_shape(self, attr: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one state of this step, from that state's shape in the single-request step: a sliding
        K=V state [B, H, L, D] holds ``window_rows`` rows; every other state is whole."""
        return (*shape[:2], self.window_rows, *shape[3:]) if attr == "keys" else shape

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *states: torch.Tensor):
        states = tuple(t.clone() for t in states)  # the step writes its own copies and returns them
        for (i, attr, _), t in zip(self.names, states):
            setattr(self.cache.layers[i], attr, t)
        self.cache.bind_positions(positions)
        pos = positions.view(-1, 1)
        held = torch.arange(self.window_rows, device=positions.device).view(1, -1)
        dtype = self.model.dtype
        visible = held + (pos - (self.window_rows - 1)) >= 0  # [B, window_rows]: the row's position is >= 0
        mask = torch.where(visible, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, position_ids=pos,
                         attention_mask={"sliding_attention": mask[:, None, None, :]})
        return (out.logits, *states)


def _decompose(ep: ExportedProgram) -> ExportedProgram:
    from dayzero.frontend.torch_export import decompose

    return decompose(ep)


def export_with_cache(model: torch.nn.Module, max_cache_len: int, batch_size: int = 1, max_seq: int = 32,
                      *, min_seq: int = 1, decompose: bool = True,
                      step: CacheStep | None = None) -> tuple[ExportedProgram, DecodeExportInfo]:
    """Export ``model`` as one stateful step ``(input_ids [B, seq], cache_position [seq]) -> logits``.

    ``seq`` is a symbolic dimension in ``[min_seq, max_seq]``; the cache tensors are buffers mutated by the program
    (``BUFFER_MUTATION`` outputs after decomposition). Prefill: ``cache_position = arange(P)``; decode:
    ``cache_position = [P + i]``. ``ep.module()`` keeps the cache state between calls. Programs exported from one
    ``step`` (a :class:`CacheStep` of ``model``) share its cache tensors, and so does running ``step`` eagerly.
    """
    if max_seq > max_cache_len:
        raise UserError(f"max_seq {max_seq} exceeds max_cache_len {max_cache_len}")
    model = model.eval()
    if step is None:
        step = CacheStep(model, max_cache_len, batch_size)
    if max_seq == min_seq:  # a fixed-length step (max_seq=1: the decode program); no symbol
        dynamic = None
        ex_len = max_seq
    else:
        seq = torch.export.Dim("seq", min=min_seq, max=max_seq)
        dynamic = {"input_ids": {1: seq}, "cache_position": {0: seq}}
        ex_len = min(max(min_seq, 4), max_seq)
    ids = torch.zeros((batch_size, ex_len), dtype=torch.long)
    pos = torch.arange(ex_len)
    with torch.no_grad():
        ep = torch.export.export(step, (), {"input_ids": ids, "cache_position": pos}, dynamic_shapes=dynamic,
                                 strict=False)
    # export traced one call: reset the state it wrote through the real tensors (it writes through the fakes, but
    # be defensive: the program's initial cache must be zeros)
    for name, buf in step.named_buffers():
        if name.startswith("cache_"):
            buf.zero_()
    if decompose:
        ep = _decompose(ep)
    return ep, describe(ep, step, max_seq)


def reset_cache(ep: ExportedProgram, info: DecodeExportInfo) -> None:
    """Zero the cache state. The cache tensors are non-persistent buffers: they live in ``ep.constants`` and every
    ``ep.module()`` shares them (a second ``ep.module()`` continues the first one's cache)."""
    with torch.no_grad():
        for c in info.cache:
            ep.constants[c.buffer].zero_()


def describe(ep: ExportedProgram, step: CacheStep, max_seq: int) -> DecodeExportInfo:
    cfg = step.model.config.get_text_config(decoder=True)
    info = DecodeExportInfo(step.max_cache_len, step.batch_size, max_seq, ("input_ids", "cache_position"))
    for i, attr, name in step.names:
        t = getattr(step, name)
        lt = step.layer_types[i]
        layer = step.cache.layers[i]
        window = getattr(layer, "sliding_window", None) or (
            getattr(cfg, "sliding_window", None) if lt == "sliding_attention" else None)
        info.cache.append(CacheTensor(i, attr, name, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                      step.position_dims[name], lt, window,
                                      getattr(layer, "compress_rate", None) if attr.endswith("_entries") else None))
    sig = ep.graph_signature
    out_nodes = list(ep.graph.output_node().args[0])
    for k, spec in enumerate(sig.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            info.buffer_mutations[spec.target] = spec.arg.name
            info.mutation_output_index[spec.target] = k
        elif spec.kind == OutputKind.USER_OUTPUT:
            info.user_output_index = k
    assert len(out_nodes) == len(sig.output_specs)
    cache_bufs = {c.buffer for c in info.cache}
    missing = cache_bufs - set(info.buffer_mutations)
    if missing:
        info.notes.append(f"cache buffers never updated by the graph: {sorted(missing)}")
    extra = [s.target for s in sig.input_specs if s.kind == InputKind.CONSTANT_TENSOR
             and any(s.target == m for m in cache_bufs)]
    if extra:
        info.notes.append(f"cache tensors lifted as constants: {extra}")
    return info
