# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.llmserve.vllm.plugins.filter.vllm import (
    pinned_version,
    vllm_cluster_args,
    vllm_flag_value,
    vllm_flags_named,
    vllm_rendered_flags,
    vllm_serve_argv,
)


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
        (
            '--max-num-seqs 8',
            '--max-num-seqs',
            "vllm_flag_value expects a list of arguments, got str '--max-num-seqs 8'",
        ),
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


SERVE_SETTINGS = {
    'entrypoint': ['/opt/vllm/0123456789ab/bin/vllm', 'serve'],
    'model': '/models/kimi-k2.5-nvfp4',
    'served_model_name': 'kimi-k2.5',
    'host': '127.0.0.1',
    'port': 8000,
    'uds': '',
    'tensor_parallel_size': 8,
    'pipeline_parallel_size': 1,
    'max_model_len': 131072,
    'gpu_memory_utilization': 0.95,
    'kv_cache_memory_bytes': 0,
    'kv_cache_dtype': 'auto',
    'tool_call_parser': 'kimi_k2',
    'trust_remote_code': True,
    'multimodal': 'encoder_data_parallel',
    'allowed_media_domains': [],
    'limit_mm_per_prompt': {'video': 0, 'image': 8},
    'flags': {'--reasoning-parser': 'kimi_k2', '--shutdown-timeout': 120},
    'cluster_args': [],
    'extra_args': ['--max-num-seqs', '64'],
}
FLAGS_EXPECTED = 'a mapping of long options (--name) to a text, a number, a boolean or none'
REAL_CASE_ARGV = [
    '/opt/vllm/0123456789ab/bin/vllm',
    'serve',
    '/models/kimi-k2.5-nvfp4',
    '--served-model-name',
    'kimi-k2.5',
    '--host',
    '127.0.0.1',
    '--port',
    '8000',
    '--tensor-parallel-size',
    '8',
    '--pipeline-parallel-size',
    '1',
    '--max-model-len',
    '131072',
    '--gpu-memory-utilization',
    '0.95',
    '--enable-auto-tool-choice',
    '--tool-call-parser',
    'kimi_k2',
    '--trust-remote-code',
    '--mm-encoder-tp-mode',
    'data',
    '--allowed-media-domains',
    'media.invalid',
    '--limit-mm-per-prompt',
    '{"image": 8, "video": 0}',
    '--reasoning-parser',
    'kimi_k2',
    '--shutdown-timeout',
    '120',
    '--max-num-seqs',
    '64',
]


def test_vllm_serve_argv_of_the_real_case():
    assert vllm_serve_argv(SERVE_SETTINGS) == REAL_CASE_ARGV


def test_a_unix_socket_replaces_the_host_and_the_port():
    """A single node's vLLM serves on a Unix socket behind its front door: no TCP port for any local user."""
    argv = vllm_serve_argv(dict(SERVE_SETTINGS, uds='/run/vllm-kimi-api/vllm.sock'))
    at = REAL_CASE_ARGV.index('--host')
    assert argv == REAL_CASE_ARGV[:at] + ['--uds', '/run/vllm-kimi-api/vllm.sock'] + REAL_CASE_ARGV[at + 4 :]


@pytest.mark.parametrize(
    'changes, expected_run',
    [
        (
            {'kv_cache_memory_bytes': 1048576},
            ['--gpu-memory-utilization', '0.95', '--kv-cache-memory-bytes', '1048576'],
        ),
        ({'kv_cache_dtype': 'fp8'}, ['--gpu-memory-utilization', '0.95', '--kv-cache-dtype', 'fp8']),
        ({'multimodal': 'text_only', 'extra_args': []}, ['--trust-remote-code', '--language-model-only']),
        ({'multimodal': 'encoder_tensor_parallel', 'extra_args': []}, ['--mm-encoder-tp-mode', 'weights']),
        ({'multimodal': '', 'trust_remote_code': False, 'extra_args': []}, ['kimi_k2', '--allowed-media-domains']),
        (
            {'cluster_args': ['--nnodes', '2', '--node-rank', '1', '--headless'], 'extra_args': ['--enforce-eager']},
            ['120', '--nnodes', '2', '--node-rank', '1', '--headless', '--enforce-eager'],
        ),
        (
            {'allowed_media_domains': ['images.example.org', 'cdn.example.org']},
            ['--allowed-media-domains', 'images.example.org', 'cdn.example.org', '--limit-mm-per-prompt'],
        ),
        ({'limit_mm_per_prompt': {}}, ['--allowed-media-domains', 'media.invalid', '--reasoning-parser']),
        # Each option of flags as it is given: 0 is a value; none, empty or false leaves the option out, true passes
        # it alone.
        (
            {'flags': {'--shutdown-timeout': 0}},
            ['{"image": 8, "video": 0}', '--shutdown-timeout', '0', '--max-num-seqs'],
        ),
        (
            {'flags': {'--reasoning-parser': '', '--shutdown-timeout': None, '--enable-x': False}},
            ['{"image": 8, "video": 0}', '--max-num-seqs', '64'],
        ),
        (
            {'flags': {'--enable-prefix-caching': True}},
            ['{"image": 8, "video": 0}', '--enable-prefix-caching', '--max-num-seqs'],
        ),
    ],
)
def test_vllm_serve_argv_follows_each_setting(changes, expected_run):
    argv = vllm_serve_argv(dict(SERVE_SETTINGS, **changes))
    runs = [argv[start : start + len(expected_run)] for start in range(len(argv))]
    assert expected_run in runs


