"""Qwen3.5 decoder stack and its one forward pass: embed (with a VLM's image features written over the
image/video placeholder tokens) -> rotary from positions -> the repeating block of layers (scanned or one
after another, under the config's remat policy) -> final norm.
Training, scoring, prefill and decoding all call `Qwen35ForCausalLM.__call__`; a cache argument is
what differs (`layers/cache.py`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.attention import Attention
from qwen35_jax.layers.cache import AttentionCache, GdnCache, HybridCache, LayerCache, is_decode_step
from qwen35_jax.layers.gated_deltanet import GatedDeltaNet
from qwen35_jax.layers.mlp import MLP
from qwen35_jax.layers.moe import SparseMoeBlock
from qwen35_jax.layers.norms import RMSNorm
from qwen35_jax.layers.rope import rope_cos_sin
from qwen35_jax.layers.tiling import tiled_over_sequence
from qwen35_jax.parallel.local import token_local
from qwen35_jax.parallel.mesh import ACT_BSD, FSDP, SP, auto_mesh, constrain, mesh_axis_size, rows_spec
from qwen35_jax.parallel.padding import pad_inputs, strip
from qwen35_jax.vision.inputs import VisionInputs
from qwen35_jax.vision.tower import VisionTower


class DecoderLayer(nnx.Module):
    """Pre-norm residual layer: token mixer (`linear_attn` GDN or `self_attn`), then MLP or MoE."""

    def __init__(self, config: Qwen35Config, kind: str, *, rngs: nnx.Rngs):
        self.kind = kind
        eps, pd = config.rms_norm_eps, config.param_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, param_dtype=pd)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, rngs=rngs)
        elif kind == "full_attention":
            self.self_attn = Attention(config, rngs=rngs)
        else:
            raise ValueError(f"unknown layer kind {kind!r}")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, param_dtype=pd)
        self.mlp = SparseMoeBlock(config, rngs=rngs) if config.is_moe else MLP(config, rngs=rngs)
        self.recompute_mlp = config.remat == "mlp"  # the MoE block reads the same setting itself
        self.sequence_tile = config.kernels.sequence_tile  # tokens per feed-forward tile (None: untiled)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                 cache: LayerCache | None = None) -> jax.Array | tuple[jax.Array, AttentionCache | GdnCache]:
        """x: [B, S, D], cos/sin: [B, S, R], segment_ids: [B, S] -> [B, S, D]; with `cache`, also the
        layer's stacked cache after the call. A decode step's rows are whole on a device (no sequence
        axis to split): the feed-forward runs as plain calls, no tiles and no shard_map."""
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h = self.linear_attn(h, segment_ids, cache)
        else:
            h = self.self_attn(h, cos, sin, segment_ids, cache)
        h, updated = h if cache is not None else (h, None)
        if is_decode_step(x, cache):
            x = x + h
            mlp = self.mlp.route_and_mix if isinstance(self.mlp, SparseMoeBlock) else self.mlp
            x = x + mlp(self.post_attention_layernorm(x))
        else:
            x = self.feed_forward_residual(constrain(x + h, ACT_BSD))
        return x if cache is None else (x, updated)

    def feed_forward_residual(self, x: jax.Array) -> jax.Array:
        """x + mlp(post_attention_layernorm(x)) on sequence shards. [B, S, D] -> [B, S, D]"""
        if isinstance(self.mlp, SparseMoeBlock):  # tiles its own tokens inside token_local
            return constrain(x + token_local(self.mlp, self.post_attention_layernorm(x)), ACT_BSD)
        return constrain(tiled_over_sequence(DecoderLayer.feed_forward, self, x, recompute=self.recompute_mlp,
                                             tile=self.sequence_tile), ACT_BSD)

    def feed_forward(self, x: jax.Array) -> jax.Array:
        """x + mlp(post_attention_layernorm(x)): token-local, so it may run tile by tile. [B, S, D] -> [B, S, D]"""
        return x + self.mlp(self.post_attention_layernorm(x))


LAYER_INPUT = "decoder_layer_input"  # checkpoint name of every layer's input under remat "offload"


def _offload_layer_inputs() -> Callable[..., bool]:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src="device", offload_dst="pinned_host")


def check_offload_supported() -> None:
    """One-line ValueError unless the default device has a `pinned_host` memory to offload to."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in kinds:
        raise ValueError(f"remat 'offload' needs a 'pinned_host' memory on {jax.devices()[0].platform}, "
                         f"which has {sorted(kinds)}; use remat 'nested'")


