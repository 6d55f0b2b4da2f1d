"""Fixed-size cache state for DeepSeek-V4's compressed attention: one exported decode graph valid at every position.

transformers' V4 cache layers (``DeepseekV4HCACache`` / ``DeepseekV4CSACache``, ``modeling_deepseek_v4.py``) grow
by ``torch.cat``: the sliding K=V window, the compressed entries (one per ``compress_rate`` tokens), a pending
buffer of ``position mod compress_rate`` projected tokens, the CSA overlap (the last window's ``Ca`` half) and a
Python-int ``entry_count``; the compressors branch on those lengths (``chunk_kv.shape[1] > 0``, ``prior_kv is
None``). Traced, a graph bakes in the phase it saw. This module gives the same *cache-side* API with tensors of
fixed shape, so the upstream compressor, indexer and attention code runs unmodified on top of it:

* sliding branch (every layer): ``keys`` [B, 1, L, D] holds every position (K = V, one buffer); the window is the
  sliding-window mask transformers builds from ``get_mask_sizes`` (as the gpt-oss path does), so only the new
  rows are written per step.
* per compressor (``compressor``; CSA layers also ``indexer``), for rate R and width w (D, or 2D with overlap):
  ``{name}_pending_kv`` / ``{name}_pending_gate`` [B, R, w]: the projected tokens of the window that is open,
  slot j = position ``window * R + j`` (upstream's ``buffer_kv`` / ``buffer_gate``, as a ring of one window);
  ``{name}_entries`` [B, E + 1, d], E = ceil(L / R): entry e pools window e (upstream's ``compressed_kv``);
  row E is a scratch row that absorbs writes past the end;
  CSA only: ``{name}_overlap_kv`` / ``{name}_overlap_gate`` [B, R, d]: the ``Ca`` half of the last closed window,
  gate with ``position_bias`` already added (upstream's ``overlap_kv`` / ``overlap_gate``).

How a call at positions ``[s, s + n)`` maps onto upstream's (``store_compression_weights`` and friends below):
the chunk handed to the compressor always starts at the open window ``a = s // R`` and spans the
``W = (n + R - 2) // R + 1`` windows the new tokens touch (``W = 1`` in decode; a traced prefill takes one spare
window): positions before ``s`` come from the pending ring, the rest from the new tokens. Upstream hands over only
the *closed* windows; here the last window may still be open, and the compressor pools it anyway into a "would-be"
entry. The pending ring and the overlap are then rewritten whole (R rows each, a copy independent of L). Every
entry is written at its own row ``a + k`` unconditionally; an entry is *valid* for a query at position p iff
``e < (p + 1) // R`` — exactly upstream's causal rule for its compressed entries (``block_bias`` / the indexer's
``future_mask``), which therefore hides open windows, and the entry is rewritten when its window closes (the step
at its last position pools the complete window). So one graph serves every phase; no
``where(position % R == R - 1, new, old)`` is even needed.

The one upstream branch that is not position-generic: for ``seq_len == 1`` the HCA compressor returns no block bias
(upstream's running list then holds only valid entries). A forward pre-hook on the HCA attention modules
(:func:`install_decode_validity_bias`) appends upstream's own causal block bias (``entry >= (p + 1) // R`` ->
-inf) to the attention mask in that case; CSA's bias always comes from the indexer's top-k scatter, which applies
the same causal rule. The math of the attention, compressors and indexer stays upstream's.

Prefill of any length ``n`` at any start ``s`` works (no padding to the compression rate; the prefill program
exports with ``seq`` in [1, max]): a second turn starts mid-window and continues from the pending ring. Right
padding would *not* be harmless here (a padded tail would be taken for the open window's tokens and its overlap), so
it must stay that way: tests/test_generate.py checks the compiled prefill's range.

The batched decode step (``decode_export.RowDecodeStep``, the ``decode_batch`` program) batches requests along B:
``RowCompressedAttentionCache``'s layers apply the same rules to one token per batch row, each row at its own
position (the K=V state holds only the window ending at the row's token, the token written as its last row; a
per-row scatter of the entry, per-row pending / overlap selects), and a pre-hook on the compressors' rotary
embeddings gives each row's pooled entry its own window position (upstream passes one ``first_window_position``
for the whole batch).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer

from dayzero import InternalError

# the config's layer types whose upstream cache layers are compressor caches (modeling_deepseek_v4.py)
HCA = "heavily_compressed_attention"
CSA = "compressed_sparse_attention"
SLIDING = "sliding_attention"


def is_compressed_cache_config(cfg) -> bool:
    """True when the config's layer types include the compressed-attention types this module implements."""
    return bool({HCA, CSA} & set(getattr(cfg, "layer_types", None) or ()))


