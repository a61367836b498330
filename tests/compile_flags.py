"""XLA flags for every test process, subprocesses included.

The tests' programs are tiny and each is compiled once, so compile time dominates the suite: these
skip LLVM's optimisation passes and XLA's loop-fusion emitters, about half of each compile. Results
change only by float32 rounding, which every test's tolerance allows.
"""

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# Simulated devices are threads sharing two cores with the other test worker: on a loaded machine one can
# reach a collective minutes after the others (a fresh program's first run), and XLA:CPU then ends the
# process at its rendezvous timeout. A real deadlock still fails, at the test's own timeout.
COLLECTIVE_TIMEOUTS = "--xla_cpu_collective_call_terminate_timeout_seconds=900 --xla_cpu_collective_timeout_seconds=900"


def with_devices(count: int) -> str:
    """XLA_FLAGS for a process with `count` simulated CPU devices."""
    return f"--xla_force_host_platform_device_count={count} {COMPILE_FLAGS} {COLLECTIVE_TIMEOUTS}"
