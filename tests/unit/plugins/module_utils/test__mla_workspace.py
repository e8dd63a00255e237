# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""TRITON_MLA's decode workspace against hand calculations from vLLM 0.33.0/0.34.0's triton_mla.py."""

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._mla_workspace import (
    applies,
    decode_workspace,
    next_power_of_2,
    num_kv_splits,
    runs_triton_mla,
    sm_count_of,
)
from ansible_collections.llmserve.vllm.tests.support import checkpoint_config

KIMI = checkpoint_config('kimi-k2.5-nvfp4')
RTX_PRO_6000 = 'NVIDIA RTX PRO 6000 Blackwell Server Edition'


@pytest.mark.parametrize('n, power', [(1, 1), (2, 2), (3, 4), (255, 256), (256, 256), (257, 512)])
def test_next_power_of_2_as_triton(n, power):
    assert next_power_of_2(n) == power


@pytest.mark.parametrize(
    'max_model_len, sm_count, splits',
    [
        (131072, 188, 256),  # next_pow2(256) = 256, under 2 x 188
        (262144, 188, 376),  # next_pow2(512) = 512, capped at 2 x 188
        (100000, 188, 256),  # 100000 // 512 = 195 -> 256
        (511, 188, 1),  # max(1, 0) -> 1
        (262144, None, 512),  # no SM count: not capped, never fewer than vLLM's
        (131072, 108, 216),  # A100: 2 x 108
    ],
)
def test_num_kv_splits_as_compute_num_kv_splits(max_model_len, sm_count, splits):
    assert num_kv_splits(max_model_len, sm_count) == splits


def test_kimi_on_rtx_pro_6000_by_hand():
    """max_num_seqs x q_heads_per_rank x splits x (kv_lora_rank + 1) x 4 bytes: 64 heads over TP 8, 256 splits at
    131,072 tokens, kv_lora_rank 512; 4.0 GiB at vLLM's default 1024 sequences, 0.25 GiB at 64."""
    at_1024 = decode_workspace(KIMI, 8, 1024, 131072, RTX_PRO_6000)
    assert at_1024 == {
        'bytes': 1024 * 8 * 256 * 513 * 4,
        'splits': 256,
        'heads_per_rank': 8,
        'sm_count': 188,
        'sm_count_source': 'table',
    }
    assert at_1024['bytes'] == 4303355904  # 4.008 GiB
    assert decode_workspace(KIMI, 8, 64, 131072, RTX_PRO_6000)['bytes'] == 64 * 8 * 256 * 513 * 4


def test_the_sm_count_given_wins_and_an_unknown_gpu_is_not_capped():
    given = decode_workspace(KIMI, 8, 64, 262144, 'NVIDIA Some Future GPU', sm_count=100)
    assert (given['splits'], given['sm_count'], given['sm_count_source']) == (200, 100, 'given')
    unknown = decode_workspace(KIMI, 8, 64, 262144, 'NVIDIA Some Future GPU')
    assert (unknown['splits'], unknown['sm_count'], unknown['sm_count_source']) == (512, None, 'unknown')


@pytest.mark.parametrize(
    'name, count',
    [
        (RTX_PRO_6000, 188),
        ('NVIDIA RTX PRO 6000 Blackwell Workstation Edition', 188),
        ('NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition', 188),
        ('NVIDIA GeForce RTX 5090', 170),
        ('NVIDIA L40S', 142),
        ('NVIDIA L40', 142),
        ('NVIDIA A100-SXM4-80GB', 108),
        ('NVIDIA H100 80GB HBM3', 132),  # for the Triton sampler's buffer (it runs FLASH_ATTN_MLA)
        ('NVIDIA H100 PCIe', None),
    ],
)
def test_sm_count_of(name, count):
    assert sm_count_of(name) == count


@pytest.mark.parametrize(
    'capability, triton',
    [('12.0', True), ('12.1', True), ('8.0', True), ('8.9', True), ('9.0', False), ('10.0', False), ('', False)],
)
def test_runs_triton_mla_as_get_backend_priorities(capability, triton):
    assert runs_triton_mla(capability) is triton


@pytest.mark.parametrize(
    'config, capability, version, expected',
    [
        (KIMI, '12.0', (0, 33), True),
        (KIMI, '12.0', (0, 34), True),
        (KIMI, '12.0', None, True),
        (KIMI, '12.0', (0, 32), False),  # reserved after the profile run, in the builder
        (KIMI, '9.0', (0, 34), False),  # Hopper runs FLASH_ATTN_MLA
        (dict(KIMI, text_config=dict(KIMI['text_config'], index_topk=2048)), '12.0', (0, 34), False),  # sparse MLA
        ({'model_type': 'llama'}, '12.0', (0, 34), False),
    ],
    ids=['0.33', '0.34', 'current', '0.32', 'hopper', 'sparse-mla', 'not-mla'],
)
def test_applies(config, capability, version, expected):
    assert applies(config, capability, version) is expected
