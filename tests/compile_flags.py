"""XLA flags for every test process, subprocesses included.

The tests' programs are tiny and each is compiled once, so compile time dominates the suite: these
skip LLVM's optimisation passes and XLA's loop-fusion emitters, about half of each compile. Results
change only by float32 rounding, which every test's tolerance allows.
"""

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# One LLVM module per program: with XLA:CPU's parallel codegen (several modules compiled side by side),
# the first run of a freshly compiled VLM step on fsdp=2,sp=4 deadlocked in about 5 of 8 runs on the
# 2-vCPU VM (one simulated device in an all-gather the others never started, the others in a collective
# permute); with one module, none in the runs since (tests/test_train_vision.py's docstring).
ONE_CODEGEN_MODULE = "--xla_cpu_parallel_codegen_split_count=1"


def with_devices(count: int) -> str:
    """XLA_FLAGS for a process with `count` simulated CPU devices."""
    return f"--xla_force_host_platform_device_count={count} {COMPILE_FLAGS} {ONE_CODEGEN_MODULE}"
