"""Huge-page malloc: the entry points restart once with glibc's THP tunable, and only when it applies."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qwen35_jax.host_memory import (HUGE_PAGES, OPT_OUT, glibc_version, huge_page_environment,
                                    transparent_huge_pages_usable)

GLIBC = (2, 36)


def test_sets_the_tunable_and_keeps_the_users_others():
    assert huge_page_environment({"A": "1"}, glibc=GLIBC, thp=True) == {"A": "1", "GLIBC_TUNABLES": HUGE_PAGES}
    env = huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, glibc=GLIBC, thp=True)
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=4:{HUGE_PAGES}"


@pytest.mark.parametrize("env, glibc, thp", [
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, GLIBC, True),  # the user's own choice stands
    ({OPT_OUT: ""}, GLIBC, True),  # opted out
    ({}, (2, 34), True),  # glibc before the tunable
    ({}, None, True),  # another C library
    ({}, GLIBC, False),  # THP "never"
])
def test_changes_nothing_when_it_does_not_apply(env, glibc, thp):
    assert huge_page_environment(env, glibc=glibc, thp=thp) is None


def test_thp_setting_is_read_from_the_kernels_file(tmp_path):
    setting = tmp_path / "enabled"
    for text, usable in (("always [madvise] never\n", True), ("[always] madvise never\n", True),
                         ("always madvise [never]\n", False)):
        setting.write_text(text)
        assert transparent_huge_pages_usable(str(setting)) is usable
    assert not transparent_huge_pages_usable(str(tmp_path / "missing"))


RESTART = ("import os, sys; from qwen35_jax.host_memory import restart_with_huge_pages; "
           "restart_with_huge_pages(); print(os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])")


def run_restart(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", RESTART, "--flag", "value"], env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_a_process_restarts_once_with_its_command_line():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    applies = sys.platform == "linux" and (glibc_version() or (0, 0)) >= (2, 35) and transparent_huge_pages_usable()
    assert run_restart(env) == f"{HUGE_PAGES if applies else None} ['--flag', 'value']"
    assert run_restart({**env, OPT_OUT: "1"}) == "None ['--flag', 'value']"


def test_a_program_read_from_stdin_is_not_restarted():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    out = subprocess.run([sys.executable, "-"], input=RESTART, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None []"  # ran once, in this process, without the tunable
