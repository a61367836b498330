"""The train step: micro-batched forward/backward on the fused log-probs, one AdamW update per batch.

Parameters are ZeRO-3 sharded over (fsdp, sp), the optimizer state follows them (`optim.py`). A batch
holds K micro-batches, every field [K, B/K, S] sharded P(None, 'fsdp', 'sp'): rows over fsdp,
positions over sp. The loss is normalised by the loss tokens of the whole batch (not a mean of
micro-batch means), so K micro-batches give the update of the whole batch at once. A batch whose loss
or gradient norm is not finite changes nothing (`applied` is 0 in its metrics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from qwen35_kernels.choices import KernelChoices

from qwen35_jax.labels import IGNORE, next_token_labels
from qwen35_jax.loss_aggregation import LOSS_AGGREGATIONS, ROLLOUT_IS_LEVELS
from qwen35_jax.losses import KL_ESTIMATORS, policy_terms, rollout_is_weights
from qwen35_jax.parallel.mesh import FSDP, SP
from qwen35_jax.scoring import ScoreOptions, score_tokens
from qwen35_jax.train.optim import Params
from qwen35_jax.xla_options import compiler_options

OBJECTIVES = ("sft", "ppo")
PPO_FIELDS = ("old_log_probs", "advantages")
Batch = dict[str, jax.Array]  # every field [K, B/K, S] (per-sequence advantages [K, B/K])
MICRO_BSS = P(None, FSDP, SP)  # [K, B/K, S]
MICRO_BS = P(None, FSDP)  # [K, B/K]


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What the step computes (not how the optimizer updates)."""
    objective: str = "sft"  # sft | ppo
    temperature: float = 1.0
    clip_low: float = 0.2  # PPO ratio clip below 1
    clip_high: float | None = None  # PPO ratio clip above 1 (None: clip_low)
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # PPO: KL(policy || reference) penalty, needs ref_log_probs
    kl_estimator: str = "low_var_kl"
    backend: str = "auto"  # fused log-prob backend
    lm_head_mode: str = "gather"  # gather | vocab_parallel
    freeze_vision: bool = False  # the vision tower's parameters get no gradient (the optimizer masks them too)
    dual_clip: float | None = None  # PPO: a negative advantage's token loss is capped at -A * dual_clip
    sequence_ratio: bool = False  # PPO: GSPO's per-row sequence ratio (`losses.policy_terms`)
    loss_agg: str = "token-mean"  # PPO: other modes weight the tokens by the batch's loss_weights
    # PPO with one update per rollout: the old log-probs are the step's own, detached (the ratio is 1
    # exactly), so the batch needs none and no forward pass computes them beforehand
    on_policy: bool = False
    # PPO: weight the clipped surrogate by the truncated trainer / sampler probability ratio of the
    # batch's "sampler_log_probs", per token or per row (`losses.rollout_is_weights`); None: off
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {self.loss_agg!r}")
        if self.objective == "sft" and (self.loss_agg != "token-mean" or self.sequence_ratio or self.dual_clip
                                        or self.on_policy or self.rollout_is):
            raise ValueError("loss_agg, sequence_ratio, dual_clip, on_policy and rollout_is apply to the ppo "
                             "objective only")
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_LEVELS} or None, got {self.rollout_is!r}")

    @property
    def scoring(self) -> ScoreOptions:
        """How the step computes its log-probs: what scoring outside the step must use too."""
        return ScoreOptions(self.temperature, self.backend, self.lm_head_mode)

    def required_fields(self) -> tuple[str, ...]:
        """Batch fields beyond tokens/segment_ids/loss_mask that the objective reads."""
        if self.objective == "sft":
            return ()
        fields = tuple(f for f in PPO_FIELDS if not (self.on_policy and f == "old_log_probs"))
        return (fields + (("ref_log_probs",) if self.kl_coef > 0 else ())
                + (("loss_weights",) if self.loss_agg != "token-mean" else ())
                + (("sampler_log_probs",) if self.rollout_is else ()))


def loss_mask_of(tokens: jax.Array, segment_ids: jax.Array, loss_mask: jax.Array | None) -> jax.Array:
    """[B, S] float32: 1 where log_probs[b, t] (the prediction of tokens[b, t + 1]) is trained on: it
    has a label in the same document and `loss_mask` (prompt / ignored tokens 0), if given, is 1."""
    mask = (next_token_labels(tokens, segment_ids) != IGNORE).astype(jnp.float32)
    return mask if loss_mask is None else mask * loss_mask.astype(jnp.float32)


