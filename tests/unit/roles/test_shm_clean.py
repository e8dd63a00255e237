# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The shared-memory cleaner removes dead runs' segments and keeps those live processes hold."""

import os
import subprocess
import sys
import time

import pytest

CLEANER = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'roles', 'vllm_kimi', 'files', 'llmserve-shm-clean')

# Holds one segment open by fd and another only through a mapping, then waits.
HOLDER = r"""
import mmap, os, sys, time
fd_held = open(sys.argv[1], 'r+b')
with open(sys.argv[2], 'r+b') as f:
    mapped = mmap.mmap(f.fileno(), 4096)
print('ready', flush=True)
time.sleep(60)
"""


@pytest.fixture
def shm_dir(tmp_path):
    for name in (
        'psm_dead01',
        'sem.mp-dead02',
        'nccl-dead03',
        'psm_live_fd',
        'psm_live_map',
        'unrelated.dat',
        'psm_young',
    ):
        (tmp_path / name).write_bytes(b'\0' * 4096)
    old = time.time() - 3600
    for name in ('psm_dead01', 'sem.mp-dead02', 'nccl-dead03', 'psm_live_fd', 'psm_live_map', 'unrelated.dat'):
        os.utime(str(tmp_path / name), (old, old))
    return tmp_path


def run_cleaner(shm_dir, *extra):
    return subprocess.run(
        [sys.executable, CLEANER, '--shm-dir', str(shm_dir), '--min-age', '60'] + list(extra),
        capture_output=True,
        text=True,
        check=True,
    )


def test_removes_dead_segments_and_keeps_live_young_and_unrelated_ones(shm_dir):
    holder = subprocess.Popen(
        [sys.executable, '-c', HOLDER, str(shm_dir / 'psm_live_fd'), str(shm_dir / 'psm_live_map')],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == 'ready'
        result = run_cleaner(shm_dir)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(os.listdir(str(shm_dir))) == ['psm_live_fd', 'psm_live_map', 'psm_young', 'unrelated.dat']
    assert result.stdout.splitlines() == [
        'removed stale segment %s' % (shm_dir / name) for name in ('nccl-dead03', 'psm_dead01', 'sem.mp-dead02')
    ]


def test_dry_run_lists_without_removing(shm_dir):
    result = run_cleaner(shm_dir, '--dry-run')
    assert len(os.listdir(str(shm_dir))) == 7
    assert result.stdout.splitlines() == [
        'would remove stale segment %s' % (shm_dir / name)
        for name in ('nccl-dead03', 'psm_dead01', 'psm_live_fd', 'psm_live_map', 'sem.mp-dead02')
    ]
