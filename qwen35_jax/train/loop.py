"""The training run: open or resume the run directory, build model, data and optimizer, train, save.

    run = prepare(options, objective)   # checks, mesh, model (fresh or restored), optimizer, jitted step,
                                        # and the objective's side: batch source, step, evaluation
    train(options, stop, objective)     # prepare + the loop: step, log, evaluate, checkpoint, stop on signals

What is trained is the `Objective` (`train.objective`): SFT and offline PPO by default, any other (online
GRPO: `qwen35_jax.objectives.objective_for`) passed in.

A run stops at `--steps`, on SIGTERM/SIGINT (after the current step, with a checkpoint), or after
`--max-bad-steps` non-finite steps in a row (without a checkpoint: the newest one is the last good state).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from typing import Any

import jax
from flax import nnx

from qwen35_jax.checkpoint import _config_dict, load_checkpoint
from qwen35_jax.config import SCAN_LAYERS_FLAGS, Qwen35Config
from qwen35_jax.parallel.processes import is_lead_process, sync_processes
from qwen35_jax.hf.load import abstract_model
from qwen35_jax.kernel_choices import check_kernel_choices, explain_compile_failure, kernels_config
from qwen35_jax.parallel.mesh import FSDP, init_distributed, make_mesh, mesh_axis_size
from qwen35_jax.train.abstract_state import abstract_train_state
from qwen35_jax.train.checkpoints import RunCheckpoints
from qwen35_jax.train.data import check_batch_size, process_slice
from qwen35_jax.train.flops import peak_tflops, train_flops
from qwen35_jax.train.metrics import MetricsLog, Progress, plot_loss
from qwen35_jax.train.objective import Objective, ObjectiveRun, RunSetup
from qwen35_jax.train.offline import OFFLINE, OfflineObjective
from qwen35_jax.train.optim import init_opt_state, make_optimizer, make_schedule
from qwen35_jax.train.options import TrainOptions, flag
from qwen35_jax.train.remat_choice import make_config_train_step
from qwen35_jax.train.run import open_run_dir, write_config
from qwen35_jax.train.signals import StopRequest
from qwen35_jax.train.sources import check_model_inputs, data_has_images, run_image_processor
from qwen35_jax.train.step import StepOptions

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
    step_options: StepOptions  # what the step computes; scoring outside it takes its `.scoring`
    objective: ObjectiveRun  # batch source, step, evaluation, checkpointed position
    checkpoints: RunCheckpoints
    batch_size: int
    start_step: int = 0
    skipped_steps: int = 0
    applied_updates: int = 0


def default_objective(options: TrainOptions) -> Objective:
    """The objective of `options` that `train/` implements itself (sft, ppo)."""
    if options.objective not in OFFLINE:
        raise ValueError(f"--objective {options.objective} is not one the trainer implements itself: pass its "
                         "Objective (qwen35_jax.objectives.objective_for picks every one by name)")
    return OfflineObjective(options.objective)


def check_options(options: TrainOptions, objective: Objective | None = None) -> None:
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
    objective = objective or default_objective(options)
    if objective.name != options.objective:
        raise ValueError(f"--objective {options.objective}, but the run was given the {objective.name} objective")
    objective.check(options)


def _start_model(options: TrainOptions, mesh: jax.sharding.Mesh) -> tuple[Qwen35Config, Any, dict[str, Any]]:
    """(config, sharded params as a pure dict, checkpoint metadata) of the starting point: --model's
    checkpoint (a run directory's newest), else the --preset init of --seed."""
    if options.preset is not None:
        from qwen35_jax.model import Qwen35ForCausalLM
        from qwen35_jax.parallel.mesh import create_sharded
        config = Qwen35Config.preset(options.preset, param_dtype=options.param_dtype)
        if not data_has_images(options):  # as for an HF checkpoint: text data trains the text model alone
            config = config.text_only()
        model = create_sharded(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(options.seed)), mesh)
        return config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), {"layout": None, "hf_config": None}
    from qwen35_jax.checkpoint import is_checkpoint, resolve_checkpoint
    from qwen35_jax.hf.load import load_hf
    path = resolve_checkpoint(options.model)
    if is_checkpoint(path):
        model, config, meta = load_checkpoint(path, dtype=options.param_dtype, mesh=mesh)
        meta = {"layout": meta.get("layout"), "hf_config": meta.get("hf_config")}
    else:
        # an HF VLM checkpoint's vision tower is loaded when the data holds images (text data: the text model)
        model, config, ckpt = load_hf(path, dtype=options.param_dtype, mesh=mesh,
                                      text_only=not data_has_images(options))
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


