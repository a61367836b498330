"""qwen35_kernels is a leaf package (jax only) that imports next to transformers without shadowing."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import qwen35_kernels

import qwen35_jax

REPO = pathlib.Path(__file__).resolve().parents[1]
KERNELS = REPO / "kernels"


def test_package_is_the_repo_folder_and_kernels_is_no_package():
    assert pathlib.Path(qwen35_kernels.__file__).resolve().parent == KERNELS / "qwen35_kernels"
    assert not (KERNELS / "__init__.py").exists()


def test_package_imports_only_jax_and_the_standard_library():
    allowed = {"jax", "qwen35_kernels"} | set(sys.stdlib_module_names)
    for path in (KERNELS / "qwen35_kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{path.relative_to(REPO)} imports {roots - allowed}"


def test_importing_every_op_loads_neither_flax_nor_the_model_package():
    code = ("import sys, qwen35_kernels, qwen35_kernels.attention, qwen35_kernels.gated_delta_rule, "
            "qwen35_kernels.gdn_inputs, qwen35_kernels.logprob_entropy; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'flax', 'qwen35_jax', 'torch', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["['numpy']"], out.stdout  # numpy comes with jax itself


def test_top_level_export():
    assert qwen35_jax.linear_logprob_entropy is qwen35_kernels.linear_logprob_entropy


_SIDE_BY_SIDE = r"""
import importlib.util, json, pathlib
import qwen35_kernels
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.utils import import_utils
config = Qwen3_5TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention"])
model = Qwen3_5ForCausalLM(config).eval()
with torch.no_grad():
    logits = model(torch.arange(5)[None]).logits
spec = importlib.util.find_spec("kernels")
print(json.dumps({
    "qwen35_kernels": qwen35_kernels.__file__,
    "kernels_locations": [] if spec is None else [str(p) for p in (spec.submodule_search_locations or [spec.origin])],
    "hub_kernels_available": import_utils.is_kernels_available(),
    "logits_shape": list(logits.shape),
}))
"""


def test_imports_side_by_side_with_transformers(tmp_path):
    # Run from a folder outside the repo: the installed packages alone decide what `kernels` is.
    out = subprocess.run(
        [sys.executable, "-c", _SIDE_BY_SIDE], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert pathlib.Path(info["qwen35_kernels"]).resolve().parent == KERNELS / "qwen35_kernels"
    assert all(pathlib.Path(p).resolve() != KERNELS for p in info["kernels_locations"]), info
    assert info["logits_shape"] == [1, 5, 64]
    if not info["kernels_locations"]:
        assert info["hub_kernels_available"] is False


def test_transformers_does_not_take_our_folder_for_the_hub_kernels_package():
    # Under `python -m pytest` from the repo root, the folder `kernels/` is importable as a namespace
    # package; transformers must still see no Hugging Face `kernels` distribution unless one is installed.
    import importlib.util
    from importlib import metadata

    from transformers.utils import import_utils

    try:
        metadata.version("kernels")
    except metadata.PackageNotFoundError:
        assert import_utils.is_kernels_available() is False
    else:
        spec = importlib.util.find_spec("kernels")
        assert spec is not None and spec.origin and KERNELS not in pathlib.Path(spec.origin).resolve().parents