class SharedKVSlidingLayer(StaticLayer):
    """Sliding-window K=V cache as one full-length buffer ``keys`` [B, 1, L, D]; ``values`` is ``keys``.

    Upstream's ``DeepseekV4HCACache.update`` keeps the last ``window - 1`` tokens and returns them concatenated with
    the new ones; here every position stays and the sliding-window causal mask (``kv_idx > q_idx - window``)
    selects the same keys. The write offset is ``cumulative_length`` (bound from ``cache_position[0]`` by the
    export wrapper every call, never incremented here)."""

    is_sliding = True

    def __init__(self, max_cache_len: int, sliding_window: int):
        super().__init__(max_cache_len)
        self.sliding_window = sliding_window

    @property
    def values(self):
        return self.keys

    @values.setter
    def values(self, _):  # K = V: the one buffer is `keys`
        pass

    def state_attrs(self) -> list[tuple[str, int | None]]:
        """(attribute, token-position dim) of every state tensor of this layer."""
        return [("keys", 2)]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.keys = torch.zeros((b, h, self.max_cache_len, d), dtype=key_states.dtype, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if value_states is not key_states:
            raise InternalError("SharedKVSlidingLayer holds K = V: the model passed different keys and values")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pos = torch.arange(key_states.shape[-2], device=key_states.device) + self.cumulative_length
        self.keys.index_copy_(2, pos, key_states)
        return self.keys, self.keys


class CompressorCacheLayer(SharedKVSlidingLayer):
    """Sliding K=V plus fixed-size compressor state (see the module docstring); HCA when ``overlap`` is False."""

    def __init__(self, max_cache_len: int, sliding_window: int, compress_rate: int, names: tuple[str, ...],
                 overlap: bool, layer_type: str):
        super().__init__(max_cache_len, sliding_window)
        self.compress_rate = compress_rate
        self.names = names
        self.overlap = overlap
        self.layer_type = layer_type
        self.n_entries = -(-max_cache_len // compress_rate)  # E; the buffers have E + 1 rows (last: scratch)
        self._call: dict[str, tuple] = {}  # name -> (a, W, n) of the current call
        self.end_position = torch.tensor(0)

    def bind_positions(self, cache_position: torch.Tensor) -> None:
        """The call's positions (the export wrapper binds them every call): its end ``s + n`` as a tensor, computed
        from the input rather than from the symbolic length (a SymInt added to a tensor is no graph op)."""
        self.end_position = cache_position[-1] + 1

    def state_attrs(self) -> list[tuple[str, int | None]]:
        out = super().state_attrs()
        for name in self.names:
            out += [(f"{name}_pending_kv", None), (f"{name}_pending_gate", None), (f"{name}_entries", 1)]
            if self.overlap:
                out += [(f"{name}_overlap_kv", None), (f"{name}_overlap_gate", None)]
        return out

    def _state(self, name: str, part: str) -> torch.Tensor:
        return getattr(self, f"{name}_{part}")

    def _allocate(self, name: str, kv: torch.Tensor) -> None:
        if hasattr(self, f"{name}_pending_kv"):
            return
        b, _, w = kv.shape
        z = dict(dtype=kv.dtype, device=kv.device)
        setattr(self, f"{name}_pending_kv", torch.zeros((b, self.compress_rate, w), **z))
        setattr(self, f"{name}_pending_gate", torch.zeros((b, self.compress_rate, w), **z))

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        """Upstream: concatenate the buffered tokens with the new ``(kv, gate)`` and return the closed windows.
        Here: the ``W`` windows from the open window ``a = s // R`` on, positions before ``s`` from the pending ring;
        the ring then holds the window that is open after this call. Returns ``(chunk_kv, chunk_gate, a * R)``."""
        self._allocate(name, kv)
        r = self.compress_rate
        b, n, w = kv.shape
        s = self.cumulative_length
        a = torch.div(s, r, rounding_mode="floor")
        off = s - a * r
        # the windows the positions [s, s + n) touch for any s % r are (n + r - 2) // r + 1: one (the open one) for
        # a decode step; a traced prefill (symbolic n) takes one spare window, so that upstream's overlap copy
        # `new_kv[:, 1:] = chunk[:, :-1]` never sees a size-1 window dim (torch.export would turn its broadcast
        # check into a guard W != 2 on the sequence length). One floor division, so that the chunk length is
        # r * W to torch.export and the compressor's view(B, W, r, -1) is exact.
        windows = (n + 2 * r - 2) // r if isinstance(n, int) else (n + 3 * r - 2) // r
        pend_kv, pend_gate = self._state(name, "pending_kv"), self._state(name, "pending_gate")
        j = torch.arange(windows * r, device=kv.device)
        # chunk slot j is position a*r + j: the pending ring's slot j before s, new token j - off from s on
        # (past the last new token: the last new token again, with the bound as a tensor from the positions)
        idx = torch.minimum(torch.where(j < off, j, j - off + r), self.end_position - 1 - s + r)
        chunk_kv = torch.cat([pend_kv, kv], dim=1).index_select(1, idx)
        chunk_gate = torch.cat([pend_gate, gate], dim=1).index_select(1, idx)
        # the window open after this call (it holds position s + n) becomes the pending ring; when s + n closes
        # the last window the next one has no token yet, and any content will do (every slot is written first)
        rel = torch.div(self.end_position, r, rounding_mode="floor") - a
        if isinstance(windows, int):  # decode: the spare-less chunk; a traced prefill's spare window keeps rel < W
            rel = rel.clamp(max=windows - 1)
        rel = rel.reshape(1)
        pend_kv.copy_(chunk_kv.view(b, windows, r, w).index_select(1, rel).squeeze(1))
        pend_gate.copy_(chunk_gate.view(b, windows, r, w).index_select(1, rel).squeeze(1))
        self._call[name] = (a, windows, n)
        return chunk_kv, chunk_gate, a * r

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        """Upstream: return the previous call's last-window ``Ca`` half (None on the first window) and keep this
        call's. Here the prior is the stored one, or zero-kv / -inf-gate (softmax weight 0, what upstream leaves in
        place of None) when the chunk starts at window 0; the stored one becomes the ``Ca`` half of the last window
        this call closed, if it closed any."""
        a, windows, n = self._call[name]
        r = self.compress_rate
        if not hasattr(self, f"{name}_overlap_kv"):
            b = chunk_kv.shape[0]
            setattr(self, f"{name}_overlap_kv", chunk_kv.new_zeros((b, r, head_dim)))
            setattr(self, f"{name}_overlap_gate", chunk_gate.new_zeros((b, r, head_dim)))
        ov_kv, ov_gate = self._state(name, "overlap_kv"), self._state(name, "overlap_gate")
        first = a == 0
        prior_kv = torch.where(first, torch.zeros_like(ov_kv), ov_kv)
        prior_gate = torch.where(first, torch.full_like(ov_gate, float("-inf")), ov_gate)
        last = torch.div(self.end_position, r, rounding_mode="floor") - 1 - a  # chunk index of the last closed window
        sel = last.clamp(min=0).reshape(1)
        closed = last >= 0
        ov_kv.copy_(torch.where(closed, chunk_kv.index_select(1, sel)[:, 0, :, :head_dim], prior_kv))
        ov_gate.copy_(torch.where(closed, chunk_gate.index_select(1, sel)[:, 0, :, :head_dim], ov_gate))
        return prior_kv, prior_gate

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """Upstream: append the new entries to the running list and return it. Here: write entry ``a + k`` at its
        row (rows past the end land in the scratch row E) and return all E + 1 rows; validity is the causal rule."""
        a, windows, _ = self._call[name]
        if not hasattr(self, f"{name}_entries"):
            b, _, d = compressed.shape
            setattr(self, f"{name}_entries", compressed.new_zeros((b, self.n_entries + 1, d)))
        entries = self._state(name, "entries")
        rows = (a + torch.arange(windows, device=compressed.device)).clamp(max=self.n_entries)
        entries.index_copy_(1, rows, compressed)
        return entries


class CompressedAttentionCache(Cache):
    """dayzero's static counterpart of the dynamic cache transformers builds for DeepSeek-V4's layer types."""

    sliding_layer = SharedKVSlidingLayer
    compressor_layer = CompressorCacheLayer

    def __init__(self, config, max_cache_len: int):
        layers = []
        window = config.sliding_window
        for lt in config.layer_types:
            if lt == SLIDING:
                layers.append(self.sliding_layer(max_cache_len, window))
            elif lt == HCA:
                layers.append(self.compressor_layer(max_cache_len, window, config.compress_rates[HCA],
                                                    ("compressor",), overlap=False, layer_type=lt))
            elif lt == CSA:
                layers.append(self.compressor_layer(max_cache_len, window, config.compress_rates[CSA],
                                                    ("compressor", "indexer"), overlap=True, layer_type=lt))
            else:
                raise InternalError(f"no static compressed-cache layer for layer type {lt!r}")
        super().__init__(layers=layers)


# ---- the batched decode step: B requests, one token each, each at its own position -----------------------------

class RowSlidingLayer(SharedKVSlidingLayer):
    """:class:`SharedKVSlidingLayer` whose batch rows are different requests, row b's token at ``positions[b]``
    (bound every call by ``bind_positions``). ``keys`` [B, H, W, D] holds the window that ends at each row's
    token (``decode_export.RowDecodeStep``): the token is its last row."""

    def bind_positions(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if value_states is not key_states:
            raise InternalError("SharedKVSlidingLayer holds K = V: the model passed different keys and values")
        if key_states.shape[2] != 1:
            raise InternalError(f"the batched decode step takes one token per request, got {key_states.shape[2]}")
        self.keys.narrow(2, self.keys.shape[2] - 1, 1).copy_(key_states)
        return self.keys, self.keys


class RowCompressorLayer(CompressorCacheLayer):
    """:class:`CompressorCacheLayer` for one decode token per batch row, row b at its own position
    ``s_b = positions[b]`` (window ``a_b = s_b // R``, slot ``s_b - a_b * R``): the single-request step's rules
    row by row. The chunk is the open window (pending slots before s_b, the new token from s_b on); the pending
    ring becomes that chunk; the CSA overlap takes the chunk's ``Ca`` half in rows whose window the token closes;
    entry ``a_b`` is written at its row. Upstream rotates the pooled entry at ``first_window_position``, one value
    for the whole batch: it gets 0 here and the rope pre-hook of :class:`RowCompressedAttentionCache` adds each
    row's ``a_b * R`` to the positions of that one rotary call."""

    def bind_positions(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self.end_position = positions + 1

    update = RowSlidingLayer.update

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        r = self.compress_rate
        b, n, w = kv.shape
        if n != 1:
            raise InternalError(f"the batched decode step takes one token per request, got {n}")
        a = torch.div(self.positions, r, rounding_mode="floor")
        before = torch.arange(r, device=kv.device).view(1, r, 1) < (self.positions - a * r).view(b, 1, 1)
        pend_kv, pend_gate = self._state(name, "pending_kv"), self._state(name, "pending_gate")
        chunk_kv = torch.where(before, pend_kv, kv.expand(b, r, w))
        chunk_gate = torch.where(before, pend_gate, gate.expand(b, r, w))
        pend_kv.copy_(chunk_kv)
        pend_gate.copy_(chunk_gate)
        self._call[name] = (a, 1, n)
        self.rope_offset = a * r  # taken by the next rotary call (the pooled entry's), see the class docstring
        return chunk_kv, chunk_gate, 0

    def take_rope_offset(self) -> torch.Tensor | None:
        off, self.rope_offset = getattr(self, "rope_offset", None), None
        return off

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        a = self._call[name][0]
        r = self.compress_rate
        ov_kv, ov_gate = self._state(name, "overlap_kv"), self._state(name, "overlap_gate")
        first = (a == 0).view(-1, 1, 1)
        prior_kv = torch.where(first, torch.zeros_like(ov_kv), ov_kv)
        prior_gate = torch.where(first, torch.full_like(ov_gate, float("-inf")), ov_gate)
        closed = (torch.div(self.end_position, r, rounding_mode="floor") > a).view(-1, 1, 1)
        ov_kv.copy_(torch.where(closed, chunk_kv[:, 0, :, :head_dim], prior_kv))
        ov_gate.copy_(torch.where(closed, chunk_gate[:, 0, :, :head_dim], ov_gate))
        return prior_kv, prior_gate

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        a = self._call[name][0]
        entries = self._state(name, "entries")
        b, _, d = compressed.shape
        rows = a.clamp(max=self.n_entries).view(b, 1, 1).expand(b, 1, d)
        entries.scatter_(1, rows, compressed)
        return entries


class RowCompressedAttentionCache(CompressedAttentionCache):
    """The cache of the batched decode step: batch row b is request b, one token at its own position (bound by
    ``bind_positions``); its tensors are the requests' states stacked along the batch dim."""

    sliding_layer = RowSlidingLayer
    compressor_layer = RowCompressorLayer

    def bind_positions(self, positions: torch.Tensor) -> None:
        for layer in self.layers:
            layer.bind_positions(positions)

    def install_rope_offsets(self, model: torch.nn.Module) -> list:
        """Forward pre-hooks on the compressors' and indexers' rotary embeddings: the call right after a
        ``store_compression_weights`` (the pooled entry's) gets each row's window start added to its positions.
        Returns the hook handles."""
        def hook(module, args, kwargs):
            for layer in self.layers:
                off = layer.take_rope_offset() if isinstance(layer, RowCompressorLayer) else None
                if off is not None:
                    return args, dict(kwargs, position_ids=kwargs["position_ids"] + off.view(-1, 1))
            return None
        return [mod.rotary_emb.register_forward_pre_hook(hook, with_kwargs=True) for mod in model.modules()
                if hasattr(mod, "compress_rate") and isinstance(getattr(mod, "rotary_emb", None), torch.nn.Module)]


def install_decode_validity_bias(model: torch.nn.Module) -> list:
    """Forward pre-hooks on the attention modules of HCA layers: with a :class:`CompressedAttentionCache` and one
    query, append upstream's causal block bias over the compressed entries to the attention mask (see the module
    docstring). Returns the hook handles. Without that cache (upstream's own generate) the hooks do nothing."""
    handles = []
    for mod in model.modules():
        comp = getattr(mod, "compressor", None)
        layer_idx = getattr(mod, "layer_idx", None)
        if comp is None or layer_idx is None or not hasattr(mod, "sinks"):
            continue
        handles.append(mod.register_forward_pre_hook(_validity_hook, with_kwargs=True))
    return handles


def _validity_hook(module, args, kwargs):
    cache = kwargs.get("cache")
    mask = kwargs.get("attention_mask")
    pos = kwargs.get("position_ids")
    if not isinstance(cache, CompressedAttentionCache) or not isinstance(mask, torch.Tensor) or pos is None:
        return None
    layer = cache.layers[module.layer_idx]
    if not isinstance(layer, CompressorCacheLayer) or layer.overlap or pos.shape[1] != 1:
        return None  # CSA: the indexer's top-k bias; prefill: upstream's own block bias
    rows = layer.n_entries + 1
    entry = torch.arange(rows, device=mask.device).view(1, 1, 1, -1)
    threshold = ((pos + 1) // layer.compress_rate).unsqueeze(1).unsqueeze(-1)  # [B, 1, 1, 1]
    bias = torch.zeros((mask.shape[0], 1, 1, rows), dtype=mask.dtype, device=mask.device)
    bias = bias.masked_fill(entry >= threshold, float("-inf"))
    return args, dict(kwargs, attention_mask=torch.cat([mask, bias], dim=-1))