class Block(nnx.Module):
    """One period of `layer_types` (e.g. 3 GDN + 1 attention); stacked over blocks by the model."""

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs):
        p = config.block_period
        self.remat = config.remat
        self.layers = nnx.List([DecoderLayer(config, config.layer_types[j], rngs=rngs) for j in range(p)])

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                 cache: HybridCache | None = None, block: int = 0
                 ) -> jax.Array | tuple[jax.Array, tuple[AttentionCache | GdnCache, ...]]:
        """x: [B, S, D] -> [B, S, D]; without a cache every layer under its own checkpoint for remat
        layer/nested/offload; with one (this block's slot `block` of it), also the updated layer
        caches (`HybridCache.layers`)."""
        if cache is not None:
            updated = []
            for layer, stacked in zip(self.layers, cache.layers):
                x, stacked = layer(x, cos, sin, segment_ids, LayerCache(stacked, block, cache.lengths))
                updated.append(stacked)
            return x, tuple(updated)
        per_layer = self.remat in ("layer", "nested", "offload")
        for layer in self.layers:
            if self.remat == "offload":
                x = checkpoint_name(x, LAYER_INPUT)
            if per_layer:
                x = nnx.remat(lambda layer, x: layer(x, cos, sin, segment_ids))(layer, x)
            else:
                x = layer(x, cos, sin, segment_ids)
        return x


EMBED_SCOPE = "embed_lookup"
UNROLLABLE_REMAT = ("none", "mlp")  # policies under which GPU runs the blocks one after another


def scans_layers(config: Qwen35Config, backend: str | None = None) -> bool:
    """`config.scan_layers` with "auto" resolved for `backend` ("cpu", "gpu", "tpu"; None: the
    platform of the config's kernel choices):
    one after another only on GPU and only where no block is recomputed (remat "none" or "mlp"). The
    scan orders a recomputing backward block by block; unrolled, XLA is free to start every block's
    backward buffers at once (docs/training.md, "Layer loop"). "mlp" recomputes one layer's
    feed-forward inside that layer's backward only."""
    if config.scan_layers == "auto":
        return (backend or config.kernels.resolve().platform) != "gpu" or config.remat not in UNROLLABLE_REMAT
    return bool(config.scan_layers)


