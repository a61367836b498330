"""Qwen3.5 decoder stack: embed -> the repeating block of layers, scanned or one after another
(`scan_layers`), under the config's remat policy -> final norm."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from qwen35_kernels.choices import current_choices

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.attention import Attention
from qwen35_jax.layers.cache import AttentionCache, GdnCache
from qwen35_jax.layers.gated_deltanet import GatedDeltaNet
from qwen35_jax.layers.mlp import MLP
from qwen35_jax.layers.moe import SparseMoeBlock
from qwen35_jax.layers.norms import RMSNorm
from qwen35_jax.layers.rope import rope_cos_sin
from qwen35_jax.layers.tiling import tiled_over_sequence
from qwen35_jax.parallel.local import token_local
from qwen35_jax.parallel.mesh import ACT_BSD, FSDP, SP, auto_mesh, constrain, mesh_axis_size
from qwen35_jax.parallel.padding import pad_inputs, strip


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

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x: [B, S, D], cos/sin: [B, S, R], segment_ids: [B, S] -> [B, S, D]"""
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h = self.linear_attn(h, segment_ids)
        else:
            h = self.self_attn(h, cos, sin, segment_ids)
        return self.feed_forward_residual(constrain(x + h, ACT_BSD))

    def prefill(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array, lengths: jax.Array
                ) -> tuple[jax.Array, AttentionCache | GdnCache]:
        """The layer on right-padded prompts (x [B, S, D], lengths [B]) -> [B, S, D] and its cache: K and
        V of every position [B, S, K, Dh], or the GDN conv window and state after each prompt."""
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h, cache = self.linear_attn.prefill(h, segment_ids, lengths)
        else:
            h, k, v = self.self_attn.prefill(h, cos, sin, segment_ids)
            cache = AttentionCache(k=k, v=v)
        return self.feed_forward_residual(constrain(x + h, ACT_BSD)), cache

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: AttentionCache | GdnCache, block: int,
               positions: jax.Array) -> tuple[jax.Array, AttentionCache | GdnCache]:
        """One new token per row at `positions` [B]: x [B, 1, D], cos/sin [B, 1, R] -> [B, 1, D], and
        `cache` (stacked over blocks, this layer's at `block`) updated in place. Rows are whole on a
        device (no sequence axis to split): plain calls, no shard_map."""
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h, cache = self.linear_attn.decode(h, cache, block)
        else:
            h, cache = self.self_attn.decode(h, cos, sin, cache, block, positions)
        x = x + h
        mlp = self.mlp.route_and_mix if isinstance(self.mlp, SparseMoeBlock) else self.mlp
        return x + mlp(self.post_attention_layernorm(x)), cache

    def feed_forward_residual(self, x: jax.Array) -> jax.Array:
        """x + mlp(post_attention_layernorm(x)) on sequence shards. [B, S, D] -> [B, S, D]"""
        if isinstance(self.mlp, SparseMoeBlock):  # tiles its own tokens inside token_local
            return constrain(x + token_local(self.mlp, self.post_attention_layernorm(x)), ACT_BSD)
        return constrain(tiled_over_sequence(DecoderLayer.feed_forward, self, x, recompute=self.recompute_mlp),
                         ACT_BSD)

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

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x: [B, S, D] -> [B, S, D]; every layer under its own checkpoint for remat layer/nested/offload."""
        per_layer = self.remat in ("layer", "nested", "offload")
        for layer in self.layers:
            if self.remat == "offload":
                x = checkpoint_name(x, LAYER_INPUT)
            if per_layer:
                x = nnx.remat(lambda layer, x: layer(x, cos, sin, segment_ids))(layer, x)
            else:
                x = layer(x, cos, sin, segment_ids)
        return x

    def prefill(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array, lengths: jax.Array
                ) -> tuple[jax.Array, tuple[AttentionCache | GdnCache, ...]]:
        """`DecoderLayer.prefill` layer by layer: [B, S, D] -> [B, S, D] and one cache per layer."""
        caches = []
        for layer in self.layers:
            x, cache = layer.prefill(x, cos, sin, segment_ids, lengths)
            caches.append(cache)
        return x, tuple(caches)

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, caches: tuple[AttentionCache | GdnCache, ...],
               block: int, positions: jax.Array) -> tuple[jax.Array, tuple[AttentionCache | GdnCache, ...]]:
        """`DecoderLayer.decode` layer by layer: [B, 1, D] -> [B, 1, D] and the updated caches
        (stacked over blocks, this block's at `block`)."""
        updated = []
        for layer, cache in zip(self.layers, caches):
            x, cache = layer.decode(x, cos, sin, cache, block, positions)
            updated.append(cache)
        return x, tuple(updated)


EMBED_SCOPE = "embed_lookup"
UNROLLABLE_REMAT = ("none", "mlp")  # policies under which GPU runs the blocks one after another


def scans_layers(config: Qwen35Config, backend: str | None = None) -> bool:
    """`config.scan_layers` with "auto" resolved for `backend` (None: the kernel choices' platform), read
    at trace time:
    one after another only on GPU and only where no block is recomputed (remat "none" or "mlp"). The
    scan orders a recomputing backward block by block; unrolled, XLA is free to start every block's
    backward buffers at once (the 0.8B at 4 x 8,192 tokens under "full": 29.7 GiB scanned, 47.7
    unrolled). "mlp" recomputes one layer's feed-forward inside that layer's backward only."""
    if config.scan_layers == "auto":
        return (backend or current_choices().platform) != "gpu" or config.remat not in UNROLLABLE_REMAT
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

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens [B, S] int, positions [B, S] or [3, B, S], segment_ids [B, S] (>= 1, 0 = padding)
        -> final-normed hidden states [B, S, D] in the compute dtype (no lm_head)."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, S], got shape {tokens.shape}")
        if segment_ids is not None and segment_ids.shape != tokens.shape:
            raise ValueError(f"segment_ids shape {segment_ids.shape} does not match tokens {tokens.shape}")
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        elif positions is None:
            positions = document_positions(segment_ids)
        if positions.shape[-2:] != tokens.shape:
            raise ValueError(f"positions shape {positions.shape} does not match tokens {tokens.shape}")
        b, s = tokens.shape  # S padded to a multiple of sp, B to one of fsdp (segment 0), stripped at the end
        mesh = auto_mesh()
        tokens, positions, segment_ids = pad_inputs(
            tokens, positions, segment_ids, mesh_axis_size(mesh, FSDP), mesh_axis_size(mesh, SP))
        if positions.ndim == 2 and self.config.mrope_section is not None:
            positions = jnp.broadcast_to(positions, (3, *positions.shape))  # text: t = h = w
        cos, sin = rope_cos_sin(positions, self.config)  # [B, S, R]
        x = constrain(embed_lookup(self.embed_tokens.embedding[...], tokens, self.config.dtype), ACT_BSD)  # [B, S, D]

        def step(block: Block, x: jax.Array) -> jax.Array:
            return block(x, cos, sin, segment_ids)

        remat = self.config.remat
        if remat in ("full", "nested", "auto"):  # "auto" is the trainer's to resolve (train/remat_choice.py)
            step = nnx.remat(step)
        elif remat == "dots":
            step = nnx.remat(step, policy=jax.checkpoint_policies.dots_saveable)
        elif remat == "offload":
            check_offload_supported()
            step = nnx.remat(step, policy=_offload_layer_inputs())

        if scans_layers(self.config):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def run(block: Block, x: jax.Array) -> jax.Array:
                return step(block, x)

            x = run(self.blocks, x)
        else:  # block i is the i-th slice of every stacked parameter
            graphdef, stacked = nnx.split(self.blocks)
            for i in range(self.config.num_blocks):
                x = step(nnx.merge(graphdef, jax.tree.map(lambda p, i=i: p[i], stacked)), x)
        return strip(constrain(self.norm(x), ACT_BSD), b, s)

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
