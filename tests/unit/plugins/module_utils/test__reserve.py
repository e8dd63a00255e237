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
    [('0.10.2', 38, 0), ('0.25.0', 38, 0), ('0.33.0', 14, 4), (None, 14, 4)],
    ids=['sort-0.10', 'sort-0.25', 'flashinfer-0.33', 'current'],
)
def test_the_sampler_bounds_the_activation_at_many_sequences(version, per_logit, penalty_counts):
    """256 sequences over a 128,256 vocabulary outweigh a 2,048-token forward pass: at 38 bytes a logit with PyTorch's
    sort before vLLM 0.26, 14 with FlashInfer's sort-free sampler from 0.33, which also keeps 4-byte penalty counts."""
    parts = estimate(
        CONFIG, 1, 0.9, 80 * 1024 * MIB, max_num_seqs=256, max_num_batched_tokens=2048, vllm_version=version
    )
    assert parts['activation'] == 256 * 128256 * per_logit + 2048 * 4096 * 2
    assert parts['penalty_counts'] == 256 * 128256 * penalty_counts


@pytest.mark.parametrize(
    'gpu_name, buffer_rows',
    [('NVIDIA H100 80GB HBM3', 132), ('NVIDIA GeForce RTX 4090', 128), ('NVIDIA H100 PCIe', 256)],
    ids=['h100-sxm', 'rtx-4090', 'unknown-uncapped'],
)
@pytest.mark.parametrize('version', ['0.26.0', '0.32.0'])
def test_from_0_26_the_seeded_sampler_run_takes_the_triton_top_k_top_p(version, gpu_name, buffer_rows):
    """vLLM 0.26's second sampler run (seeded) takes the in-place Triton top-k/top-p: 14 bytes a logit, the kernel's
    buffer of one vocabulary row a program (capped at the SM count; uncapped for a GPU the table does not know) and
    the rows' hidden states twice (the last tokens' and torch.rand_like's)."""
    parts = estimate(CONFIG, 1, 0.9, 80 * 1024 * MIB, 256, 2048, vllm_version=version, gpu_name=gpu_name)
    sampler = 256 * 128256 * 14 + buffer_rows * 128256 * 4 + 2 * 256 * 4096 * 2
    assert parts['activation'] == sampler + 2048 * 4096 * 2
    assert parts['penalty_counts'] == 0


MOE = dict(CONFIG, moe_intermediate_size=2048, num_experts_per_tok=8, hidden_size=7168)


@pytest.mark.parametrize(
    'version, quantized, workspace',
    [('0.25.0', False, 0), ('0.26.0', True, 0), ('0.26.0', False, 2 * 2048 * 8 * 7168 * 2), (None, False, None)],
    ids=['before-0.26', 'quantized', 'unquantized-0.26', 'current'],
)
def test_the_triton_experts_workspace_stays_through_the_sampler_run(version, quantized, workspace):
    """From vLLM 0.26 the unquantized Triton experts' two bf16 buffers (tokens x top-k x max(2 x moe_intermediate,
    hidden)) live in the shared workspace, still held when the sampler's run peaks; quantized experts are not
    modelled, and releases before 0.26 allocated them per call."""
    gpu = 'NVIDIA H100 80GB HBM3'
    parts = estimate(MOE, 1, 0.9, 80 * 1024 * MIB, 1024, 2048, version, gpu, quantized=quantized)
    alone = estimate(MOE, 1, 0.9, 80 * 1024 * MIB, 1024, 2048, version, gpu, quantized=True)
    added = parts['activation'] - alone['activation']
    assert added == (2 * 2048 * 8 * 7168 * 2 if workspace is None else workspace)


def test_enforce_eager_estimates_no_cuda_graphs():
    """vLLM profiles CUDA graphs only where cudagraph_mode is not NONE, which --enforce-eager sets."""
    assert estimate(CONFIG, 1, 0.9, 80 * 1024 * MIB, vllm_version='0.26.0')['cuda_graphs'] == 32 * 16 * MIB
    assert estimate(CONFIG, 1, 0.9, 80 * 1024 * MIB, vllm_version='0.26.0', eager=True)['cuda_graphs'] == 0
