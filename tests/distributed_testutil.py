"""Launch one command as several jax.distributed processes on CPU, joined through localhost."""

from __future__ import annotations

import os
import socket
import subprocess

from compile_flags import with_devices


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(cmd: list[str], *, processes: int = 2, devices_per_process: int = 4,
                  timeout: float = 600) -> list[str]:
    """Run `cmd` as `processes` workers of one jax.distributed job (each with `devices_per_process`
    simulated CPU devices); assert every worker exits 0 and return their combined stdout/stderr."""
    env = dict(os.environ)
    env.update(XLA_FLAGS=with_devices(devices_per_process),
               JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
               JAX_NUM_PROCESSES=str(processes))
    procs = [subprocess.Popen(cmd, env={**env, "JAX_PROCESS_ID": str(i)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(processes)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs
