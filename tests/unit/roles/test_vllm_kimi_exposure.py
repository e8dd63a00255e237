# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The preflight's refusal of a service other hosts reach without a key (tasks/preflight.yml, vars/main.yml), run by
Ansible on the role's defaults and the settings of each case, and the gpu inventory's key from Ansible Vault."""

import glob
import os
import re

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import LOAD_VLLM_KIMI_VARS, REPO, VLLM_KIMI, run_local_play

GPU_VARS = os.path.join(REPO, 'inventories', 'gpu', 'group_vars', 'vllm.yml')
REFUSAL_TASK = 'Refuse settings that open the service beyond its front door'
# 32 characters: the shortest key the preflight takes.
KEY = 'sk-t3st-key-0123456789abcdef0123'
CLIENT_KEY = 'ck-good-0123456789abcdef012345678'


def preflight_refusal():
    """The preflight's block of exposure refusals, one assert each."""
    with open(os.path.join(VLLM_KIMI, 'tasks', 'preflight.yml')) as handle:
        return [task for task in yaml.safe_load(handle) if task.get('name') == REFUSAL_TASK]


def refused_by(output):
    """The name of the task that failed the play."""
    failed = output[: output.index('fatal: [localhost]')]
    return re.findall(r'TASK \[(?:[a-z_.]+ : )?([^\]]+)\]', failed)[-1]


def refusal(tmp_path, extra_vars, more_vars=()):
    """The preflight's message for these settings (the role's variables, then more_vars's files), or None where it
    lets them through."""
    loads = LOAD_VLLM_KIMI_VARS + [{'ansible.builtin.include_vars': path} for path in more_vars]
    rc, output = run_local_play(tmp_path, loads + preflight_refusal(), extra_vars)
    if rc == 0:
        return None
    assert refused_by(output) in EXPOSURE_ASSERTS, output
    return output


EXPOSURE_ASSERTS = [task['name'] for task in preflight_refusal()[0]['block']]

OPEN = 'The service answers anyone who reaches %s without a key: set vllm_kimi_api_key'


@pytest.mark.parametrize(
    'extra_vars, refused_at',
    [
        pytest.param({}, '0.0.0.0:8443', id='defaults-front-door-on-every-address'),
        pytest.param({'vllm_kimi_front_address': '10.0.0.5'}, '10.0.0.5:8443', id='front-door-on-a-lan-address'),
        pytest.param({'vllm_kimi_front_address': '::'}, ':::8443', id='front-door-on-every-ipv6-address'),
        pytest.param({'vllm_kimi_api_key': KEY}, None, id='with-a-key'),
        pytest.param({'vllm_kimi_allow_anonymous_endpoint': True}, None, id='open-endpoint-accepted'),
        pytest.param({'vllm_kimi_front_address': '127.0.0.1'}, None, id='front-door-on-loopback'),
        pytest.param({'vllm_kimi_front_address': '127.0.1.1'}, None, id='front-door-on-another-loopback-address'),
        pytest.param(
            {'vllm_kimi_front_door': False, 'vllm_kimi_listen': 'tcp'}, None, id='no-front-door-vllm-on-loopback'
        ),
        pytest.param(
            {'vllm_kimi_front_door': False, 'vllm_kimi_listen': 'tcp', 'vllm_kimi_host': '0.0.0.0'},
            '0.0.0.0:8000',
            id='no-front-door-vllm-open',
        ),
    ],
)
def test_a_service_other_hosts_reach_needs_a_key(tmp_path, extra_vars, refused_at):
    output = refusal(tmp_path, extra_vars)
    if refused_at is None:
        assert output is None
    else:
        assert OPEN % refused_at in output, output
        assert 'or set vllm_kimi_allow_anonymous_endpoint to serve an open endpoint.' in output


def test_the_gpu_inventory_takes_its_key_from_the_vault_and_stops_without_it(tmp_path):
    with_gpu_vars = [GPU_VARS]
    assert refusal(tmp_path, {'vault_vllm_kimi_api_key': KEY}, with_gpu_vars) is None
    output = refusal(tmp_path, {}, with_gpu_vars)
    assert "'vault_vllm_kimi_api_key' is undefined" in output, output
    # A vault that holds an empty key is the open endpoint, refused as such.
    assert OPEN % '0.0.0.0:8443' in refusal(tmp_path, {'vault_vllm_kimi_api_key': ''}, with_gpu_vars)


KEY_REFUSED = 'vllm_kimi_api_key holds a space, a control character or a character beyond ASCII'


@pytest.mark.parametrize(
    'key, refused',
    [
        pytest.param('sk-A1_b2.c3~d4+e5/f6=g7!h8#i9@j0%k', False, id='token-punctuation'),
        pytest.param('sk-key\nreturn 200;', True, id='newline'),
        pytest.param('sk key', True, id='space'),
        pytest.param('sk-\u00e9t\u00e9', True, id='beyond-ascii'),
    ],
)
def test_a_key_clients_cannot_send_is_refused_without_showing_it(tmp_path, key, refused):
    output = refusal(tmp_path, {'vllm_kimi_api_key': key})
    if not refused:
        assert output is None
        return
    assert KEY_REFUSED in output, output
    assert 'sk-' not in output, output


CLEAR_TOKEN = 'vllm_kimi_hf_token would travel in clear text to vllm_kimi_hf_endpoint %s: use its https:// address'


@pytest.mark.parametrize(
    'endpoint, token, refused',
    [
        pytest.param('http://hub.example:8080', 'hf_t0ken', True, id='http-to-another-host'),
        pytest.param('HTTP://10.0.0.7', 'hf_t0ken', True, id='http-upper-case-to-a-lan-address'),
        pytest.param('https://hub.example', 'hf_t0ken', False, id='https'),
        pytest.param('http://127.0.0.1:8090', 'hf_t0ken', False, id='http-on-loopback'),
        pytest.param('http://[::1]:8090', 'hf_t0ken', False, id='http-on-ipv6-loopback'),
        pytest.param('http://hub.example:8080', '', False, id='http-without-a-token'),
        pytest.param('', 'hf_t0ken', False, id='the-default-hub'),
    ],
)
def test_a_hub_token_never_travels_in_clear_text(tmp_path, endpoint, token, refused):
    output = refusal(
        tmp_path,
        {'vllm_kimi_api_key': KEY, 'vllm_kimi_hf_endpoint': endpoint, 'vllm_kimi_hf_token': token},
    )
    if refused:
        assert CLEAR_TOKEN % endpoint in output, output
        assert token not in output
    else:
        assert output is None, output


LIST_REFUSAL_TASK = 'Refuse list settings given as text'


def list_refusal(tmp_path, extra_vars):
    with open(os.path.join(VLLM_KIMI, 'tasks', 'preflight.yml')) as handle:
        task = [task for task in yaml.safe_load(handle) if task.get('name') == LIST_REFUSAL_TASK]
    rc, output = run_local_play(tmp_path, LOAD_VLLM_KIMI_VARS + task, extra_vars)
    return None if rc == 0 else output


def test_the_list_settings_are_the_argument_specs_lists():
    with open(os.path.join(VLLM_KIMI, 'meta', 'argument_specs.yml')) as handle:
        options = yaml.safe_load(handle)['argument_specs']['main']['options']
    with open(os.path.join(VLLM_KIMI, 'vars', 'main.yml')) as handle:
        listed = yaml.safe_load(handle)['_vllm_kimi_list_settings']
    assert listed == sorted(name for name, option in options.items() if option.get('type') == 'list')


def test_a_list_setting_given_as_text_is_refused_by_name(tmp_path):
    # What `-e vllm_kimi_extra_args=--enforce-eager` gives: a text, which the argument spec's check lets through.
    output = list_refusal(tmp_path, {'vllm_kimi_extra_args': '--enforce-eager'})
    assert 'vllm_kimi_extra_args must be a list, not a text' in output, output
    both = list_refusal(tmp_path, {'vllm_kimi_extra_args': '--enforce-eager', 'vllm_kimi_entrypoint': 'bin/vllm'})
    assert 'vllm_kimi_entrypoint, vllm_kimi_extra_args must be lists, not a text' in both, both
    assert list_refusal(tmp_path, {'vllm_kimi_extra_args': ['--enforce-eager']}) is None


def test_a_unix_socket_without_the_front_door_is_refused(tmp_path):
    """Only the front door's workers may connect to vLLM's Unix socket: without the front door nothing would."""
    output = refusal(tmp_path, {'vllm_kimi_front_door': False})
    assert 'vllm_kimi_listen unix serves vLLM on a Unix socket that only the front door reaches' in output, output
    assert 'set vllm_kimi_listen: tcp' in output
    assert refusal(tmp_path, {'vllm_kimi_front_door': False, 'vllm_kimi_listen': 'tcp'}) is None


OVERRIDE_TASK = "Refuse extra arguments and environment that would undo the role's own settings"


def override_refusal(tmp_path, extra_vars, more_vars=()):
    with open(os.path.join(VLLM_KIMI, 'tasks', 'preflight.yml')) as handle:
        task = [task for task in yaml.safe_load(handle) if task.get('name') == OVERRIDE_TASK]
    loads = LOAD_VLLM_KIMI_VARS + [{'ansible.builtin.include_vars': path} for path in more_vars]
    rc, output = run_local_play(tmp_path, loads + task, extra_vars)
    return None if rc == 0 else output


SANDBOX_VARS = os.path.join(REPO, 'inventories', 'sandbox', 'group_vars', 'vllm.yml')


INVENTORIES = sorted(glob.glob(os.path.join(REPO, 'inventories', '*', 'group_vars', 'vllm.yml')))


@pytest.mark.parametrize('inventory', INVENTORIES, ids=lambda path: path.split(os.sep)[-3])
def test_the_inventories_override_nothing_of_the_roles_and_open_nothing(tmp_path, inventory):
    assert len(INVENTORIES) >= 3
    assert override_refusal(tmp_path, {'vault_vllm_kimi_api_key': KEY}, [inventory]) is None
    assert refusal(tmp_path, {'vault_vllm_kimi_api_key': KEY}, [inventory]) is None


# Options the role renders only in some of its variants (several nodes, a worker, TCP, a multimodal mode, tools,
# remote code): on a single node on its Unix socket, with none of them, each is still the role's.
OTHER_VARIANTS_OPTIONS = [
    (['--node-rank', '0'], '--node-rank'),
    (['--nnodes=2'], '--nnodes'),
    (['--master_addr', '10.0.0.1'], '--master-addr'),
    (['--master-port', '29501'], '--master-port'),
    (['--headless'], '--headless'),
    (['--mm-encoder-tp-mode=weights'], '--mm-encoder-tp-mode'),
    (['--language-model-only'], '--language-model-only'),
    (['--enable-auto-tool-choice'], '--enable-auto-tool-choice'),
    (['--tool-call-parser', 'hermes'], '--tool-call-parser'),
    (['--trust-remote-code'], '--trust-remote-code'),
    (['--kv-cache-memory-bytes', '1'], '--kv-cache-memory-bytes'),
    (['--port', '9000'], '--port'),
    # vLLM's parser: an abbreviation, a short spelling with its value attached, a key of a JSON option.
    (['--hos', '0.0.0.0'], '--host'),
    (['-r1'], '--node-rank'),
    (['-tp', '2'], '--tensor-parallel-size'),
    (['--limit-mm-per-prompt.image', '64'], '--limit-mm-per-prompt'),
]


def test_every_option_the_role_renders_in_any_variant_is_refused_in_the_extra_arguments(tmp_path):
    """vLLM keeps an option's last value, and the extra arguments come last: the options refused are read off the
    role's own command line in each of its variants, never listed by hand."""
    extra_args = ['--enforce-eager', '--compilation-config', '{"custom_ops": ["all"]}']
    for words, _flag in OTHER_VARIANTS_OPTIONS:
        extra_args += words
    output = override_refusal(tmp_path, {'vllm_kimi_extra_args': extra_args})
    assert refused_by(output) == 'Refuse extra arguments that set an option the role renders', output
    for _words, flag in OTHER_VARIANTS_OPTIONS:
        assert 'vllm_kimi_extra_args sets %s, which the role renders. ' % flag in output, (flag, output)
    # An option of _vllm_kimi_serve_flags names its variable.
    output = override_refusal(tmp_path, {'vllm_kimi_extra_args': ['--shutdown_timeout=5']})
    assert 'vllm_kimi_extra_args sets --shutdown-timeout, which the role renders from vllm_kimi_shutdown_timeout. ' in (
        output
    ), output
    assert "vLLM keeps an option's last value, so the extra argument would override the role's silently" in output
    assert '--enforce-eager' not in output and '--compilation-config' not in output
    assert override_refusal(tmp_path, {'vllm_kimi_extra_args': extra_args[:3]}) is None


