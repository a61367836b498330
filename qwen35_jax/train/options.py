"""Every option of a training run: one dataclass, read from a YAML/JSON file and overridden by flags.

`TrainOptions` is the single source of the command line (`scripts/train.py --help` lists every field
with its help text), of `--config FILE` and of the run directory's `config.yaml`. Fields in
`RESUMABLE_CHANGES` may differ when a run resumes (how it runs: mesh, kernels, how long, how often to
save); every other field defines the run, and a run directory holding another value is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml
from qwen35_kernels.choices import ATTENTION_IMPLEMENTATIONS, GDN_PRECISIONS, LOGPROB_BACKENDS

from qwen35_jax.config import GDN_SP_MODES, REMAT_POLICIES, RUN_DTYPES, SCAN_LAYERS_FLAGS
from qwen35_jax.data.packing import LONG_ROW_POLICIES
from qwen35_jax.data.rows import BAD_ROW_POLICIES
from qwen35_jax.loss_aggregation import LOSS_AGGREGATIONS, ROLLOUT_IS_LEVELS


# The choices of every option that has a fixed list: the command lines (train.py, logprobs.py,
# generate.py, import_hf.py, bench_train.py) offer these. Lists are imported from where the concept
# lives when that module loads without jax (this module must not: scripts/train.py parses its options
# before jax loads); the lm_head modes and losses.KL_ESTIMATORS are in modules that load jax, and
# rl.advantages.ADVANTAGES is in rl/, which train/ does not import (tests/test_layering.py), so they
# are restated here and tests/test_train_run.py checks that they agree.
CHOICES = {
    "objective": ("sft", "ppo", "grpo"),
    "advantage": ("grpo", "drgrpo", "rloo"),
    "loss_agg": LOSS_AGGREGATIONS,
    "policy_loss": ("ppo", "gspo"),
    "rollout_is": ROLLOUT_IS_LEVELS,
    "kl_estimator": ("k1", "k2", "k3", "low_var_kl"),
    "param_dtype": RUN_DTYPES,
    "compute_dtype": RUN_DTYPES,
    # pallas_gpu / pallas_tpu are the per-platform names "pallas" resolves to, not flags
    "attention": tuple(a for a in ATTENTION_IMPLEMENTATIONS if a not in ("pallas_gpu", "pallas_tpu")),
    "logprob_backend": LOGPROB_BACKENDS,
    "lm_head": ("gather", "vocab_parallel"),
    "gdn_sp_mode": GDN_SP_MODES,
    "gdn_precision": GDN_PRECISIONS,
    "long_rows": LONG_ROW_POLICIES,
    "bad_rows": BAD_ROW_POLICIES,
    "remat": REMAT_POLICIES,
    "scan_layers": tuple(SCAN_LAYERS_FLAGS),
}


def _opt(default: Any, help: str, group: str) -> Any:
    factory = (lambda: list(default)) if isinstance(default, list) else None
    meta = {"help": help, "group": group}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass
class TrainOptions:
    # --- what to train, on what, where
    model: str | None = _opt(None, "HF checkpoint, qwen35_jax checkpoint or run directory to start from", "run")
    preset: str | None = _opt(None, "random init of a named config instead of --model (tiny, 0.8B, 9B, ...)", "run")
    data: list[str] = _opt([], "training data: a .npy directory (tokens.npy, ...), a prepared dataset "
                               "directory, or JSONL files / directories (docs/data.md)", "run")
    eval_data: list[str] = _opt([], "held-out data, same forms as --data", "run")
    synthetic: bool = _opt(False, "train on random tokens instead of --data", "run")
    tokenizer: str | None = _opt(None, "HF tokenizer directory for JSONL data (default: --model)", "run")
    out: str | None = _opt(None, "run directory: created if new, resumed if it holds this run", "run")
    seed: int = _opt(0, "seed of --preset init, --synthetic data and the data order", "run")
    # --- objective
    objective: str = _opt("sft", "loss: sft (token-mean NLL), ppo (clipped surrogate on rollouts from files) or "
                                 "grpo (online: sample, reward, clipped surrogate; docs/rl.md)", "objective")
    temperature: float = _opt(1.0, "softmax temperature of the log-probs (grpo: also of the sampling)", "objective")
    clip_ratio: float = _opt(0.2, "PPO ratio clip below 1 (and above, unless --clip-ratio-high)", "objective")
    clip_ratio_high: float | None = _opt(None, "PPO ratio clip above 1 (clip-higher)", "objective")
    clip_ratio_c: float | None = _opt(None, "dual clip: a token with a negative advantage loses at most "
                                            "-advantage x C (C > 1; verl's default when on: 3.0)", "objective")
    entropy_coef: float = _opt(0.0, "PPO entropy bonus", "objective")
    kl_coef: float = _opt(0.0, "PPO KL penalty to the reference policy (needs ref_log_probs.npy)", "objective")
    kl_estimator: str = _opt("low_var_kl", "per-token KL estimator: k1, k2, k3, low_var_kl (k3 clamped)", "objective")
    # --- online RL (--objective grpo)
    reward: str | None = _opt(None, "grpo: reward function, FILE.py:FUNCTION or package.module:function "
                                    "(built-ins: qwen35_jax.rewards:exact_answer, ...)", "rl")
    group_size: int = _opt(4, "grpo: completions sampled per prompt (--batch-size counts completions)", "rl")
    max_new_tokens: int = _opt(256, "grpo: new tokens per completion at most", "rl")
    advantage: str = _opt("grpo", "grpo: advantages from each group's rewards: grpo (mean and std), drgrpo "
                                  "(mean only) or rloo (leave-one-out mean)", "rl")
    ppo_epochs: int = _opt(1, "grpo: optimizer updates on each step's rollouts", "rl")
    loss_agg: str = _opt("token-mean", "grpo: how the policy loss is aggregated: token-mean (every completion "
                                       "token alike), seq-mean-token-mean (each completion alike) or "
                                       "seq-mean-token-sum-norm (token sums / --max-new-tokens; Dr. GRPO)", "rl")
    policy_loss: str = _opt("ppo", "grpo: ppo (per-token ratios) or gspo (each completion's length-normalised "
                                   "sequence ratio, clipped as a whole)", "rl")
    rollout_is: str | None = _opt(None, "grpo: weight the policy loss by the trainer's / the sampler's probability "
                                        "of the sampled tokens, per token or per sequence, truncated at "
                                        "--rollout-is-threshold (default: off)", "rl")
    rollout_is_threshold: float = _opt(2.0, "grpo: the largest --rollout-is weight", "rl")
    mask_truncated: bool = _opt(False, "grpo: completions cut by --max-new-tokens add nothing to the loss (their "
                                       "rewards still count in their groups' advantages)", "rl")
    stop_token_ids: str | None = _opt(None, "grpo: comma-separated ids that end a completion (default: the "
                                            "model's eos ids)", "rl")
    chat_template_kwargs: str | None = _opt(None, "grpo: JSON object passed to the chat template of "
                                                  "'messages' prompts", "rl")
    # --- batch
    batch_size: int | None = _opt(None, "global sequences per optimizer step (default: fsdp x grad-accum)", "batch")
    grad_accum: int = _opt(1, "micro-batches per step; the update equals the whole batch's", "batch")
    seq_len: int = _opt(128, "row length of --synthetic data and of packed JSONL data", "batch")
    long_rows: str = _opt("split", "JSONL rows longer than --seq-len: truncate, split or drop", "batch")
    bad_rows: str = _opt("skip", "JSONL rows that cannot be read: skip (counted) or stop", "batch")
    data_workers: int = _opt(0, "data loader worker processes (0: in the training process)", "batch")
    min_pixels: int | None = _opt(None, "VLM: images smaller than this many pixels are scaled up (default: the "
                                        "checkpoint's preprocessor_config.json, else 65536)", "batch")
    max_pixels: int | None = _opt(None, "VLM: images larger than this many pixels are scaled down (default: the "
                                        "checkpoint's preprocessor_config.json, else 16777216)", "batch")
    max_patches: int | None = _opt(None, "VLM: image patches per micro-batch, one fixed bucket (one compile; a "
                                         "batch with more is an error); default: the next power of two of each "
                                         "batch's patches (a few compiles)", "batch")
    # --- optimizer and schedule
    steps: int = _opt(10, "stop after this many optimizer steps (a resumed run continues to it)", "optimizer")
    schedule_steps: int | None = _opt(None, "length of the learning-rate schedule (default: --steps)", "optimizer")
    lr: float = _opt(1e-5, "peak learning rate", "optimizer")
    warmup_steps: int = _opt(0, "linear warmup steps", "optimizer")
    final_lr_ratio: float = _opt(0.1, "cosine decay ends at lr x this", "optimizer")
    weight_decay: float = _opt(0.0, "AdamW weight decay (never on norms, biases, A_log, dt_bias)", "optimizer")
    clip_norm: float | None = _opt(1.0, "global gradient-norm clip (null in a config file: none)", "optimizer")
    adam_b1: float = _opt(0.9, "AdamW beta1", "optimizer")
    adam_b2: float = _opt(0.95, "AdamW beta2", "optimizer")
    adam_eps: float = _opt(1e-8, "AdamW epsilon", "optimizer")
    freeze_vision: bool = _opt(False, "VLM: the vision tower's parameters get no update and no optimizer "
                                      "moments (the text model trains)", "optimizer")
    # --- precision and memory
    param_dtype: str = _opt("float32", "master weights and optimizer state dtype", "precision")
    compute_dtype: str | None = _opt(None, "matmul/activation dtype (default: bfloat16 on GPU/TPU, float32 on CPU)",
                                     "precision")
    remat: str | None = _opt(None, "activation recomputation: auto, none, mlp, full, dots, layer, nested, "
                                   "offload (docs/parallelism.md; default: the model config's, auto: the first "
                                   "of none, mlp, full whose step fits the device)", "precision")
    scan_layers: str = _opt("auto", "the model's blocks as one lax.scan (true: short compile) or one after "
                                    "another (false: faster step); auto: false on GPU unless whole blocks are "
                                    "recomputed (remat other than none and mlp), true elsewhere", "precision")
    # --- kernels and parallelism (fallbacks without editing code)
    mesh: str | None = _opt(None, "device layout 'fsdp=F,sp=S' (default: all devices on fsdp)", "parallelism")
    attention: str = _opt("auto", "attention kernel: auto, xla, pallas, cudnn (GPU, bf16)", "parallelism")
    logprob_backend: str = _opt("auto", "fused log-prob kernel: auto, xla, pallas, pallas_xla (Pallas forward, "
                                "XLA backward), reference", "parallelism")
    lm_head: str = _opt("gather", "lm_head under sp: gather or vocab_parallel", "parallelism")
    gdn_sp_mode: str = _opt("all_to_all", "GDN sequence parallelism: all_to_all or state_passing", "parallelism")
    gdn_precision: str = _opt("auto", "matmul precision of the GDN chunked form: auto (highest on CPU, default "
                                      "elsewhere), highest, high, default (TF32 on GPU), bf16 (bfloat16 operands, "
                                      "float32 accumulation; docs/gated_deltanet.md)", "parallelism")
    # --- checkpoints, evaluation, logging
    save_every: int = _opt(100, "checkpoint every N steps (and at the end)", "run control")
    keep: int = _opt(3, "checkpoints kept", "run control")
    eval_every: int = _opt(0, "held-out loss every N steps (0: only at the end, when --eval-data)", "run control")
    eval_batches: int = _opt(4, "batches of --eval-data per evaluation", "run control")
    max_bad_steps: int = _opt(5, "stop after this many steps in a row with a non-finite loss or gradient", "run control")
    peak_tflops: float | None = _opt(None, "device peak for MFU (default: known GPUs/TPUs; none on CPU)", "run control")
    progress: bool = _opt(True, "show a progress bar", "run control")

    def __post_init__(self) -> None:
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ValueError(f"--{flag(name)} must be one of {', '.join(choices)}, got {value!r}")
        positive = ("steps", "grad_accum", "seq_len", "save_every", "keep", "max_bad_steps", "eval_batches",
                    "group_size", "max_new_tokens", "ppo_epochs")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "temperature", "clip_ratio", "adam_eps", "rollout_is_threshold"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{flag(name)} must be > 0, got {getattr(self, name)}")
        for name in ("clip_norm", "clip_ratio_high", "peak_tflops", "batch_size", "schedule_steps", "min_pixels",
                     "max_pixels", "max_patches"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"--{flag(name)} must be > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "entropy_coef", "kl_coef", "warmup_steps", "eval_every", "data_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{flag(name)} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.final_lr_ratio <= 1:
            raise ValueError(f"--final-lr-ratio must be in [0, 1], got {self.final_lr_ratio}")
        if self.warmup_steps > self.total_schedule_steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps} exceeds the schedule's {self.total_schedule_steps} steps")
        if self.kl_coef > 0 and self.objective == "sft":
            raise ValueError("--kl-coef applies to --objective ppo and grpo only")
        if self.objective == "grpo" and self.reward is None:
            raise ValueError("--objective grpo needs --reward (FILE.py:FUNCTION or package.module:function)")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"--clip-ratio-c must be > 1, got {self.clip_ratio_c}")
        for name, default in (("loss_agg", "token-mean"), ("policy_loss", "ppo"), ("rollout_is", None)):
            if getattr(self, name) != default and self.objective != "grpo":
                raise ValueError(f"--{flag(name)} {getattr(self, name)} applies to --objective grpo only")
        if self.advantage == "rloo" and self.group_size < 2:
            raise ValueError("--advantage rloo needs --group-size >= 2")

    @property
    def total_schedule_steps(self) -> int:
        return self.steps if self.schedule_steps is None else self.schedule_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Fields that may change when a run resumes: they change how it runs, not what it computes.
RESUMABLE_CHANGES = frozenset({
    "model", "out", "steps", "mesh", "grad_accum", "compute_dtype", "remat", "scan_layers", "attention",
    "logprob_backend", "lm_head", "gdn_sp_mode", "gdn_precision", "save_every", "keep", "eval_every", "eval_batches",
    "eval_data", "max_bad_steps", "peak_tflops", "progress", "data_workers", "tokenizer", "max_patches"})


def flag(name: str) -> str:
    return name.replace("_", "-")


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainOptions)}


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(int | float | str | bool | list, whether None is allowed) of a field's annotation."""
    hint = typing.get_type_hints(TrainOptions)[annotation] if isinstance(annotation, str) else annotation
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _base_type(inner[0])[0], True
    return (list if typing.get_origin(hint) is list else hint), False


