"""The training run: open or resume the run directory, build model, data and optimizer, train, save.

    run = prepare(options)       # checks, mesh, model (fresh or restored), data, optimizer, jitted step
    train(options)               # prepare + the loop: step, log, evaluate, checkpoint, stop on signals

A run stops at `--steps`, on SIGTERM/SIGINT (after the current step, with a checkpoint), or after
`--max-bad-steps` non-finite steps in a row (without a checkpoint: the newest one is the last good state).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35_jax.checkpoint import _config_dict, load_checkpoint
from qwen35_jax.config import SCAN_LAYERS_FLAGS, Qwen35Config
from qwen35_jax.parallel.processes import is_lead_process, sync_processes
from qwen35_jax.hf.load import abstract_model, default_shardings
from qwen35_jax.kernel_choices import check_kernel_choices, explain_compile_failure, kernels_config
from qwen35_jax.parallel.mesh import FSDP, init_distributed, make_mesh, mesh_axis_size
from qwen35_jax.train.checkpoints import RunCheckpoints
from qwen35_jax.train.data import BatchStream, check_batch_size, place_batch, process_slice
from qwen35_jax.train.flops import peak_tflops, train_flops
from qwen35_jax.train.metrics import MetricsLog, Progress, plot_loss, plot_reward
from qwen35_jax.train.optim import init_opt_state, make_optimizer, make_schedule, opt_state_shardings
from qwen35_jax.train.options import TrainOptions, flag
from qwen35_jax.train.remat_choice import make_config_train_step
from qwen35_jax.train.run import open_run_dir, write_config
from qwen35_jax.train.signals import StopRequest
from qwen35_jax.train.sources import open_eval_stream, open_train_stream
from qwen35_jax.train.step import StepOptions, finish_eval, make_eval_step

EXIT_BAD_STEPS = 3


class TooManyBadSteps(RuntimeError):
    pass


@dataclasses.dataclass
class Run:
    """Everything the loop needs, built by `prepare`."""
    options: TrainOptions
    mesh: jax.sharding.Mesh
    config: Qwen35Config
    meta: dict[str, Any]  # config, HF layout and config.json, saved with every checkpoint
    params: Any
    opt_state: Any
    schedule: Any
    train_step: Any
    eval_step: Any
    stream: BatchStream
    eval_stream: BatchStream | None
    eval_batches: int
    checkpoints: RunCheckpoints
    shard_count: int
    batch_size: int
    start_step: int = 0
    skipped_steps: int = 0
    applied_updates: int = 0
    eval_start: dict[str, Any] | None = None  # the eval stream's position before its first batch
    rl: Any = None  # the online RL state (`qwen35_jax.rl.online.OnlineRL`) of --objective grpo

    @property
    def evaluates(self) -> bool:
        return self.eval_stream is not None or bool(self.rl is not None and self.rl.eval_prompts)


def check_options(options: TrainOptions) -> None:
    """The checks that need no devices; one-line ValueErrors."""
    if options.out is None:
        raise ValueError("--out is required: the run directory")
    if (options.model is None) == (options.preset is None):
        raise ValueError("give exactly one of --model (a checkpoint) and --preset (a random init)")
    if bool(options.data) == options.synthetic:
        raise ValueError("give exactly one of --data and --synthetic")
    if options.model is not None and not os.path.isdir(options.model):
        raise ValueError(f"--model directory not found: {options.model}")
    for path in options.data + options.eval_data:
        if not os.path.exists(path):
            raise ValueError(f"data not found: {path}")
    if options.objective == "grpo":
        from qwen35_jax.rl.online import check_grpo_options
        check_grpo_options(options)


def _start_model(options: TrainOptions, mesh: jax.sharding.Mesh) -> tuple[Qwen35Config, Any, dict[str, Any]]:
    """(config, sharded params as a pure dict, checkpoint metadata) of the starting point."""
    if options.preset is not None:
        from qwen35_jax.model import Qwen35ForCausalLM
        from qwen35_jax.parallel.mesh import create_sharded
        config = Qwen35Config.preset(options.preset, param_dtype=options.param_dtype)
        model = create_sharded(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(options.seed)), mesh)
        return config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), {"layout": None, "hf_config": None}
    from qwen35_jax.checkpoint import is_checkpoint, resolve_checkpoint
    from qwen35_jax.hf.load import load_hf
    path = resolve_checkpoint(options.model)
    if is_checkpoint(path):
        model, config, meta = load_checkpoint(path, dtype=options.param_dtype, mesh=mesh)
        meta = {"layout": meta.get("layout"), "hf_config": meta.get("hf_config")}
    else:
        model, config, ckpt = load_hf(path, dtype=options.param_dtype, mesh=mesh)
        meta = {"layout": ckpt.layout.to_dict() if ckpt.layout else None, "hf_config": ckpt.raw_config}
    return config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), meta


def _runtime_config(config: Qwen35Config, options: TrainOptions) -> Qwen35Config:
    """The stored config with this run's compute dtype, remat policy, layer loop and kernel choices
    (none changes the params)."""
    changes: dict[str, Any] = {"dtype": options.compute_dtype, "scan_layers": SCAN_LAYERS_FLAGS[options.scan_layers]}
    if options.remat is not None:
        changes["remat"] = options.remat
    return kernels_config(config.replace(**changes), attention=options.attention, gdn_sp_mode=options.gdn_sp_mode,
                          gdn_precision=options.gdn_precision)


def _abstract_params(config: Qwen35Config, mesh: jax.sharding.Mesh) -> Any:
    _, params, _ = abstract_model(config)
    abstract = nnx.to_pure_dict(params)
    shardings = default_shardings(abstract, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _default_compute_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def prepare(options: TrainOptions) -> Run:
    """Check the options and the run directory, then build (or restore) everything for the loop."""
    check_options(options)
    options, resuming = open_run_dir(options.out, options)  # refuses another run before anything is written
    init_distributed()  # before anything asks jax for its backend
    check_kernel_choices(options.attention, options.compute_dtype or _default_compute_dtype())
    mesh = make_mesh(options.mesh)
    fsdp = mesh_axis_size(mesh, FSDP)
    online = options.objective == "grpo"
    batch_size = options.batch_size or (math.lcm(fsdp * options.grad_accum, options.group_size) if online
                                        else fsdp * options.grad_accum)
    check_batch_size(batch_size, fsdp, options.grad_accum)
    options = dataclasses.replace(  # resolved defaults are stored, so a resume on another mesh keeps them
        options, batch_size=batch_size, schedule_steps=options.total_schedule_steps,
        compute_dtype=options.compute_dtype or _default_compute_dtype())

    # the schedule counts optimizer updates: --ppo-epochs of them per online step
    updates_per_step = options.ppo_epochs if online else 1
    schedule = make_schedule(options.lr, options.total_schedule_steps * updates_per_step,
                             options.warmup_steps * updates_per_step, options.final_lr_ratio)
    tx = make_optimizer(schedule, weight_decay=options.weight_decay, clip_norm=options.clip_norm,
                        b1=options.adam_b1, b2=options.adam_b2, eps=options.adam_eps)
    checkpoints = RunCheckpoints(options.out, keep=options.keep) if resuming else None
    restored = None
    stored_config = checkpoints.model_config() if checkpoints is not None else None
    if stored_config is not None:
        config = Qwen35Config(**stored_config)
        abstract = _abstract_params(config, mesh)
        abstract_opt = jax.eval_shape(tx.init, abstract)
        abstract_opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_opt,
                                    opt_state_shardings(abstract_opt, abstract, mesh))
        restored = checkpoints.restore_latest(abstract, abstract_opt)
    if restored is not None:
        start_step, params, opt_state, meta = restored
        config = Qwen35Config(**meta["config"])
        meta = {"layout": meta.get("layout"), "hf_config": meta.get("hf_config"), "train": meta["train"]}
    else:
        start_step = 0
        config, params, meta = _start_model(options, mesh)
        opt_state = init_opt_state(tx, params, mesh)
    if config.param_dtype != options.param_dtype:
        raise ValueError(f"--param-dtype {options.param_dtype}: the checkpoint holds {config.param_dtype} parameters")
    config = _runtime_config(config, options)
    meta["config"] = _config_dict(config)

    if is_lead_process():
        write_config(options.out, options)
    sync_processes("qwen35_run_dir_ready")
    if checkpoints is None:
        checkpoints = RunCheckpoints(options.out, keep=options.keep)

    shard_index, shard_count = process_slice(mesh, batch_size, options.grad_accum)
    step_options = StepOptions(
        objective="ppo" if online else options.objective, temperature=options.temperature, clip_low=options.clip_ratio,
        clip_high=options.clip_ratio_high, entropy_coef=options.entropy_coef, kl_coef=options.kl_coef,
        kl_estimator=options.kl_estimator, backend=options.logprob_backend, lm_head_mode=options.lm_head)
    graphdef, _, _ = abstract_model(config)
    rl = None
    if online:
        from qwen35_jax.rl.online import open_online_rl
        ref_params = None
        if options.kl_coef > 0:  # the starting weights, sharded like the trained ones
            ref_params = _start_model(options, mesh)[1] if restored is not None else jax.tree.map(jnp.copy, params)
        rl = open_online_rl(options, vocab_size=config.vocab_size, batch_size=batch_size, graphdef=graphdef,
                            ref_params=ref_params, shard_index=shard_index, shard_count=shard_count)
        stream, eval_stream, eval_batches = rl.stream, None, 0
    else:
        stream = open_train_stream(options, config=config, mesh=mesh, batch_size=batch_size,
                                   shard_index=shard_index, shard_count=shard_count,
                                   fields=step_options.required_fields(), graphdef=graphdef, params=params)
        eval_stream, eval_batches = open_eval_stream(options, config=config, batch_size=batch_size,
                                                     shard_index=shard_index, shard_count=shard_count,
                                                     fields=step_options.required_fields())
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    train_step = make_config_train_step(config, tx, step_options,
                                        (param_shardings, jax.tree.map(lambda x: x.sharding, opt_state)),
                                        log=functools.partial(print, flush=True) if is_lead_process() else None)
    eval_step = make_eval_step(graphdef, step_options, kernels=config.kernels)
    run = Run(options=options, mesh=mesh, config=config, meta=meta, params=params, opt_state=opt_state,
              schedule=schedule, train_step=train_step, eval_step=eval_step,
              stream=stream, eval_stream=eval_stream, eval_batches=eval_batches, checkpoints=checkpoints,
              shard_count=shard_count, batch_size=batch_size, start_step=start_step, rl=rl)
    if restored is not None:
        state = meta["train"]
        stream.set_state(state["data_state"])
        run.skipped_steps, run.applied_updates = state["skipped_steps"], state["applied_updates"]
    return run


def save(run: Run, step: int) -> None:
    train_state = {"step": step, "data_state": run.stream.get_state(), "skipped_steps": run.skipped_steps,
                   "applied_updates": run.applied_updates, "seed": run.options.seed}
    run.checkpoints.save(step, run.params, run.opt_state, {**run.meta, "train": train_state})


def evaluate(run: Run) -> dict[str, float]:
    """Held-out token means over the first `eval_batches` batches of --eval-data (the same each time);
    online RL: the greedy mean reward on the --eval-data prompts."""
    if run.rl is not None:
        from qwen35_jax.rl.online import rl_evaluate
        return rl_evaluate(run)
    run.eval_stream.set_state(run.eval_start)
    totals: dict[str, float] = {}
    for _ in range(run.eval_batches):
        batch = place_batch(run.eval_stream.next_batch(), run.mesh, run.options.grad_accum, run.shard_count)
        for name, value in jax.device_get(run.eval_step(run.params, batch)).items():
            totals[name] = totals.get(name, 0.0) + float(value)
    return {f"eval_{name}": value for name, value in finish_eval(totals).items()}


def _row(run: Run, step: int, metrics: dict[str, Any], seconds: float, lr: float, peak: float | None,
         flops: float) -> dict[str, Any]:
    row = {"step": step, **{k: float(v) for k, v in metrics.items()}, "lr": lr,
           "tokens_per_sec": float(metrics["batch_tokens"]) / seconds,
           "mfu": flops / seconds / (peak * 1e12 * run.mesh.size) if peak else None,
           "skipped_steps": run.skipped_steps, "epoch": float(getattr(run.stream, "epoch", 0.0)),
           "step_seconds": seconds, "time": time.time()}
    return row


def _one_step(run: Run, step: int) -> tuple[dict[str, Any], int]:
    """(metrics, padded row length) of one optimizer step on the next batch (online RL: one step of
    sampling, rewards and --ppo-epochs updates)."""
    try:
        if run.rl is not None:
            from qwen35_jax.rl.online import rl_step
            return rl_step(run, step)
        batch = place_batch(run.stream.next_batch(), run.mesh, run.options.grad_accum, run.shard_count)
        run.params, run.opt_state, metrics = run.train_step(run.params, run.opt_state, batch)
        return jax.device_get(metrics), batch["tokens"].shape[-1]
    except Exception as err:
        first = step == run.start_step + 1
        hint = explain_compile_failure(err, attention=run.options.attention,
                                       logprob_backend=run.options.logprob_backend) if first else None
        if hint is None:
            raise
        raise ValueError(hint) from err


def loop(run: Run, stop: StopRequest) -> int:
    options, lead = run.options, is_lead_process()
    peak = options.peak_tflops or peak_tflops(jax.devices()[0])
    log = MetricsLog(options.out, resume_step=run.start_step, lead=lead)
    progress = Progress(total=options.steps, initial=run.start_step, enabled=options.progress, lead=lead)
    if lead and run.start_step:
        print(f"resuming {options.out} from step {run.start_step}", flush=True)
    if lead and peak is None and run.start_step < options.steps:
        print(f"mfu: not reported on {jax.devices()[0].platform} (no known peak rate; set --peak-tflops)", flush=True)
    run.eval_start = run.eval_stream.get_state() if run.eval_stream is not None else None
    rows, saved, step = [], run.start_step, run.start_step
    try:
        with jax.set_mesh(run.mesh):
            bad_in_a_row = 0
            while step < options.steps and not stop.agreed():
                step += 1
                lr = float(run.schedule(run.applied_updates))
                start = time.perf_counter()
                metrics, seq = _one_step(run, step)
                seconds = time.perf_counter() - start
                applied = bool(metrics["applied"])
                run.applied_updates += int(metrics.get("updates_applied", applied))
                run.skipped_steps += not applied
                bad_in_a_row = 0 if applied else bad_in_a_row + 1
                row = _row(run, step, metrics, seconds, lr, peak, train_flops(run.config, run.batch_size, int(seq)))
                if run.evaluates and options.eval_every and step % options.eval_every == 0:
                    row.update(evaluate(run))
                log.write(row)
                progress.update(row)
                rows.append(row)
                if bad_in_a_row >= options.max_bad_steps:
                    raise TooManyBadSteps(
                        f"{bad_in_a_row} steps in a row (to step {step}) had a non-finite loss or gradient; "
                        f"stopped without saving: the newest checkpoint ({saved or 'none'}) is the last good state. "
                        f"Lower --lr or check the data (--max-bad-steps sets the limit)")
                if step % options.save_every == 0 or step == options.steps:
                    save(run, step)
                    saved = step
            evaluated = rows and any(k.startswith("eval_") for k in rows[-1])
            if run.evaluates and step == options.steps and not evaluated:
                final = evaluate(run)
                log.write({"step": step, **final, "time": time.time()})
                rows.append({"step": step, **final})
            if step > saved:  # stopped early by a signal
                save(run, step)
    except TooManyBadSteps as err:
        progress.close()
        log.close()
        run.checkpoints.wait()
        if lead:
            print(f"error: {err}", flush=True)
        return EXIT_BAD_STEPS
    finally:
        run.checkpoints.wait()
    progress.close()
    log.close()
    run.checkpoints.close()
    if lead:
        _summary(run, rows, step, stop)
    return 0


def _summary(run: Run, rows: list[dict[str, Any]], step: int, stop: StopRequest) -> None:
    options = run.options
    plots = [p for p in (plot_loss(options.out), plot_reward(options.out) if run.rl is not None else None) if p]
    trained = [r for r in rows if "loss" in r]
    if stop.signal_name is not None:
        print(f"stopped by {stop.signal_name} after step {step} of {options.steps}; checkpoint saved. "
              f"Resume with: python scripts/train.py --config {os.path.join(options.out, 'config.yaml')}", flush=True)
        if not trained:
            return
    if not trained:
        print(f"{options.out} is already at step {step} of {options.steps}: nothing to train "
              f"(raise --{flag('steps')} to continue)", flush=True)
        return
    speeds = [r["tokens_per_sec"] for r in trained[1:]] or [trained[0]["tokens_per_sec"]]
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
    rewards = [r["eval_reward"] for r in rows if r.get("eval_reward") is not None]
    sampled = (f", sampled reward {trained[0]['reward_mean']:.3f} -> {trained[-1]['reward_mean']:.3f}"
               if run.rl is not None else "")
    print(f"trained steps {trained[0]['step']}-{trained[-1]['step']} of {options.steps}: loss "
          f"{trained[0]['loss']:.4f} -> {trained[-1]['loss']:.4f}{sampled}"
          + (f", held-out loss {evals[-1]:.4f}" if evals else "")
          + (f", held-out greedy reward {rewards[-1]:.3f}" if rewards else "")
          + f", {statistics.median(speeds):,.0f} tokens/s (median), {run.skipped_steps} skipped steps; "
          f"run directory {options.out} (checkpoints/, metrics.jsonl"
          + "".join(f", {os.path.basename(p)}" for p in plots) + ")", flush=True)


def train(options: TrainOptions, stop: StopRequest | None = None) -> int:
    """Run (or resume) the training described by `options`; the process exit code. `stop`: a
    StopRequest entered earlier (scripts install it before jax loads), else one is made here."""
    if stop is None:
        with StopRequest() as stop:
            return train(options, stop)
    run = prepare(options)
    if stop.agreed():
        print(f"stopped by {stop.signal_name} before the first step; nothing was trained or saved", flush=True)
        run.checkpoints.close()
        return 0
    return loop(run, stop)