def test_extra_arguments_that_hand_clients_more_are_refused(tmp_path):
    output = override_refusal(
        tmp_path,
        {
            'vllm_kimi_extra_args': [
                '--allowed-local',
                '/',
                '--trust-request-chat-template',
                '--enable_prompt_embeds',
                '--config',
                'x.yaml',
                '--API_KEY=sk-sneaky',
                '--model=/srv/other',
            ]
        },
    )
    assert refused_by(output) == 'Refuse extra arguments that undo what the role keeps from clients', output
    for flag in (
        '--allowed-local-media-path',
        '--trust-request-chat-template',
        '--enable-prompt-embeds',
        '--config',
        '--api-key',
        '--model',
    ):
        assert 'vllm_kimi_extra_args passes %s:' % flag in output, output
    assert 'vLLM would read options from that file before the command line, none of them checked here' in output
    assert 'sk-sneaky' not in output


@pytest.mark.parametrize(
    'environment, refused_at',
    [
        pytest.param(
            {'NCCL_PROTO': 'LL', 'X\nLD_PRELOAD': '/tmp/x.so'},
            'name 2 (counted from 1 as given): character 2 is "\\n"',
            id='newline',
        ),
        pytest.param({'nccl_proto': 'LL'}, 'name 1 (counted from 1 as given): character 1 is "n"', id='lower-case'),
        pytest.param({'1X': '1'}, 'name 1 (counted from 1 as given): character 1 is "1"', id='digit-first'),
        pytest.param({'A=B': '1'}, 'name 1 (counted from 1 as given): character 2 is "="', id='equals'),
        pytest.param({'': '1'}, 'name 1 (counted from 1 as given): it is empty', id='empty'),
        pytest.param({'NCCL_PROTO': 'LL', '_X1': '1'}, None, id='names'),
    ],
)
def test_environment_names_that_are_no_variables_name_are_refused_by_position(tmp_path, environment, refused_at):
    output = override_refusal(tmp_path, {'vllm_kimi_environment': environment})
    if refused_at is None:
        assert output is None, output
        return
    assert refused_by(output) == "Refuse environment names that are no variable's name", output
    assert "vllm_kimi_environment's names must match ^[A-Z_][A-Z0-9_]*$" in output and refused_at in output, output
    assert 'LD_PRELOAD' not in output and '/tmp/x.so' not in output


def test_environment_that_would_override_the_roles_own_or_reach_root_is_refused(tmp_path):
    output = override_refusal(
        tmp_path,
        {
            'vllm_kimi_environment': {
                'LD_PRELOAD': '/tmp/x.so',
                'VLLM_API_KEY': 'sk-sneaky',
                'NCCL_PROTO': 'LL',
                'PATH': '/home/x/bin:/usr/bin',
                'CUDA_HOME': '/opt/cuda',
            }
        },
    )
    assert 'vllm_kimi_environment sets VLLM_API_KEY, which the role sets from vllm_kimi_api_key' in output, output
    # The release's bin/ leads the unit's PATH, the toolkit's follows: vllm_kimi_cuda_home names the toolkit.
    assert 'vllm_kimi_environment sets PATH, which the role sets from vllm_kimi_cuda_home' in output
    assert 'vllm_kimi_environment sets CUDA_HOME, which the role sets from vllm_kimi_cuda_home' in output
    assert (
        'vllm_kimi_environment sets LD_PRELOAD, which the dynamic loader reads in every command of the unit' in output
    )
    assert 'NCCL_PROTO' not in output and 'sk-sneaky' not in output


def test_environment_that_would_move_home_or_a_cache_out_of_the_run_is_refused(tmp_path):
    """vLLM loads its caches as code: a cache moved where it outlives a run would carry a compromise into the next."""
    output = override_refusal(
        tmp_path,
        {'vllm_kimi_environment': {'TRITON_CACHE_DIR': '/var/lib/kept', 'HOME': '/srv/home', 'NCCL_PROTO': 'LL'}},
    )
    assert (
        "vllm_kimi_environment sets HOME, TRITON_CACHE_DIR: the service's HOME and caches stay in its runtime" in output
    )
    assert 'NCCL_PROTO' not in output


def cluster_refusal(tmp_path, head_host, worker_address):
    """The exposure refusal on the head of a two-node model: this host (ansible_host head_host, no cluster address)
    and node-b (vllm_kimi_cluster_address worker_address)."""
    nodes = [
        {'ansible.builtin.add_host': {'name': 'localhost', 'groups': 'kimi', 'ansible_host': head_host}},
        {'ansible.builtin.add_host': {'name': 'node-b', 'groups': 'kimi', 'vllm_kimi_cluster_address': worker_address}},
    ]
    rc, output = run_local_play(
        tmp_path,
        nodes + LOAD_VLLM_KIMI_VARS + preflight_refusal(),
        {'vllm_kimi_cluster_group': 'kimi', 'vllm_kimi_api_key': KEY},
    )
    return None if rc == 0 else output


