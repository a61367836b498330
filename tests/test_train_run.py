"""The training run: resume continues the same loss curve (same and other mesh), signals stop cleanly,
torn checkpoints are never used, metrics hold each step once, bad input is refused in one line, and
a run directory exports to HF and scores."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from qwen35_jax.train.loop import prepare, train
from qwen35_jax.train.options import TrainOptions, parse_options

ROOT = Path(__file__).resolve().parents[1]
# one small run shape shared by the tests, so the persistent compilation cache serves most of them
BASE = dict(preset="tiny", synthetic=True, seq_len=32, batch_size=8, lr=3e-3, warmup_steps=1, schedule_steps=6,
            save_every=2, progress=False, weight_decay=0.01)


def run_train(out: Path, **overrides) -> int:
    return train(TrainOptions(**{**BASE, "out": str(out), "mesh": "fsdp=2,sp=4", **overrides}))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> np.ndarray:
    return np.array([r["loss"] for r in metrics(out) if "loss" in r])


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> Path:
    """Six uninterrupted steps: the curve every resumed run must reproduce."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert run_train(out, steps=6) == 0
    return out


def test_run_directory_holds_metrics_events_plot_config_and_checkpoints(straight_run):
    rows = metrics(straight_run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for key in ("step", "loss", "grad_norm", "lr", "tokens", "tokens_per_sec", "mfu", "skipped_steps", "time", "nll"):
        assert all(key in r for r in rows), key
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[0]["mfu"] is None  # CPU: no peak rate
    assert all(r["skipped_steps"] == 0 for r in rows) and rows[0]["time"] > 1.7e9
    assert (straight_run / "loss.png").stat().st_size > 1000
    assert list(straight_run.glob("events.out.tfevents.*"))
    assert sorted(os.listdir(straight_run / "checkpoints")) == ["2", "4", "6"]  # keep 3
    stored = yaml.safe_load((straight_run / "config.yaml").read_text())
    assert stored["batch_size"] == 8 and stored["compute_dtype"] == "float32" and stored["steps"] == 6


def test_default_remat_is_chosen_at_the_first_step_and_reported(tmp_path, capsys):
    assert run_train(tmp_path / "run", steps=1) == 0
    assert "remat auto -> none (blocks scanned): without recomputation the step needs" in capsys.readouterr().out


def test_resume_on_another_mesh_continues_the_same_loss_curve(straight_run, tmp_path):
    """Resuming on the same mesh is the SIGTERM test's (exact to 1e-6); here the mesh changes."""
    out = tmp_path / "run"
    assert run_train(out, steps=3) == 0  # checkpoints at 2 (save_every) and 3 (the last step)
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "3"]
    # a torn write of step 4 (orbax's temporary directory) must never be picked up
    (out / "checkpoints" / "4.orbax-checkpoint-tmp-1700000000").mkdir()
    assert run_train(out, steps=6, mesh="fsdp=8,sp=1") == 0
    assert [r["step"] for r in metrics(out)] == list(range(1, 7))
    np.testing.assert_allclose(losses(out), losses(straight_run), rtol=1e-5)


def test_damaged_newest_checkpoint_falls_back_to_the_one_before(straight_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight_run, out)
    for f in (out / "checkpoints" / "6" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"\0" * 16)  # damaged by hand
    shutil.rmtree(out / "checkpoints" / "2")
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text())
    assert run_train(out, steps=6) == 0
    err = capsys.readouterr().err
    assert "checkpoint 6" in err and "resuming from the one before" in err
    assert (out / "damaged" / "6").is_dir()
    np.testing.assert_allclose(losses(out), losses(straight_run), rtol=1e-6)  # steps 5, 6 trained again