def embed_lookup(table: jax.Array, tokens: jax.Array, dtype: str) -> jax.Array:
    """table [V, D], tokens [B, S] int -> [B, S, D] rows of the table in `dtype`.

    Under a mesh the table is split over its hidden dim on all F * sp devices, each device looks up
    its slice for every token and one all-to-all hands each device its own [B/F, S/sp, D] rows. A
    gather from the vocabulary-sharded table would instead build (and, for the gradient, reduce) a
    whole-sequence [B, S, D] array on every device. B and S are multiples of F and sp (padded).
    """
    mesh = auto_mesh()
    fsdp, sp = mesh_axis_size(mesh, FSDP), mesh_axis_size(mesh, SP)
    n, (b, s), d = fsdp * sp, tokens.shape, table.shape[1]
    if mesh is None or d % n or b % fsdp or s % sp:
        return jnp.take(table.astype(dtype), tokens, axis=0)
    table = constrain(table, P(None, (FSDP, SP)))

    def local(t: jax.Array, tok: jax.Array) -> jax.Array:  # t [V, D/n], tok [B, S] -> [B/F, S/sp, D]
        x = jnp.take(t.astype(dtype), tok, axis=0)  # [B, S, D/n]
        x = x.reshape(fsdp, b // fsdp, sp, s // sp, d // n).transpose(0, 2, 1, 3, 4)
        x = x.reshape(n, b // fsdp, s // sp, d // n)  # [device, B/F, S/sp, D/n], devices fsdp-major
        x = jax.lax.all_to_all(x, (FSDP, SP), 0, 0)  # x[j]: hidden slice j of this device's tokens
        return jnp.moveaxis(x, 0, 2).reshape(b // fsdp, s // sp, d)

    with jax.named_scope(EMBED_SCOPE):
        return jax.shard_map(local, mesh=mesh, in_specs=(P(None, (FSDP, SP)), P()), out_specs=ACT_BSD,
                             check_vma=False)(table, tokens)


def document_positions(segment_ids: jax.Array) -> jax.Array:
    """[B, S] -> [B, S] int32 positions restarting at 0 at every document start."""
    s = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def default_positions(shape: tuple[int, int], segment_ids: jax.Array | None, lengths: jax.Array | None
                      ) -> jax.Array:  # [B, S] int32
    """The text positions of tokens [B, S]: after each row's `lengths` [B] cached tokens, else each
    document's token index (`segment_ids`), else 0..S-1."""
    idx = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
    if lengths is not None:
        return lengths.astype(jnp.int32)[:, None] + idx
    return idx if segment_ids is None else document_positions(segment_ids)


class Qwen35ForCausalLM(nnx.Module):
    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs):
        self.config = config
        dt, pd = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dt, param_dtype=pd, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(0.02))

        @nnx.split_rngs(splits=config.num_blocks)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(config, rngs=rngs)

        self.blocks = make_blocks(rngs)  # every param gains a leading [num_blocks] axis
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=config.param_dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dt,
                                      param_dtype=pd, rngs=rngs, kernel_init=nnx.initializers.normal(0.02))
        self.visual: VisionTower | None = None  # built last: the text parameters draw the same random numbers
        if config.vision is not None:
            config.check_vision_fits()
            self.visual = nnx.data(VisionTower(config.vision, config.dtype, config.param_dtype,
                                               remat=config.remat != "none", rngs=rngs))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 cache: HybridCache | None = None, vision: VisionInputs | None = None
                 ) -> jax.Array | tuple[jax.Array, HybridCache]:
        """tokens [B, S] int, positions [B, S] or [3, B, S], segment_ids [B, S] (>= 1, 0 = padding)
        -> final-normed hidden states [B, S, D] in the compute dtype (no lm_head); with `cache`, also
        the cache holding the call's tokens after what it held (`layers/cache.py`).

        `vision` (a VLM only; `vision/inputs.py`): the images of the batch, whose feature rows replace the
        embeddings of the image/video placeholder tokens in row-major [B, S] order (see `embed`). Their
        positions are the caller's: mrope [3, B, S] from `data/mrope.py`. None: no tower in the program.

        The one forward pass of training, scoring, prefill and decoding: embed, rotary from the
        positions, the blocks, the final norm. Positions default to each document's token index, or
        with a cache to the slots the tokens fill. Without a cache any [B, S] runs on any mesh (padded
        here to whole shards, stripped after); with one the caller lays the rows out: a prompt with
        B a multiple of fsdp x sp and S of sp, a decode step (S = 1) with its rows split over every
        device and no sequence split."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, S], got shape {tokens.shape}")
        if segment_ids is not None and segment_ids.shape != tokens.shape:
            raise ValueError(f"segment_ids shape {segment_ids.shape} does not match tokens {tokens.shape}")
        b, s = tokens.shape
        if positions is None:
            positions = default_positions(tokens.shape, segment_ids, None if cache is None else cache.lengths)
        if positions.shape[-2:] != tokens.shape:
            raise ValueError(f"positions shape {positions.shape} does not match tokens {tokens.shape}")
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
        decoding = is_decode_step(tokens, cache)
        if cache is None:  # S padded to a multiple of sp, B to one of fsdp (segment 0), stripped at the end
            mesh = auto_mesh()
            tokens, positions, segment_ids = pad_inputs(
                tokens, positions, segment_ids, mesh_axis_size(mesh, FSDP), mesh_axis_size(mesh, SP))
        cos, sin = rope_cos_sin(positions, self.config)  # [B, S, R]
        x = self.embed(tokens, decoding, vision, segment_ids)  # [B, S, D]
        x, layers = self.run_blocks(x, cos, sin, segment_ids, cache)
        if cache is None:
            return strip(constrain(self.norm(x), ACT_BSD), b, s)
        hidden = constrain(self.norm(x), rows_spec(3) if decoding else ACT_BSD)
        lengths = cache.lengths + jnp.sum(segment_ids > 0, axis=1, dtype=jnp.int32)
        return hidden, HybridCache(layers=layers, lengths=lengths)

    def embed(self, tokens: jax.Array, decoding: bool = False, vision: VisionInputs | None = None,
              segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens [B, S] -> [B, S, D] in the compute dtype: sequence shards (`embed_lookup`), or for a
        decode step whole rows split over every device. With `vision`, the tower's feature rows then
        replace, in order, the embeddings of the image/video placeholder tokens (not of padding,
        segment 0) taken row-major over the whole [B, S] batch (`merge_vision`)."""
        table = self.embed_tokens.embedding[...]
        spec = rows_spec(3) if decoding else ACT_BSD
        if decoding:
            x = constrain(jnp.take(table.astype(self.config.dtype), tokens, axis=0), spec)
        else:
            x = constrain(embed_lookup(table, tokens, self.config.dtype), spec)
        if vision is None:
            return x
        return constrain(self.merge_vision(tokens, x, vision, segment_ids), spec)

    def merge_vision(self, tokens: jax.Array, x: jax.Array, vision: VisionInputs,
                     segment_ids: jax.Array | None = None) -> jax.Array:
        """Embeddings x [B, S, D] with placeholder k (row-major over [B, S]) replaced by the tower's
        feature row k. Computed on the whole batch (tokens are never split), so the order spans rows
        and sequence shards; the caller constrains the result to its sharding. The counts must match
        (`vision.inputs.check_vision_tokens`, on the host): surplus placeholders would reuse the last row."""
        if self.visual is None:
            raise ValueError("vision inputs were given but this model has no vision tower (config.vision is None)")
        if not isinstance(vision, VisionInputs):
            vision = VisionInputs(*vision)
        feats = self.visual(*vision).astype(x.dtype)  # [P / merge_unit, D]
        cfg = self.config
        mask = (tokens == cfg.image_token_id) | (tokens == cfg.video_token_id)  # [B, S]
        if segment_ids is not None:
            mask &= segment_ids > 0
        index = jnp.cumsum(mask.reshape(-1), dtype=jnp.int32).reshape(mask.shape) - 1  # [B, S]
        rows = jnp.take(feats, jnp.clip(index, 0, feats.shape[0] - 1), axis=0)  # [B, S, D]
        return jnp.where(mask[..., None], rows, x)

    def run_blocks(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                   cache: HybridCache | None) -> tuple[jax.Array, tuple[AttentionCache | GdnCache, ...] | None]:
        """The one block iterator: x [B, S, D] through every block -> [B, S, D] (and with `cache`,
        its updated `layers`).

        Without a cache: under the config's remat policy, scanned or one after another as
        `scans_layers` says. With one: one after another, each block writing its slot of the stacked
        cache in place (a scan would read each block's cache as a slice and stack the updated ones
        into a new buffer, copying the whole cache every token)."""
        step = self.block_step(cos, sin, segment_ids)
        if cache is None and scans_layers(self.config):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def run(block: Block, x: jax.Array) -> jax.Array:
                return step(block, x)

            return run(self.blocks, x), None
        graphdef, stacked = nnx.split(self.blocks)  # block i is the i-th slice of every stacked parameter
        for i in range(self.config.num_blocks):
            block = nnx.merge(graphdef, jax.tree.map(lambda p, i=i: p[i], stacked))
            if cache is None:
                x = step(block, x)
            else:
                x, layers = block(x, cos, sin, segment_ids, cache, i)
                cache = cache._replace(layers=layers)
                if is_decode_step(x, cache):
                    x = constrain(x, rows_spec(3))
        return x, None if cache is None else cache.layers

    def block_step(self, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array
                   ) -> Callable[[Block, jax.Array], jax.Array]:
        """`step(block, x)`: one block of the training pass under the config's remat policy."""
        def step(block: Block, x: jax.Array) -> jax.Array:
            return block(x, cos, sin, segment_ids)

        remat = self.config.remat
        if remat in ("full", "nested", "auto"):  # "auto" is the trainer's to resolve (train/remat_choice.py)
            return nnx.remat(step)
        if remat == "dots":
            return nnx.remat(step, policy=jax.checkpoint_policies.dots_saveable)
        if remat == "offload":
            check_offload_supported()
            return nnx.remat(step, policy=_offload_layer_inputs())
        return step

    def lm_head_weight(self) -> jax.Array:
        """[D, V]: the lm_head kernel, or the embedding transposed when tied."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., D] -> logits [..., V] in float32 (matmul in the compute dtype).

        Materialises [..., V]: for training losses use lm_head_weight() with the fused log-prob kernel."""
        w = self.lm_head_weight().astype(hidden.dtype)
        return jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)


def with_config(model: Qwen35ForCausalLM, config: Qwen35Config) -> Qwen35ForCausalLM:
    """`model`'s arrays under `config`, a config that differs from the model's only in how it runs
    (kernel choices, GDN sequence-parallel mode, remat, layer loop, compute dtype): the same
    parameters, shardings included, no copy."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))