def test_the_nodes_of_a_model_are_let_through_the_fence_by_ip_address(tmp_path):
    """The fence allows each node's own address, not its network: a name cannot be one of IPAddressAllow's."""
    output = cluster_refusal(tmp_path, 'head.example', 'b.example')
    assert refused_by(output) == 'Refuse cluster nodes the fence cannot let through by address', output
    assert "The nodes of vllm_kimi_cluster_group kimi are let through the unit's IP fence by address" in output, output
    assert 'and head.example, b.example is no IP address' in output
    assert cluster_refusal(tmp_path, '10.0.0.1', '10.0.0.2') is None
    assert cluster_refusal(tmp_path, '10.0.0.1', 'fd00::2') is None


def test_a_buffer_space_that_is_no_size_is_refused_by_name(tmp_path):
    # A comma would carry more mount options into the front door's TemporaryFileSystem=, a line break more settings.
    output = refusal(tmp_path, {'vllm_kimi_api_key': KEY, 'vllm_kimi_front_buffer_space': '1g,exec\nUser=root'})
    assert 'vllm_kimi_front_buffer_space must be a size in bytes, k, m or g (512m, 1g), got "1g,exec\\nUser=root".' in (
        output
    ), output
    assert refusal(tmp_path, {'vllm_kimi_api_key': KEY, 'vllm_kimi_front_buffer_space': '512M'}) is None


def test_client_keys_are_refused_by_position_without_showing_them(tmp_path):
    output = refusal(tmp_path, {'vllm_kimi_api_key': KEY, 'vllm_kimi_front_client_keys': [CLIENT_KEY, 'ck bad', '']})
    assert 'vllm_kimi_front_client_keys must be a list of keys of letters, digits and punctuation only' in output
    assert 'the entries counted from 1 that are not: 2, 3.' in output and 'ck bad' not in output, output
    output = refusal(
        tmp_path, {'vllm_kimi_front_client_keys': [CLIENT_KEY], 'vllm_kimi_allow_anonymous_endpoint': True}
    )
    assert 'which hands vLLM its own key for them: set vllm_kimi_api_key as well' in output, output
    assert 'ck-good' not in output
    assert refusal(tmp_path, {'vllm_kimi_api_key': KEY, 'vllm_kimi_front_client_keys': [CLIENT_KEY]}) is None