def test_out_holding_another_run_is_refused_and_left_alone(straight_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight_run, out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(ValueError, match=r"holds another run: lr=0\.003 \(now 0\.01\)"):
        run_train(out, steps=8, lr=1e-2)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a run directory"):
        run_train(tmp_path / "other", steps=1)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def run_script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def cli(out: Path, **overrides) -> list[str]:
    values = {**BASE, "mesh": "fsdp=2,sp=4", "out": str(out), **overrides}
    args = []
    for name, value in values.items():
        if isinstance(value, bool):
            args.append(f"--{'' if value else 'no-'}{name.replace('_', '-')}")
        else:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def test_help_documents_every_option():
    result = run_script("--help")
    assert result.returncode == 0
    for name in TrainOptions.__dataclass_fields__:
        assert f"--{name.replace('_', '-')}" in result.stdout, name
    assert "--config" in result.stdout and "resume" in result.stdout


def test_config_file_holds_options_and_flags_override_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny\nsynthetic: true\nlr: 0.001\ngrad-accum: 2\nout: somewhere\n")
    options = parse_options(["--config", str(path), "--lr", "0.01"])
    assert (options.preset, options.lr, options.grad_accum, options.out) == ("tiny", 0.01, 2, "somewhere")
    (tmp_path / "run.json").write_text(json.dumps({"steps": 3, "data": "d1"}))
    options = parse_options(["--config", str(tmp_path / "run.json")])
    assert options.steps == 3 and options.data == ["d1"]
    path.write_text("preset: tiny\nscan-layers: false\n")  # YAML's bool for an auto|true|false option
    assert parse_options(["--config", str(path)]).scan_layers == "false"


@pytest.mark.parametrize("text, message", [
    ("lr: 0.1\nlearning_rate: 2\n", "unknown option 'learning_rate'"),
    ("steps: ten\n", "option 'steps' must be int, got 'ten'"),
    ("synthetic: 1\n", "option 'synthetic' must be bool"),
    ("objective: dpo\n", "--objective must be one of sft, ppo, grpo"),
    ("- lr\n", "expected a mapping of options"),
])
def test_bad_config_file_is_one_line_error_and_writes_nothing(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = run_script("--config", str(path), "--out", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2 and message in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert not (tmp_path / "run").exists()


def test_bad_batch_size_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    result = run_script(*cli(out, steps=1, batch_size=6, grad_accum=2))
    assert result.returncode == 2
    assert "batch size 6 must be a positive multiple of fsdp x grad-accum = 2 x 2" in result.stderr
    assert result.stderr.strip().count("\n") == 0 and not out.exists()


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def start_script(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def rows_written(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly_then_resume_and_kill9(straight_run, tmp_path):
    out = tmp_path / "run"
    proc = start_script(*cli(out, steps=200, schedule_steps=6, save_every=100))
    wait_for(lambda: rows_written(out) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "stopped by SIGTERM after step" in output and f"--config {out / 'config.yaml'}" in output
    stopped_at = max(int(n) for n in os.listdir(out / "checkpoints"))
    assert stopped_at == rows_written(out) >= 1

    # kill -9 a few steps later, likely while a checkpoint is being written: the resume starts from
    # the newest complete one (the steps after it are lost, nothing else)
    proc = start_script("--config", str(out / "config.yaml"), "--save-every", "1")
    wait_for(lambda: rows_written(out) >= stopped_at + 3, proc)
    proc.kill()
    proc.wait()
    kept = max(int(n) for n in os.listdir(out / "checkpoints") if n.isdigit())
    assert kept >= stopped_at
    final = max(6, kept + 1)
    result = run_script(*cli(out, steps=final))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resuming {out} from step {kept}" in result.stdout
    assert [r["step"] for r in metrics(out)] == list(range(1, final + 1))  # each step once
    np.testing.assert_allclose(losses(out)[:6], losses(straight_run), rtol=1e-6)


def test_sigterm_before_the_first_step_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = start_script(*cli(out, steps=3))
    time.sleep(1.5)  # while jax loads and the model is built, long before a step
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and "stopped by SIGTERM before the first step" in output, output[-3000:]
    assert not [n for n in os.listdir(out / "checkpoints") if n.isdigit()] and not (out / "metrics.jsonl").exists()
    assert run_train(out, steps=1) == 0  # the directory is still a valid run, starting from scratch


def test_too_many_non_finite_steps_stop_with_the_last_good_checkpoint(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    np.save(data / "tokens.npy", rng.integers(0, 256, size=(24, 16)).astype(np.int32))
    np.save(data / "old_log_probs.npy", np.full((24, 16), -5.0, np.float32))
    advantages = np.ones(24, np.float32)
    advantages[[4, 5]] = 3e38  # batch 3: the surrogate overflows to inf; batches 5+ all of it
    advantages[8:] = 3e38
    np.save(data / "advantages.npy", advantages)
    out = tmp_path / "run"
    options = {**BASE, "synthetic": False, "data": [str(data)], "objective": "ppo", "batch_size": 2,
               "save_every": 1, "max_bad_steps": 3}
    code = train(TrainOptions(**options, out=str(out), mesh="fsdp=2,sp=4", steps=20))
    assert code == 3
    rows = metrics(out)
    assert [r["applied"] for r in rows] == [1, 1, 0, 1, 0, 0, 0]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 2, 3, 4]
    # skipped steps leave the state as it was, so their checkpoints hold the last good state too
    assert sorted(int(n) for n in os.listdir(out / "checkpoints")) == [4, 5, 6]


def test_export_hf_of_a_run_directory_loads_in_transformers_and_scores(straight_run, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    hf_dir = tmp_path / "hf"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(straight_run), str(hf_dir)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    tokens = np.random.default_rng(1).integers(0, 256, size=(2, 12))
    np.save(tmp_path / "tokens.npy", tokens)
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "logprobs.py"), "--model", str(straight_run),
                             "--tokens", str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "scores.npz"),
                             "--attention", "xla", "--gdn-sp-mode", "all_to_all"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    ours = np.load(tmp_path / "scores.npz")["log_probs"][:, :-1]
    with torch.no_grad():
        logits = hf_model(torch.as_tensor(tokens)).logits
    theirs = torch.log_softmax(logits, -1)[:, :-1].gather(-1, torch.as_tensor(tokens)[:, 1:, None])[..., 0]
    # our float32 scoring of the trained weights vs transformers in float64: float32 rounding only
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-4)


def jsonl_corpus(directory: Path) -> tuple[Path, list[str]]:
    """Text and chat rows of varied lengths (the demo tokenizer fits the tiny preset's vocabulary)."""
    from qwen35_jax.data.demo import demo_corpus

    train_files, _, tokenizer = demo_corpus(str(directory))
    return Path(tokenizer), [str(p) for p in train_files]


def test_jsonl_data_resumes_mid_epoch_with_the_rows_of_the_uninterrupted_run(tmp_path):
    tokenizer, files = jsonl_corpus(tmp_path / "corpus")
    options = dict(BASE, synthetic=False, data=files, tokenizer=str(tokenizer))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_train(straight, steps=4, **options) == 0
    assert run_train(resumed, steps=2, **options) == 0
    state = json.loads((resumed / "checkpoints" / "2" / "meta" / "metadata").read_text())["train"]["data_state"]
    assert state  # the stream's position travels in the checkpoint
    assert run_train(resumed, steps=4, **options) == 0
    np.testing.assert_allclose(losses(resumed), losses(straight), rtol=1e-6)


def test_prepared_dataset_trains_and_bf16_compute_keeps_float32_masters(tmp_path):
    from qwen35_jax.checkpoint import load_checkpoint

    tokenizer, files = jsonl_corpus(tmp_path / "corpus")
    prepared = tmp_path / "packed"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), *files, "--tokenizer",
                             str(tokenizer), "--seq-len", "32", "--out", str(prepared)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "run"
    assert run_train(out, steps=2, synthetic=False, data=[str(prepared)], compute_dtype="bfloat16") == 0
    assert np.isfinite(losses(out)).all()
    _, config, _ = load_checkpoint(str(out))
    assert (config.param_dtype, config.dtype) == ("float32", "bfloat16")


def test_a_failing_pallas_kernel_names_the_fallback_flags(monkeypatch):
    import jax

    from qwen35_jax.kernel_choices import explain_compile_failure

    err = RuntimeError("Mosaic failed to compile kernel\nlong trace")
    assert explain_compile_failure(err, attention="auto", logprob_backend="auto") is None  # CPU: XLA anyway
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    hint = explain_compile_failure(err, attention="auto", logprob_backend="xla")
    assert "rerun with --attention xla" in hint and "Mosaic failed" in hint and "\n" not in hint
    assert explain_compile_failure(err, attention="xla", logprob_backend="xla") is None
    hint = explain_compile_failure(err, attention="cudnn", logprob_backend="xla")
    assert "if a Pallas or cuDNN kernel is the cause, rerun with --attention auto" in hint


def test_cudnn_attention_is_refused_up_front_off_a_gpu(tmp_path, monkeypatch):
    import jax

    from qwen35_jax.kernel_choices import check_kernel_choices

    out = tmp_path / "run"
    with pytest.raises(ValueError, match="attention implementation 'cudnn' needs a CUDA GPU, this backend is cpu"):
        prepare(parse_options(["--preset", "tiny", "--synthetic", "--out", str(out), "--attention", "cudnn"]))
    assert not out.exists()  # refused before the run directory is written
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="--attention cudnn needs --compute-dtype bfloat16 .* got float32"):
        check_kernel_choices("cudnn", "float32")
    check_kernel_choices("cudnn", "bfloat16")


def test_gdn_bf16_matmuls_follow_the_float32_loss_curve(straight_run, tmp_path, capsys):
    # --gdn-precision bf16 rounds the GDN chunked form's matmul operands to bfloat16 (2**-9 relative):
    # the first two losses of the tiny run moved by 3.4e-7 and 1.0e-5 relative (AMD EPYC). A largest
    # change above 1e-7 shows the setting reached the traced step (unchanged it is 0), below 1e-3 that
    # nothing else changed.
    assert parse_options(["--gdn-precision", "bf16"]).gdn_precision == "bf16"
    with pytest.raises(SystemExit):
        parse_options(["--gdn-precision", "tf32"])
    assert "--gdn-precision" in capsys.readouterr().err
    out = tmp_path / "bf16"
    assert run_train(out, steps=2, gdn_precision="bf16") == 0
    ref, got = losses(straight_run)[:2], losses(out)
    rel = np.abs(got - ref) / np.abs(ref)
    assert 1e-7 < rel.max() < 1e-3, rel


def test_kernel_choices_match_the_kernels_lists():
    # The command lines (train.py, logprobs.py, bench_train.py) offer CHOICES, a jax-free table: it must
    # name exactly the backends the kernels accept, no more (a dead flag) and no fewer (an unreachable one).
    from qwen35_kernels.attention import IMPLEMENTATIONS
    from qwen35_kernels.logprob_entropy import BACKENDS

    from qwen35_jax.train.options import CHOICES

    assert set(CHOICES["logprob_backend"]) == set(BACKENDS)
    # pallas_gpu / pallas_tpu are the per-platform names "pallas" resolves to
    assert set(CHOICES["attention"]) == set(IMPLEMENTATIONS) - {"pallas_gpu", "pallas_tpu"}


def test_restated_choice_lists_match_their_homes():
    # CHOICES restates the lists whose home module loads jax (options load without it) or lives in rl/
    # (which train/ does not import): they must agree.
    from qwen35_kernels.logprob_entropy.sharded import MODES

    from qwen35_jax.losses import KL_ESTIMATORS
    from qwen35_jax.rl.advantages import ADVANTAGES
    from qwen35_jax.train.options import CHOICES

    assert CHOICES["lm_head"] == MODES
    assert CHOICES["kl_estimator"] == KL_ESTIMATORS
    assert CHOICES["advantage"] == ADVANTAGES