def test_vllm_serve_argv_of_a_language_model_only_sets_no_media_limit():
    argv = vllm_serve_argv(dict(SERVE_SETTINGS, multimodal='text_only'))
    assert '--limit-mm-per-prompt' not in argv
    assert argv[argv.index('--allowed-media-domains') + 1] == 'media.invalid'


def test_vllm_serve_argv_without_a_tool_parser_leaves_auto_tool_choice_out():
    argv = vllm_serve_argv(dict(SERVE_SETTINGS, tool_call_parser=''))
    assert '--enable-auto-tool-choice' not in argv and '--tool-call-parser' not in argv


@pytest.mark.parametrize(
    'settings, message',
    [
        (['serve'], "vllm_serve_argv expects a mapping of settings, got list ['serve']"),
        (
            dict((k, v) for k, v in SERVE_SETTINGS.items() if k != 'max_model_len'),
            'vllm_serve_argv: settings missing max_model_len, unknown none',
        ),
        (dict(SERVE_SETTINGS, max_num_seq=8), 'vllm_serve_argv: settings missing none, unknown max_num_seq'),
        (
            dict(SERVE_SETTINGS, flags=['--shutdown-timeout', 120]),
            'vllm_serve_argv: flags must be %s, got %r' % (FLAGS_EXPECTED, ['--shutdown-timeout', 120]),
        ),
        (
            dict(SERVE_SETTINGS, flags={'-tp': 8}),
            'vllm_serve_argv: flags must be %s, got %r' % (FLAGS_EXPECTED, {'-tp': 8}),
        ),
        (
            dict(SERVE_SETTINGS, flags={'--shutdown-timeout': [120]}),
            'vllm_serve_argv: flags must be %s, got %r' % (FLAGS_EXPECTED, {'--shutdown-timeout': [120]}),
        ),
        (
            dict(SERVE_SETTINGS, flags={'--shutdown-timeout': float('nan')}),
            'vllm_serve_argv: flags must be %s, got %r' % (FLAGS_EXPECTED, {'--shutdown-timeout': float('nan')}),
        ),
    ],
)
def test_vllm_serve_argv_refuses(settings, message):
    with pytest.raises(AnsibleFilterError) as err:
        vllm_serve_argv(settings)
    assert str(err.value) == message


@pytest.mark.parametrize(
    'argv, named',
    [
        (['--enforce-eager', '--max-num-seqs', '64'], []),
        (['--api-key', 'sk-x'], ['--api-key']),
        (['--api-key=sk-x'], ['--api-key']),
        (['--API_KEY=sk-x'], ['--api-key']),
        # argparse's abbreviations, as vLLM's parser takes them.
        (['--allowed-local', '/'], ['--allowed-local-media-path']),
        (['-tp', '2'], ['-tp']),
        # A short option abbreviated as argparse takes it too (-t is only -tp's beginning); a value is not an option.
        (['-t', '2', 'api-key'], ['-tp']),
        (['--tensor_parallel_size=2'], ['-tp']),
        (['--max-model-len', '4096', '--api-key', 'k'], ['--api-key', '--max-model-len']),
    ],
)
def test_vllm_flags_named(argv, named):
    assert vllm_flags_named(argv, ['--api-key', '--allowed-local-media-path', '-tp', '--max-model-len']) == named


