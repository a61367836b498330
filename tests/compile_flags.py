"""XLA flags for every test process, subprocesses included.

The tests' programs are tiny and each is compiled once, so compile time dominates the suite: these
skip LLVM's optimisation passes and XLA's loop-fusion emitters, about half of each compile. Results
change only by float32 rounding, which every test's tolerance allows.
"""

import os

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# The first run of a freshly compiled VLM train step on fsdp=2,sp=4 can deadlock in XLA:CPU's collectives
# (one simulated device in an all-gather the others never start, the others in a collective permute; the
# process aborts at the rendezvous timeout): 2 of 5 runs on the loaded 2-vCPU VM with one codegen module,
# 0 of 5 with XLA:CPU's concurrency-optimised scheduler off as well (2026-12-07). Both are kept.
SERIAL_COLLECTIVES = ("--xla_cpu_parallel_codegen_split_count=1 "
                      "--xla_cpu_enable_concurrency_optimized_scheduler=false")
# The scheduler flag changes compile-time memory: a test that holds a program's memory to what XLA:CPU's
# default scheduler gives reruns itself in a process with this variable set (`in_default_scheduler_process`).
DEFAULT_SCHEDULER_ENV = "QWEN35_TEST_DEFAULT_SCHEDULER"


def with_devices(count: int) -> str:
    """XLA_FLAGS for a process with `count` simulated CPU devices."""
    serial = SERIAL_COLLECTIVES
    if os.environ.get(DEFAULT_SCHEDULER_ENV):
        serial = serial.replace("--xla_cpu_enable_concurrency_optimized_scheduler=false", "")
    return f"--xla_force_host_platform_device_count={count} {COMPILE_FLAGS} {serial}".strip()


def in_default_scheduler_process(nodeid: str) -> bool:
    """In a test: True when this process compiles with XLA:CPU's default scheduler (run the test's body);
    otherwise run test `nodeid` in a pytest process that does, assert it passed, and return False."""
    import subprocess
    import sys

    if os.environ.get(DEFAULT_SCHEDULER_ENV):
        return True
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env[DEFAULT_SCHEDULER_ENV] = "1"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", nodeid],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return False
