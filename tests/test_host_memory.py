"""A CPU run's allocator setting (mpt/host_memory.py): freed memory is reused, not faulted in afresh."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from mpt import host_memory

# Allocates and frees a 64 MB tensor, then counts the page faults of allocating and filling it again.
PROBE = textwrap.dedent(
    """
    import json, resource, sys, torch
    from mpt import host_memory
    kept = host_memory.keep_freed() if sys.argv[1] == "keep" else host_memory.kept()
    torch.ones(16 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)
    print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
    """
)


def probe(mode: str, env: dict | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env, timeout=120
    )
    return json.loads(out.stdout)


def glibc() -> bool:
    import ctypes

    return hasattr(ctypes.CDLL(None), "gnu_get_libc_version")


@pytest.mark.skipif(not glibc(), reason="the setting is glibc's")
def test_a_kept_heap_reuses_a_freed_large_block_where_glibc_faults_it_in_again():
    default, kept = probe("default"), probe("keep")
    assert not default["kept"] and kept["kept"]
    # 64 MB is 16,384 pages of 4 KiB or 32 huge pages: faulted in again by default, reused when kept.
    assert default["faults"] >= 32 and kept["faults"] < default["faults"] / 4


@pytest.mark.skipif(not glibc(), reason="the setting is glibc's")
def test_mpt_keep_freed_memory_0_leaves_the_allocator_as_it_is(monkeypatch):
    import os

    assert not probe("keep", {**os.environ, "MPT_KEEP_FREED_MEMORY": "0"})["kept"]


def test_the_record_says_whether_freed_memory_was_kept():
    import torch

    from mpt.provenance import environment

    assert environment(torch.device("cpu"))["freed_memory_kept"] is host_memory.kept()


RELEASE = textwrap.dedent(
    """
    import json, torch
    from mpt import host_memory

    def rss():
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) << 10

    host_memory.keep_freed()
    big = torch.ones(64 << 20)
    del big
    kept = rss()
    host_memory.release()
    print(json.dumps({"kept": kept, "released": rss()}))
    """
)


@pytest.mark.skipif(not glibc(), reason="the setting is glibc's")
def test_release_returns_the_kept_memory_so_a_runs_peak_starts_low():
    out = json.loads(subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True).stdout)
    assert out["released"] < out["kept"] - 200 * 2**20  # the freed 256 MiB left the process