def _default_compute_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def prepare(options: TrainOptions, objective: Objective | None = None) -> Run:
    """Check the options and the run directory, then build (or restore) everything for the loop.
    `objective`: what is trained (default: `default_objective(options)`)."""
    objective = objective or default_objective(options)
    check_options(options, objective)
    options, resuming = open_run_dir(options.out, options)  # refuses another run before anything is written
    init_distributed()  # before anything asks jax for its backend
    check_kernel_choices(options.attention, options.compute_dtype or _default_compute_dtype())
    mesh = make_mesh(options.mesh)
    fsdp = mesh_axis_size(mesh, FSDP)
    batch_size = options.batch_size or objective.default_batch_size(options, fsdp)
    check_batch_size(batch_size, fsdp, options.grad_accum)
    options = dataclasses.replace(  # resolved defaults are stored, so a resume on another mesh keeps them
        options, batch_size=batch_size, schedule_steps=options.total_schedule_steps,
        compute_dtype=options.compute_dtype or _default_compute_dtype())

    updates_per_step = objective.updates_per_step(options)  # the schedule counts optimizer updates
    schedule = make_schedule(options.lr, options.total_schedule_steps * updates_per_step,
                             options.warmup_steps * updates_per_step, options.final_lr_ratio)
    tx = make_optimizer(schedule, weight_decay=options.weight_decay, clip_norm=options.clip_norm,
                        b1=options.adam_b1, b2=options.adam_b2, eps=options.adam_eps,
                        frozen=("visual",) if options.freeze_vision else ())
    checkpoints = RunCheckpoints(options.out, keep=options.keep) if resuming else None
    restored = None
    stored_config = checkpoints.model_config() if checkpoints is not None else None
    if stored_config is not None:
        config = Qwen35Config(**stored_config)
        _, abstract, abstract_opt = abstract_train_state(config, mesh, tx)
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
    check_model_inputs(options, config)  # before the run directory is written

    if is_lead_process():
        write_config(options.out, options)
        if config.vision is not None:
            run_image_processor(options, config).save(options.out)
    sync_processes("qwen35_run_dir_ready")
    if checkpoints is None:
        checkpoints = RunCheckpoints(options.out, keep=options.keep)

    shard_index, shard_count = process_slice(mesh, batch_size, options.grad_accum)
    step_options = objective.step_options(options)
    graphdef, _, _ = abstract_model(config)
    source = objective.open(RunSetup(
        options=options, mesh=mesh, config=config, graphdef=graphdef, params=params, step_options=step_options,
        batch_size=batch_size, shard_index=shard_index, shard_count=shard_count, restored=restored is not None,
        start_params=lambda model: _start_model(dataclasses.replace(options, model=model), mesh)[1]))
    train_step = make_config_train_step(config, tx, step_options,
                                        (jax.tree.map(lambda x: x.sharding, params),
                                         jax.tree.map(lambda x: x.sharding, opt_state)),
                                        log=functools.partial(print, flush=True) if is_lead_process() else None)
    run = Run(options=options, mesh=mesh, config=config, meta=meta, params=params, opt_state=opt_state,
              schedule=schedule, train_step=train_step, step_options=step_options, objective=source,
              checkpoints=checkpoints, batch_size=batch_size, start_step=start_step)
    if restored is not None:
        state = meta["train"]
        source.set_state(state["data_state"])
        run.skipped_steps, run.applied_updates = state["skipped_steps"], state["applied_updates"]
    return run


def save(run: Run, step: int) -> None:
    train_state = {"step": step, "data_state": run.objective.get_state(), "skipped_steps": run.skipped_steps,
                   "applied_updates": run.applied_updates, "seed": run.options.seed}
    run.checkpoints.save(step, run.params, run.opt_state, {**run.meta, "train": train_state})


def _row(run: Run, step: int, metrics: dict[str, Any], seconds: float, lr: float, peak: float | None,
         flops: float) -> dict[str, Any]:
    row = {"step": step, **{k: float(v) for k, v in metrics.items()}, "lr": lr,
           "tokens_per_sec": float(metrics["batch_tokens"]) / seconds,
           "mfu": flops / seconds / (peak * 1e12 * run.mesh.size) if peak else None,
           "skipped_steps": run.skipped_steps, "epoch": run.objective.epoch(),
           "step_seconds": seconds, "time": time.time()}
    return row


def _one_step(run: Run, step: int) -> tuple[dict[str, Any], int]:
    """(metrics, padded row length) of optimizer step `step`, the objective's (one update on the next
    batch, or online: sampling, rewards and --ppo-epochs updates)."""
    try:
        return run.objective.step(run, step)
    except Exception as err:
        first = step == run.start_step + 1
        hint = explain_compile_failure(err, attention=run.options.attention, logprob_backend=run.options.logprob_backend,
                                       kernels=run.config.kernels) if first else None
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
                if run.objective.evaluates and options.eval_every and step % options.eval_every == 0:
                    row.update(run.objective.evaluate(run.params))
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
            if run.objective.evaluates and step == options.steps and not evaluated:
                final = run.objective.evaluate(run.params)
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
    plots = [p for p in (plot_loss(options.out), *run.objective.plots(options.out)) if p]
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
    print(f"trained steps {trained[0]['step']}-{trained[-1]['step']} of {options.steps}: loss "
          f"{trained[0]['loss']:.4f} -> {trained[-1]['loss']:.4f}{run.objective.summary(trained)}"
          + (f", held-out loss {evals[-1]:.4f}" if evals else "")
          + (f", held-out greedy reward {rewards[-1]:.3f}" if rewards else "")
          + f", {statistics.median(speeds):,.0f} tokens/s (median), {run.skipped_steps} skipped steps; "
          f"run directory {options.out} (checkpoints/, metrics.jsonl"
          + "".join(f", {os.path.basename(p)}" for p in plots) + ")", flush=True)


def train(options: TrainOptions, stop: StopRequest | None = None, objective: Objective | None = None) -> int:
    """Run (or resume) the training described by `options`; the process exit code. `stop`: a
    StopRequest entered earlier (scripts install it before jax loads), else one is made here.
    `objective`: what is trained (default: `default_objective(options)`)."""
    if stop is None:
        with StopRequest() as stop:
            return train(options, stop, objective)
    run = prepare(options, objective)
    if stop.agreed():
        print(f"stopped by {stop.signal_name} before the first step; nothing was trained or saved", flush=True)
        run.checkpoints.close()
        return 0
    return loop(run, stop)
