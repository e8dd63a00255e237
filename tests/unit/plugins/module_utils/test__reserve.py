# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The reserve's version- and board-dependent terms, case by case (the whole model is judged against real logs in
test_reserve_calibration.py)."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._reserve import (
    DRIVER_RESERVED_DEFAULT,
    MIB,
    NCCL_COMMUNICATORS_BYTES,
    NON_TORCH_BYTES,
    NON_TORCH_BYTES_SINCE_07,
    NVLS_BYTES,
    driver_reserved_bytes,
    estimate,
    non_torch_bytes,
    v0_accounting,
)


@pytest.mark.parametrize(
    'version, v0',
    [(None, False), ((0, 6), True), ((0, 7), True), ((0, 9), True), ((0, 10), False), ((0, 32), False)],
    ids=['current', '0.6', '0.7', '0.9-may-fall-back', '0.10', '0.32'],
)
def test_v0_accounting_by_version(version, v0):
    assert v0_accounting(version) is v0


@pytest.mark.parametrize(
    'tp, gpu, version, expected',
    [
        (1, 'NVIDIA H200', (0, 6), NON_TORCH_BYTES),
        (1, 'NVIDIA H200', (0, 7), NON_TORCH_BYTES_SINCE_07),
        (2, 'NVIDIA A100-SXM4-40GB', (0, 7), NON_TORCH_BYTES_SINCE_07 + NCCL_COMMUNICATORS_BYTES),
        (2, 'NVIDIA H200', (0, 7), NON_TORCH_BYTES_SINCE_07 + NCCL_COMMUNICATORS_BYTES),
        (8, 'NVIDIA H200', (0, 7), NON_TORCH_BYTES_SINCE_07 + NCCL_COMMUNICATORS_BYTES + NVLS_BYTES),
        (8, 'NVIDIA A100-SXM4-40GB', (0, 7), NON_TORCH_BYTES_SINCE_07 + NCCL_COMMUNICATORS_BYTES),
        (2, 'NVIDIA GeForce RTX 4090', (0, 7), NON_TORCH_BYTES_SINCE_07),
        (8, 'NVIDIA H200', (0, 10), NON_TORCH_BYTES_SINCE_07),
        (8, 'NVIDIA H200', None, NON_TORCH_BYTES_SINCE_07),
    ],
    ids=[
        'tp1-0.6',
        'tp1-0.7',
        'v0-a100-tp2-communicators',
        'v0-h200-tp2-no-nvls',
        'v0-h200-tp8-nvls',
        'v0-a100-tp8-no-nvls',
        'v0-geforce-host-memory',
        'v1-after-distributed-init',
        'current',
    ],
)
def test_non_torch_bytes(tp, gpu, version, expected):
    assert non_torch_bytes(tp, gpu, version) == expected


@pytest.mark.parametrize(
    'gpu, expected',
    [('NVIDIA H200', 616 * MIB), ('NVIDIA L40S', DRIVER_RESERVED_DEFAULT), ('', DRIVER_RESERVED_DEFAULT)],
    ids=['h200-measured', 'other-default', 'unknown-default'],
)
def test_driver_reserved_bytes(gpu, expected):
    assert driver_reserved_bytes(gpu) == expected


CONFIG = {'hidden_size': 4096, 'intermediate_size': 14336, 'vocab_size': 128256, 'num_hidden_layers': 32}


def test_the_hosts_reserved_reading_wins_over_the_table():
    with_reading = estimate(CONFIG, 1, 0.9, 80 * 1024 * MIB, gpu_name='NVIDIA H200', driver_reserved=100 * MIB)
    without = estimate(CONFIG, 1, 0.9, 80 * 1024 * MIB, gpu_name='NVIDIA H200')
    assert with_reading['driver'] == int(100 * MIB * 0.9)
    assert without['driver'] == int(616 * MIB * 0.9)


@pytest.mark.parametrize(
    'version, per_logit, penalty_counts',
    [('0.10.2', 38, 0), ('0.32.0', 38, 0), ('0.33.0', 14, 4), (None, 14, 4)],
    ids=['sort-0.10', 'sort-0.32', 'flashinfer-0.33', 'current'],
)
def test_the_sampler_bounds_the_activation_at_many_sequences(version, per_logit, penalty_counts):
    """256 sequences over a 128,256 vocabulary outweigh a 2,048-token forward pass: at 38 bytes a logit with PyTorch's
    sort before vLLM 0.33, 14 with FlashInfer's sort-free sampler from 0.33, which also keeps 4-byte penalty counts."""
    parts = estimate(
        CONFIG, 1, 0.9, 80 * 1024 * MIB, max_num_seqs=256, max_num_batched_tokens=2048, vllm_version=version
    )
    assert parts['activation'] == 256 * 128256 * per_logit + 2048 * 4096 * 2
    assert parts['penalty_counts'] == 256 * 128256 * penalty_counts
