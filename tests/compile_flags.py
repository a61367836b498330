"""XLA flags for every test process, subprocesses included.

The tests' programs are tiny and each is compiled once, so compile time dominates the suite: these
skip LLVM's optimisation passes and XLA's loop-fusion emitters, about half of each compile. Results
change only by float32 rounding, which every test's tolerance allows.
"""

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# The first run of a freshly compiled VLM train step on fsdp=2,sp=4 can deadlock in XLA:CPU's collectives
# (one simulated device in an all-gather the others never start, the others in a collective permute; the
# process aborts at the rendezvous timeout): 2 of 5 runs on the loaded 2-vCPU VM with one codegen module,
# 0 of 5 with XLA:CPU's concurrency-optimised scheduler off as well (2026-12-07). Both are kept.
SERIAL_COLLECTIVES = ("--xla_cpu_parallel_codegen_split_count=1 "
                      "--xla_cpu_enable_concurrency_optimized_scheduler=false")


def with_devices(count: int) -> str:
    """XLA_FLAGS for a process with `count` simulated CPU devices."""
    return f"--xla_force_host_platform_device_count={count} {COMPILE_FLAGS} {SERIAL_COLLECTIVES}"
