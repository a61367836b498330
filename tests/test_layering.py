"""The import graph is the one docs/architecture.md draws: kernels are a leaf, `parallel/` never imports
the layers or the model, the library imports neither torch nor Pallas (kernels live in
qwen35_kernels, torch-based benchmark helpers in scripts/bench/qwen35_bench), `train/` imports neither
`rl/` nor `generation/`, and no library module imports a demo."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = REPO / "qwen35_jax"


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every absolute module a file imports, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def offenders(folder: pathlib.Path, banned: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(REPO)} imports {name}" for path in sorted(folder.rglob("*.py"))
            for name in sorted(imported_modules(path)) if name.startswith(banned)]


def test_parallel_never_imports_the_layers_or_the_model():
    assert offenders(LIBRARY / "parallel", ("qwen35_jax.layers", "qwen35_jax.model")) == []


def test_library_imports_no_torch_and_no_pallas():
    """No PyTorch modelling code in the library; a checkpoint's image processor (transformers' PIL and
    NumPy code, `transformers.models.<model>.image_processing_*`) is the one part of a model folder it reads."""
    found = offenders(LIBRARY, ("torch", "jax.experimental.pallas", "transformers.models"))
    image_processors = [f for f in found if f.split(" imports ")[1].startswith("transformers.models.")
                        and any(part.startswith("image_processing") for part in f.split(" imports ")[1].split("."))]
    assert [f for f in found if f not in image_processors] == []


def test_layers_import_no_runtime():
    runtime = ("qwen35_jax.model", "qwen35_jax.train", "qwen35_jax.data", "qwen35_jax.hf", "qwen35_jax.scoring")
    assert offenders(LIBRARY / "layers", runtime) == []


def test_the_options_and_the_config_load_without_jax():
    # scripts/train.py parses its options and installs its signal handler before jax loads; the
    # config holds KernelChoices, so qwen35_kernels.choices must not load jax or the kernels either
    code = ("import sys, qwen35_jax.train.options, qwen35_jax.config; "
            "print(sorted(m for m in ('jax', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["[]"], out.stdout


def test_train_imports_neither_rl_nor_generation():
    # the loop knows objectives by their interface (train/objective.py); online GRPO lives in rl/
    assert offenders(LIBRARY / "train", ("qwen35_jax.rl", "qwen35_jax.generation")) == []


def test_no_library_module_imports_a_demo():
    # the demos (scripts/train.py --demo) use the library; nothing in it uses them
    found = [f"{path.relative_to(REPO)} imports {name}" for path in sorted(LIBRARY.rglob("*.py"))
             if LIBRARY / "demos" not in path.parents
             for name in sorted(imported_modules(path)) if name.startswith("qwen35_jax.demos")]
    assert found == []
    assert not (LIBRARY / "train" / "demo.py").exists() and not (LIBRARY / "rl" / "demo.py").exists()


def test_generation_imports_neither_train_nor_rl():
    # generation runs the model's forward pass with a cache; training and RL are built on it, not under it
    assert offenders(LIBRARY / "generation", ("qwen35_jax.train", "qwen35_jax.rl")) == []


def test_no_context_variable_decides_what_runs():
    # the kernels and the model take their choices by argument: no module of either keeps a context
    # variable that a trace would read (a program must not depend on what was in force where it was traced)
    users = [str(path.relative_to(REPO)) for folder in (LIBRARY, REPO / "kernels")
             for path in sorted(folder.rglob("*.py")) if "contextvars" in imported_modules(path)]
    assert users == []