# Each exposure refusal: (settings it refuses, a part of its message, settings beside them that it lets through).
WITH_KEY = {'vllm_kimi_api_key': KEY}
EACH_REFUSAL = {
    "Refuse vLLM's switches that let any caller run code in the served model": (
        dict(WITH_KEY, vllm_kimi_environment={'VLLM_SERVER_DEV_MODE': '1'}),
        'vllm_kimi_environment sets VLLM_SERVER_DEV_MODE, which lets any caller run code in or change the served model',
        {'vllm_kimi_allow_dev_endpoints': True},
    ),
    'Refuse vLLM on an address other than loopback behind the front door': (
        dict(WITH_KEY, vllm_kimi_listen='tcp', vllm_kimi_host='0.0.0.0'),
        'vllm_kimi_host 0.0.0.0 is not a loopback address: behind the front door',
        {'vllm_kimi_host': '::1'},
    ),
    "Refuse a front door on vLLM's own port": (
        dict(WITH_KEY, vllm_kimi_listen='tcp', vllm_kimi_front_port=8000, vllm_kimi_port=8000),
        "vllm_kimi_front_port 8000 is vLLM's own port (vllm_kimi_port): give the front door another.",
        {'vllm_kimi_port': 8001},
    ),
    'Refuse a Unix socket that nothing would reach': (
        {'vllm_kimi_front_door': False},
        'vllm_kimi_listen unix serves vLLM on a Unix socket that only the front door reaches',
        {'vllm_kimi_listen': 'tcp'},
    ),
    'Refuse front door paths that are not plain absolute paths': (
        dict(WITH_KEY, vllm_kimi_front_paths=['/v1/models', '/v1/*', 'v1/chat']),
        'vllm_kimi_front_paths must be absolute paths of letters, digits and ._/-, got ["/v1/*", "v1/chat"].',
        {'vllm_kimi_front_paths': ['/v1/models', '/v1/chat/completions']},
    ),
    'Refuse a buffer space that is no size': (
        dict(WITH_KEY, vllm_kimi_front_buffer_space='1g,exec'),
        'vllm_kimi_front_buffer_space must be a size in bytes, k, m or g (512m, 1g), got "1g,exec".',
        {'vllm_kimi_front_buffer_space': '2G'},
    ),
    'Refuse /metrics among the paths every client reaches': (
        dict(WITH_KEY, vllm_kimi_front_paths=['/v1/chat/completions', '/metrics']),
        'vllm_kimi_front_paths lists /metrics, which the front door serves to vllm_kimi_front_metrics_sources only.',
        {'vllm_kimi_front_paths': ['/v1/chat/completions']},
    ),
    'Refuse a service other hosts reach without a key': (
        {},
        OPEN % '0.0.0.0:8443',
        {'vllm_kimi_api_key': KEY},
    ),
    'Refuse a key clients cannot send': (
        {'vllm_kimi_api_key': 'sk key'},
        KEY_REFUSED,
        {'vllm_kimi_api_key': KEY},
    ),
    'Refuse a key shorter than 32 characters': (
        {'vllm_kimi_api_key': 'k'},
        'vllm_kimi_api_key is shorter than 32 characters, short enough to be guessed',
        {'vllm_kimi_api_key': KEY},
    ),
    'Refuse client keys shorter than 32 characters, by position': (
        dict(WITH_KEY, vllm_kimi_front_client_keys=[CLIENT_KEY, KEY[:31], 'c']),
        'the entries counted from 1 that are shorter: 2, 3.',
        {'vllm_kimi_front_client_keys': [CLIENT_KEY]},
    ),
    'Refuse front door paths that vLLM serves on its TCP port without the key': (
        dict(
            WITH_KEY,
            vllm_kimi_listen='tcp',
            vllm_kimi_front_paths=['/v1/models', '/invocations', '/health', '/tokenize'],
        ),
        'vllm_kimi_front_paths lists /invocations, /tokenize, which vLLM serves on its TCP port without checking the key'
        ' (its --api-key guards only paths under /v1, /v2, /inference and /cohere), so any user of this host could'
        ' call it at 127.0.0.1:8000: set vllm_kimi_listen to unix',
        {'vllm_kimi_listen': 'unix'},
    ),
    'Refuse more completion prompts than sequences a request may make': (
        dict(WITH_KEY, vllm_kimi_max_completion_prompts=16),
        'vllm_kimi_max_completion_prompts 16 must be 1 or more and at most vllm_kimi_max_n_sequences (8)',
        {'vllm_kimi_max_n_sequences': 16},
    ),
    'Refuse client keys clients cannot send, by position': (
        dict(WITH_KEY, vllm_kimi_front_client_keys=['ck bad' + KEY]),
        'the entries counted from 1 that are not: 1.',
        {'vllm_kimi_front_client_keys': [CLIENT_KEY]},
    ),
    "Refuse client keys without vLLM's key and the front door": (
        {'vllm_kimi_front_client_keys': [CLIENT_KEY], 'vllm_kimi_allow_anonymous_endpoint': True},
        'which hands vLLM its own key for them: set vllm_kimi_api_key as well',
        {'vllm_kimi_api_key': KEY},
    ),
    'Refuse a Hub token sent in clear text': (
        dict(WITH_KEY, vllm_kimi_hf_endpoint='http://hub.example', vllm_kimi_hf_token='hf_t0ken'),
        CLEAR_TOKEN % 'http://hub.example',
        {'vllm_kimi_hf_endpoint': 'https://hub.example'},
    ),
}


def test_each_exposure_refusal_has_its_case():
    # The cluster's refusal needs an inventory of nodes: test_the_nodes_of_a_model_are_let_through_the_fence_by_ip_address.
    cluster = 'Refuse cluster nodes the fence cannot let through by address'
    assert sorted([*EACH_REFUSAL, cluster]) == sorted(EXPOSURE_ASSERTS)


@pytest.mark.parametrize('name', sorted(EACH_REFUSAL))
def test_each_exposure_refusal_stops_the_play_with_its_own_message(tmp_path, name):
    refused, message, mended = EACH_REFUSAL[name]
    output = refusal(tmp_path, refused)
    assert refused_by(output) == name and message in output, output
    assert refusal(tmp_path, dict(refused, **mended)) is None