def _check_value(name: str, value: Any, source: str) -> Any:
    kind, optional = _base_type(name)
    if value is None and optional:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list and isinstance(value, str):
        return [value]
    if kind is str and isinstance(value, bool) and "true" in CHOICES.get(name, ()):
        return str(value).lower()  # YAML's unquoted true / false for an auto|true|false option
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    if not ok:
        want = "a list of strings" if kind is list else kind.__name__
        raise ValueError(f"{source}: option {name!r} must be {want}{' or null' if optional else ''}, "
                         f"got {value!r}")
    return value


def read_config_file(path: str) -> dict[str, Any]:
    """A YAML or JSON mapping of option names (with - or _) to values, each checked for type."""
    try:
        with open(path) as f:
            text = f.read()
        raw = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except OSError as err:
        raise ValueError(f"config file {path}: {err.strerror}") from None
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise ValueError(f"config file {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                         f"{str(err).splitlines()[0]}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path}: expected a mapping of options, got {type(raw).__name__}")
    known = _fields()
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ValueError(f"config file {path}: unknown option {key!r} (see scripts/train.py --help)")
        values[name] = _check_value(name, value, f"config file {path}")
    return values


def build_parser(description: str = "", epilog: str = "") -> argparse.ArgumentParser:
    """A parser with one flag per field (defaults suppressed, so only given flags appear)."""
    parser = argparse.ArgumentParser(description=description, epilog=epilog, argument_default=argparse.SUPPRESS,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML or JSON file of options; flags given here override it")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, f in _fields().items():
        group = groups.setdefault(f.metadata["group"], parser.add_argument_group(f.metadata["group"]))
        kind, _ = _base_type(name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f"{f.metadata['help']} (default: {default})"
        if kind is bool:
            group.add_argument(f"--{flag(name)}", action=argparse.BooleanOptionalAction, help=help_text)
        elif kind is list:
            group.add_argument(f"--{flag(name)}", nargs="+", metavar="PATH", help=help_text)
        else:
            group.add_argument(f"--{flag(name)}", type=kind, choices=CHOICES.get(name), help=help_text)
    return parser


def given_values(argv: list[str] | None, parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    """The options `argv` sets: those of `--config FILE`, overridden by the flags given."""
    given = vars((parser or build_parser()).parse_args(argv))
    config_path = given.pop("config", None)
    values = read_config_file(os.fspath(config_path)) if config_path is not None else {}
    values.update(given)
    return values


def parse_options(argv: list[str] | None, parser: argparse.ArgumentParser | None = None,
                  defaults: dict[str, Any] | None = None) -> TrainOptions:
    """Options from `defaults`, then `--config FILE`, then the flags in `argv` (each overriding the last)."""
    return TrainOptions(**{**(defaults or {}), **given_values(argv, parser)})


def differences(stored: dict[str, Any], options: TrainOptions) -> list[str]:
    """The run-defining fields where `options` differs from a run directory's stored options."""
    now = options.to_dict()
    return [f"{flag(k)}={stored.get(k)!r} (now {now[k]!r})" for k in now
            if k not in RESUMABLE_CHANGES and stored.get(k, now[k]) != now[k]]
