"""Huge pages for host allocations: the entry points restart themselves with glibc's THP tunable.

XLA:CPU allocates each execution's scratch buffer (the step's temporaries) with a fresh `mmap`, so
the kernel faults every page of it in again on every step, 4 KiB at a time. With
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` glibc asks for transparent huge pages on such mappings
(`madvise`), which fault in 2 MiB at a time (docs/lab_log.md has the fault counts and their cost).
glibc reads tunables only when a process starts, so `scripts/train.py` and the benchmarks call
`restart_with_huge_pages()` first thing: it re-executes the same command line, with the same pid, once.

It does nothing off Linux, on another C library or glibc before 2.35, when THP is "never", when
GLIBC_TUNABLES already sets `glibc.malloc.hugetlb`, when QWEN35_KEEP_MALLOC is set (any value), and
for a program read from stdin or an interactive session (neither could be run again).
On GPU and TPU the scratch buffers live on the device; the setting only touches host allocations.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

HUGE_PAGES = "glibc.malloc.hugetlb=1"
OPT_OUT = "QWEN35_KEEP_MALLOC"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the running glibc, None for another C library or platform."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def transparent_huge_pages_usable(setting_file: str = THP_SETTING) -> bool:
    """Whether the kernel grants THP to an madvise'd mapping: its setting is [always] or [madvise]."""
    try:
        with open(setting_file) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_environment(env: Mapping[str, str], *, glibc: tuple[int, int] | None,
                          thp: bool) -> dict[str, str] | None:
    """The environment to restart with, or None when there is nothing to change (see the module doc)."""
    if OPT_OUT in env or glibc is None or glibc < (2, 35) or not thp:
        return None
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return None
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}


def restart_with_huge_pages() -> None:
    """Re-execute this Python command line with huge-page malloc, unless nothing would change.

    Call it before anything else starts (threads, open files, jax): the process image is replaced.
    """
    if sys.platform != "linux" or sys.argv[0] in ("", "-"):  # interactive, or a program read from stdin
        return
    env = huge_page_environment(os.environ, glibc=glibc_version(), thp=transparent_huge_pages_usable())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
