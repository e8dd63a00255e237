# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.filter.vllm import pinned_version, vllm_flag_value


@pytest.mark.parametrize(
    'argv, expected',
    [
        (['--max-num-seqs', '256'], '256'),
        (['--max-num-seqs=128'], '128'),
        (['--max-num-seqs', '256', '--enforce-eager', '--max-num-seqs=64'], '64'),  # the last one wins
        (['--max-num-seqs=64', '--max-num-seqs', '8'], '8'),
        (['--max-num-batched-tokens', '8192'], ''),  # another option sharing the prefix
        (['--max-num-seqsx=3'], ''),
        (['--max-num-seqs'], ''),  # given last, with no value
        ([], ''),
    ],
)
def test_vllm_flag_value_reads_as_vllms_parser(argv, expected):
    assert vllm_flag_value(argv, '--max-num-seqs') == expected


@pytest.mark.parametrize(
    'argv, flag, message',
    [
        ('--max-num-seqs 8', '--max-num-seqs', 'vllm_flag_value expects a list of arguments, got str'),
        ([], 'max-num-seqs', "vllm_flag_value expects a long option such as --max-num-seqs, got 'max-num-seqs'"),
    ],
)
def test_vllm_flag_value_refuses(argv, flag, message):
    with pytest.raises(AnsibleFilterError) as err:
        vllm_flag_value(argv, flag)
    assert str(err.value) == message


@pytest.mark.parametrize(
    'spec, expected',
    [
        ('vllm==0.33.0', '0.33.0'),
        ('vllm == 0.10.2', '0.10.2'),
        ('vllm===0.33.0rc1', '0.33.0rc1'),
        ('vllm[audio]==0.33.0; python_version >= "3.10"', '0.33.0'),
        ('vllm>=0.30', ''),
        ('vllm==0.30,!=0.31', ''),
        ('vllm', ''),
        ('/wheels/vllm-0.33.0+cpu-cp312-cp312-linux_x86_64.whl', ''),
    ],
)
def test_pinned_version(spec, expected):
    assert pinned_version(spec) == expected