@pytest.mark.parametrize(
    'argv, named',
    [
        # A short spelling with its value attached, as argparse reads a two-letter option (-r1 is --node-rank 1).
        (['-r1'], ['--node-rank']),
        (['-n', '2'], ['--nnodes']),
        (['-rotary'], ['--node-rank']),
        # vLLM's parser merges --option.key value into --option's JSON, after the command line's own.
        (['--limit-mm-per-prompt.image', '64'], ['--limit-mm-per-prompt']),
        (['--limit_mm_per_prompt.image=64'], ['--limit-mm-per-prompt']),
        (['--master_addr', 'x'], ['--master-addr']),
        (['--config', 'x.yaml'], ['--config']),
        (['--conf=x.yaml'], ['--config']),
        (['--config.max_model_len', '1'], ['--config']),
        (['--compilation-config', '{"level": 0}', '-O3', '-1'], []),
        (['--', '-', 'x'], []),
    ],
)
def test_vllm_flags_named_reads_every_spelling_of_vllms_parser(argv, named):
    flags = ['--node-rank', '--nnodes', '--limit-mm-per-prompt', '--master-addr', '--config']
    assert vllm_flags_named(argv, flags) == named


# The role's command line in each variant: one node and two (head and worker), TCP and a Unix socket, each multimodal
# mode, tools and remote code on, the flags' options on.
EVERY_RENDERED_FLAG = [
    '--allowed-media-domains',
    '--enable-auto-tool-choice',
    '--gpu-memory-utilization',
    '--headless',
    '--host',
    '--kv-cache-dtype',
    '--kv-cache-memory-bytes',
    '--language-model-only',
    '--limit-mm-per-prompt',
    '--master-addr',
    '--master-port',
    '--max-model-len',
    '--mm-encoder-tp-mode',
    '--nnodes',
    '--node-rank',
    '--pipeline-parallel-size',
    '--port',
    '--reasoning-parser',
    '--served-model-name',
    '--shutdown-timeout',
    '--tensor-parallel-size',
    '--tool-call-parser',
    '--trust-remote-code',
    '--uds',
]


@pytest.mark.parametrize(
    'changes',
    [
        pytest.param({}, id='the-real-case'),
        # None of the variant options in the plan: each is still the role's.
        pytest.param(
            {
                'tool_call_parser': '',
                'trust_remote_code': False,
                'multimodal': 'text_only',
                'uds': '/run/vllm-kimi-api/vllm.sock',
                'flags': {'--reasoning-parser': '', '--shutdown-timeout': None},
                'limit_mm_per_prompt': {},
            },
            id='a-single-text-node-on-its-socket',
        ),
        pytest.param({'cluster_args': vllm_cluster_args(2, 1, '10.0.0.1', 29501)}, id='a-worker'),
    ],
)
def test_vllm_rendered_flags_are_every_option_of_every_variant(changes):
    settings = dict(SERVE_SETTINGS, **changes)
    del settings['max_model_len']  # the preflight sizes it after the refusals
    assert vllm_rendered_flags(settings) == EVERY_RENDERED_FLAG


def test_vllm_rendered_flags_follow_the_flags_the_role_passes():
    """An option added to the role's flags (vars/main.yml's _vllm_kimi_serve_flags) is refused with no other edit; an
    extra argument is none of the role's."""
    settings = dict(SERVE_SETTINGS, flags={'--max-num-seqs': None}, extra_args=['--enforce-eager'])
    rendered = vllm_rendered_flags(settings)
    assert '--max-num-seqs' in rendered and '--reasoning-parser' not in rendered and '--enforce-eager' not in rendered


@pytest.mark.parametrize(
    'nnodes, node_rank, expected',
    [
        (1, 0, []),
        (2, 0, ['--nnodes', '2', '--node-rank', '0', '--master-addr', '10.0.0.1', '--master-port', '29501']),
        (
            '3',
            '2',
            ['--nnodes', '3', '--node-rank', '2', '--master-addr', '10.0.0.1', '--master-port', '29501', '--headless'],
        ),
    ],
)
def test_vllm_cluster_args(nnodes, node_rank, expected):
    assert vllm_cluster_args(nnodes, node_rank, '10.0.0.1', 29501) == expected


def test_vllm_cluster_args_refuses_a_rank_beyond_the_nodes():
    with pytest.raises(AnsibleFilterError, match=r'vllm_serve_argv: node_rank must be below nnodes \(2\), got 2'):
        vllm_cluster_args(2, 2, '10.0.0.1', 29501)


def test_vllm_flags_named_refuses_what_is_no_list():
    with pytest.raises(AnsibleFilterError, match='expects a list of arguments and a list of options'):
        vllm_flags_named('--api-key x', ['--api-key'])