def token_terms(options: StepOptions, log_probs: jax.Array, entropy: jax.Array,
                batch: Batch, mask: jax.Array) -> dict[str, jax.Array]:
    """Per-token objective terms [B, S] ("loss" and what is logged) of one micro-batch (`mask` [B, S]:
    its loss tokens, over which GSPO takes each row's sequence ratio). A batch with the sampler's
    log-probs ("sampler_log_probs") also logs logprob_mismatch, |sampler - these log-probs| (its mean
    and, as logprob_mismatch_max, its largest), and with `rollout_is` the weights' mean and the share
    truncated."""
    if options.objective == "sft":
        return {"loss": -log_probs, "nll": -log_probs, "entropy": entropy}
    old = jax.lax.stop_gradient(log_probs) if options.on_policy else batch["old_log_probs"]
    is_terms: dict[str, jax.Array] = {}
    if options.rollout_is:
        weights, truncated = rollout_is_weights(old, batch["sampler_log_probs"], mask, level=options.rollout_is,
                                                threshold=options.rollout_is_threshold)
        is_terms = {"rollout_is_weight": weights, "rollout_is_truncated": truncated.astype(jnp.float32)}
    terms = policy_terms(
        log_probs, old, batch["advantages"], clip_low=options.clip_low,
        clip_high=options.clip_high, dual_clip=options.dual_clip, entropy=entropy, entropy_coef=options.entropy_coef,
        ref_log_probs=batch.get("ref_log_probs") if options.kl_coef > 0 else None,
        kl_coef=options.kl_coef, kl_estimator=options.kl_estimator,
        sequence_mask=mask if options.sequence_ratio else None, is_weights=is_terms.get("rollout_is_weight"))
    if "sampler_log_probs" in batch:
        terms["logprob_mismatch"] = jnp.abs(jax.lax.stop_gradient(log_probs) - batch["sampler_log_probs"])
    return {**terms, **is_terms}


def _micro_sums(options: StepOptions, graphdef: nnx.GraphDef, params: Params, micro: Batch,
                mask: jax.Array, denominator: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the micro-batch's part of the loss, every term summed over its mask): the sum of its loss tokens
    / denominator under token-mean, else sum(loss x mask x loss_weights), the weights holding the
    aggregation's normalisation (`loss_aggregation.loss_weights`; its "loss" sum is that weighted sum). A VLM
    micro-batch also holds "positions" [3, b, S] and, when it has images, "vision" (`train/vision.py`)."""
    if options.freeze_vision and "visual" in params:
        params = {**params, "visual": jax.lax.stop_gradient(params["visual"])}
    model = nnx.merge(graphdef, params)
    log_probs, entropy = score_tokens(  # [b, S] each
        model, micro["tokens"], micro["segment_ids"], temperature=options.temperature,
        backend=options.backend, lm_head_mode=options.lm_head_mode, positions=micro.get("positions"),
        vision=micro.get("vision"))
    terms = token_terms(options, log_probs, entropy, micro, mask)
    sums = {name: jnp.sum(x * mask) for name, x in terms.items()}
    if "logprob_mismatch" in terms:  # a largest value, not a sum (`_accumulate` keeps the maximum)
        sums["logprob_mismatch_max"] = jnp.max(terms["logprob_mismatch"] * mask)
    if options.loss_agg == "token-mean":
        return sums["loss"] / denominator, jax.lax.stop_gradient(sums)
    weighted = jnp.sum(terms["loss"] * mask * micro["loss_weights"])
    return weighted, jax.lax.stop_gradient({**sums, "loss": weighted})


def _masks(batch: Batch) -> jax.Array:  # [K, b, S] float32
    k, b, s = batch["tokens"].shape
    flat = {name: batch[name].reshape(k * b, s) for name in ("tokens", "segment_ids", "loss_mask") if name in batch}
    return loss_mask_of(flat["tokens"], flat["segment_ids"], flat.get("loss_mask")).reshape(k, b, s)


def _sum_over_micro_batches(fn: Callable[[Batch, jax.Array], Any], batch: Batch, masks: jax.Array) -> Any:
    """sum over the K micro-batches of `fn(micro_batch, mask)` (a pytree): the first one directly,
    the rest in a scan, so K = 1 has no loop and the accumulators take the first result's shardings."""
    first = fn(jax.tree.map(lambda x: x[0], batch), masks[0])
    if masks.shape[0] == 1:
        return first
    rest = (jax.tree.map(lambda x: x[1:], batch), masks[1:])
    return jax.lax.scan(lambda acc, xs: (_accumulate(acc, fn(*xs)), None), first, rest)[0]


def _accumulate(total: Any, new: Any) -> Any:
    """total + new, leaf by leaf; a metric named *_max keeps the larger of the two."""
    def combine(path: Any, a: jax.Array, b: jax.Array) -> jax.Array:
        name = getattr(path[-1], "key", "") if path else ""
        return jnp.maximum(a, b) if isinstance(name, str) and name.endswith("_max") else a + b
    return jax.tree_util.tree_map_with_path(combine, total, new)


def _normalise(sums: dict[str, jax.Array], tokens: jax.Array, options: StepOptions) -> dict[str, jax.Array]:
    """Token means of the summed terms; a weighted loss (not token-mean) is already normalised."""
    denominator = jnp.maximum(tokens, 1.0)
    keep = () if options.loss_agg == "token-mean" else ("loss",)
    return {**{name: s if name in keep or name.endswith("_max") else s / denominator for name, s in sums.items()},
            "tokens": tokens}


UPDATE_FORMS = ("cond", "select")


def update_form(backend: str) -> str:
    """How the step skips a non-finite update on this backend, chosen from the compiled programs.

    "cond": XLA:CPU updates the parameters and moments in place inside a `lax.cond`, and with a select
    it copies every one of them once per step. "select": XLA:GPU copies every output of a cond into the
    donated buffers after it, while a per-element select of new against old fuses into the update's
    kernels (docs/lab_log.md has the copies and bytes).
    """
    return "cond" if backend == "cpu" else "select"


def update_if(ok: jax.Array, update: Callable[[Params, Any], tuple[Params, Any]], params: Params,
              opt_state: Any, *, form: str) -> tuple[Params, Any]:
    """`update(params, opt_state)` where the scalar `ok` holds, else both unchanged, bit for bit."""
    if form == "cond":
        return jax.lax.cond(ok, update, lambda p, s: (p, s), params, opt_state)
    if form == "select":
        return jax.tree.map(lambda new, old: jnp.where(ok, new, old), update(params, opt_state), (params, opt_state))
    raise ValueError(f"update form {form!r} is not one of {UPDATE_FORMS}")


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, options: StepOptions,
                    shardings: tuple[Any, Any], *, kernels: KernelChoices = KernelChoices()
                    ) -> Callable[[Params, Any, Batch], tuple[Params, Any, dict[str, jax.Array]]]:
    """`step(params, opt_state, batch) -> (params, opt_state, metrics)`, jitted, donating the old
    params and optimizer state; `shardings` = (params', opt_state's) shardings, kept by the outputs.

    Call it with the mesh set (`jax.set_mesh(mesh)`). Metrics (scalars): loss and the objective's terms
    as token means over the whole batch's loss mask, tokens (that mask's sum), grad_norm (before
    clipping), applied (1, or 0 when the loss or gradient was not finite and nothing changed) and
    batch_tokens (non-padding tokens of the batch). The model runs its config's kernel choices;
    `kernels` (the same choices) names the platform whose program this is (its `platform`, else jax's
    backend): the update form and the compiler options. The jit carries our CPU compiler options (`xla_options`), so it must be the outermost
    one: to trace the step inside another transformation, use the unjitted `step.__wrapped__`.
    """

    platform = kernels.resolve().platform

    def step(params: Params, opt_state: Any, batch: Batch) -> tuple[Params, Any, dict[str, jax.Array]]:
        masks = _masks(batch)  # [K, b, S]
        tokens = jnp.sum(masks)
        denominator = jnp.maximum(tokens, 1.0)
        grad_fn = jax.grad(lambda p, mb, m: _micro_sums(options, graphdef, p, mb, m, denominator), has_aux=True)

        def micro_grads(micro: Batch, mask: jax.Array) -> tuple[Params, dict[str, jax.Array]]:
            grads, sums = grad_fn(params, micro, mask)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            return jax.lax.with_sharding_constraint(grads, shardings[0]), sums

        grads, sums = _sum_over_micro_batches(micro_grads, batch, masks)
        metrics = _normalise(sums, tokens, options)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        def update(params: Params, opt_state: Any) -> tuple[Params, Any]:
            updates, new_opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt_state

        params, opt_state = update_if(finite, update, params, opt_state, form=update_form(platform))
        batch_tokens = jnp.sum(batch["segment_ids"] != 0).astype(jnp.float32)
        return params, opt_state, {**metrics, "grad_norm": grad_norm, "applied": finite.astype(jnp.float32),
                                   "batch_tokens": batch_tokens}

    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(*shardings, None),
                   compiler_options=compiler_options(kernels.resolve().platform))


def make_eval_step(graphdef: nnx.GraphDef, options: StepOptions, *, kernels: KernelChoices = KernelChoices()
                   ) -> Callable[[Params, Batch], dict[str, jax.Array]]:
    """`eval_step(params, batch) -> {term: sum over the batch's mask, "tokens": mask sum}` (sums, so
    several batches add up before `finish_eval` divides); `kernels` names the platform as for
    `make_train_step`."""

    def eval_step(params: Params, batch: Batch) -> dict[str, jax.Array]:
        masks = _masks(batch)
        sums = _sum_over_micro_batches(
            lambda micro, mask: _micro_sums(options, graphdef, params, micro, mask, jnp.ones(()))[1], batch, masks)
        return {**sums, "tokens": jnp.sum(masks)}

    return jax.jit(eval_step, compiler_options=compiler_options(kernels.resolve().platform))


def finish_eval(totals: dict[str, float]) -> dict[str, float]:
    """Token means of summed `eval_step` outputs."""
    tokens = totals["tokens"]
    return {name: (v / max(tokens, 1.0) if name != "tokens" else v) for name, v in totals.items()}


def batch_shardings(mesh: Mesh, batch: dict[str, Any]) -> dict[str, NamedSharding]:
    """P(None, 'fsdp', 'sp') for [K, b, S] fields, P(None, 'fsdp') for per-sequence [K, b] ones (a VLM
    batch's positions and vision inputs are placed by `data.place_batch`)."""
    return {name: NamedSharding(mesh, MICRO_BSS if len(x.shape) == 3 else MICRO_BS) for name, x in batch.items()}
