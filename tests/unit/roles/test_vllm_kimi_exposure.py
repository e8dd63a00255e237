# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The preflight's refusal of a service other hosts reach without a key (tasks/preflight.yml, vars/main.yml), run by
Ansible on the role's defaults and the settings of each case, and the gpu inventory's key from Ansible Vault.

Each case is added with case() when the module loads. The cases that the same tasks judge run together, a host each
in one ansible-playbook (support.run_local_plays), when a test first asks for one of them: an ansible-playbook for each
case cost this file over twice the CPU time. A case that two tests share runs once."""

import glob
import json
import os

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import (
    LOAD_VLLM_KIMI_VARS,
    REPO,
    VLLM_KIMI,
    Case,
    run_local_plays,
)

GPU_VARS = os.path.join(REPO, 'inventories', 'gpu', 'group_vars', 'vllm.yml')
REFUSAL_TASK = 'Refuse settings that open the service beyond its front door'
LIST_REFUSAL_TASK = 'Refuse list settings given as text'
OVERRIDE_TASK = "Refuse extra arguments and environment that would undo the role's own settings"
# 32 characters: the shortest key the preflight takes.
KEY = 'sk-t3st-key-0123456789abcdef0123'
CLIENT_KEY = 'ck-good-0123456789abcdef012345678'


def preflight_tasks(name):
    """The preflight's top-level tasks of that name (a block of refusals, or a refusal)."""
    with open(os.path.join(VLLM_KIMI, 'tasks', 'preflight.yml')) as handle:
        return [task for task in yaml.safe_load(handle) if task.get('name') == name]


def preflight_refusal():
    """The preflight's block of exposure refusals, one assert each."""
    return preflight_tasks(REFUSAL_TASK)


EXPOSURE_ASSERTS = [task['name'] for task in preflight_refusal()[0]['block']]

# What judges a case, after the role's defaults and variables: the exposure refusals, the refusal of list settings
# given as text, or the refusals of extra arguments and environment that would undo the role's own settings.
EXPOSURE, LISTS, OVERRIDES = 'exposure', 'lists', 'overrides'
JUDGES = {EXPOSURE: REFUSAL_TASK, LISTS: LIST_REFUSAL_TASK, OVERRIDES: OVERRIDE_TASK}
# The cases added with case(), by what judges them: {case name: Case}.
CASES: dict[str, dict[str, Case]] = {judge: {} for judge in JUDGES}
# The hosts beside the cases' in the exposure refusals' run: the other node of each two-node model (cluster_case).
CLUSTER_NODES: dict[str, dict] = {}


def case_name(judge, settings, more_vars=(), groups=()):
    """A case's name: what it is, so that the same case added twice is one case."""
    return json.dumps([judge, [str(path) for path in more_vars], list(groups), settings], sort_keys=True)


def case(judge, settings, more_vars=(), groups=()):
    """Add a case for judge's tasks, to run when a test first asks for one of them, and return its name: settings as
    -e gives them, over the role's variables and more_vars's files (an inventory's group_vars); its host joins groups
    (CLUSTER_NODES's)."""
    name = case_name(judge, settings, more_vars, groups)
    CASES[judge][name] = Case(settings, more_vars, groups)
    return name


class Outcomes:
    """How the cases ended (support.CaseOutcome), by name: the cases of a judge run together when a test first asks
    for one of them."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.ended = {}

    def __getitem__(self, name):
        judges = [judge for judge, cases in CASES.items() if name in cases]
        assert judges, 'no case() added %s when the module loaded' % name
        judge = judges[0]
        if judge not in self.ended:
            self.ended[judge] = run_local_plays(
                self.tmp_path_factory.mktemp(judge),
                [(LOAD_VLLM_KIMI_VARS + preflight_tasks(JUDGES[judge]), CASES[judge])],
                inventory=CLUSTER_NODES if judge == EXPOSURE else None,
            )
        return self.ended[judge][name]


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory):
    return Outcomes(tmp_path_factory)


def refusal(outcome):
    """The outcome of a case the exposure refusals refused, or None where they let it through."""
    if outcome.failed_task is None:
        return None
    assert outcome.failed_task in EXPOSURE_ASSERTS, outcome
    return outcome


def list_refusal(outcome):
    """The outcome of a case the refusal of list settings given as text refused, or None where it lets it through."""
    return None if outcome.failed_task is None else outcome


def override_refusal(outcome):
    """The outcome of a case the override refusals refused, or None where they let it through."""
    return None if outcome.failed_task is None else outcome


OPEN = 'The service answers anyone who reaches %s without a key: set vllm_kimi_api_key'


@pytest.mark.parametrize(
    'name, refused_at',
    [
        pytest.param(case(EXPOSURE, {}), '0.0.0.0:8443', id='defaults-front-door-on-every-address'),
        pytest.param(
            case(EXPOSURE, {'vllm_kimi_front_address': '10.0.0.5'}), '10.0.0.5:8443', id='front-door-on-a-lan-address'
        ),
        pytest.param(
            case(EXPOSURE, {'vllm_kimi_front_address': '::'}), ':::8443', id='front-door-on-every-ipv6-address'
        ),
        pytest.param(case(EXPOSURE, {'vllm_kimi_api_key': KEY}), None, id='with-a-key'),
        pytest.param(case(EXPOSURE, {'vllm_kimi_allow_anonymous_endpoint': True}), None, id='open-endpoint-accepted'),
        pytest.param(case(EXPOSURE, {'vllm_kimi_front_address': '127.0.0.1'}), None, id='front-door-on-loopback'),
        pytest.param(
            case(EXPOSURE, {'vllm_kimi_front_address': '127.0.1.1'}), None, id='front-door-on-another-loopback-address'
        ),
        pytest.param(
            case(EXPOSURE, {'vllm_kimi_front_door': False, 'vllm_kimi_listen': 'tcp'}),
            None,
            id='no-front-door-vllm-on-loopback',
        ),
        pytest.param(
            case(EXPOSURE, {'vllm_kimi_front_door': False, 'vllm_kimi_listen': 'tcp', 'vllm_kimi_host': '0.0.0.0'}),
            '0.0.0.0:8000',
            id='no-front-door-vllm-open',
        ),
    ],
)
def test_a_service_other_hosts_reach_needs_a_key(outcomes, name, refused_at):
    output = refusal(outcomes[name])
    if refused_at is None:
        assert output is None
    else:
        assert OPEN % refused_at in output.message, output
        assert 'or set vllm_kimi_allow_anonymous_endpoint to serve an open endpoint.' in output.message


VAULT_KEY = case(EXPOSURE, {'vault_vllm_kimi_api_key': KEY}, [GPU_VARS])
NO_VAULT_KEY = case(EXPOSURE, {}, [GPU_VARS])
EMPTY_VAULT_KEY = case(EXPOSURE, {'vault_vllm_kimi_api_key': ''}, [GPU_VARS])


def test_the_gpu_inventory_takes_its_key_from_the_vault_and_stops_without_it(outcomes):
    assert refusal(outcomes[VAULT_KEY]) is None
    output = refusal(outcomes[NO_VAULT_KEY])
    assert "'vault_vllm_kimi_api_key' is undefined" in output.message, output
    # A vault that holds an empty key is the open endpoint, refused as such.
    assert OPEN % '0.0.0.0:8443' in refusal(outcomes[EMPTY_VAULT_KEY]).message


KEY_REFUSED = 'vllm_kimi_api_key holds a space, a control character or a character beyond ASCII'


@pytest.mark.parametrize(
    'name, refused',
    [
        pytest.param(
            case(EXPOSURE, {'vllm_kimi_api_key': 'sk-A1_b2.c3~d4+e5/f6=g7!h8#i9@j0%k'}), False, id='token-punctuation'
        ),
        pytest.param(case(EXPOSURE, {'vllm_kimi_api_key': 'sk-key\nreturn 200;'}), True, id='newline'),
        pytest.param(case(EXPOSURE, {'vllm_kimi_api_key': 'sk key'}), True, id='space'),
        pytest.param(case(EXPOSURE, {'vllm_kimi_api_key': 'sk-\u00e9t\u00e9'}), True, id='beyond-ascii'),
    ],
)
def test_a_key_clients_cannot_send_is_refused_without_showing_it(outcomes, name, refused):
    output = refusal(outcomes[name])
    if not refused:
        assert output is None
        return
    assert KEY_REFUSED in output.message, output
    assert 'sk-' not in output.shown, output


CLEAR_TOKEN = 'vllm_kimi_hf_token would travel in clear text to vllm_kimi_hf_endpoint %s: use its https:// address'


def hub_token(endpoint, token, refused, test_id):
    """A case of test_a_hub_token_never_travels_in_clear_text: the token sent to the endpoint, with a key."""
    settings = {'vllm_kimi_api_key': KEY, 'vllm_kimi_hf_endpoint': endpoint, 'vllm_kimi_hf_token': token}
    return pytest.param(case(EXPOSURE, settings), endpoint, token, refused, id=test_id)


@pytest.mark.parametrize(
    'name, endpoint, token, refused',
    [
        hub_token('http://hub.example:8080', 'hf_t0ken', True, test_id='http-to-another-host'),
        hub_token('HTTP://10.0.0.7', 'hf_t0ken', True, test_id='http-upper-case-to-a-lan-address'),
        hub_token('https://hub.example', 'hf_t0ken', False, test_id='https'),
        hub_token('http://127.0.0.1:8090', 'hf_t0ken', False, test_id='http-on-loopback'),
        hub_token('http://[::1]:8090', 'hf_t0ken', False, test_id='http-on-ipv6-loopback'),
        hub_token('http://hub.example:8080', '', False, test_id='http-without-a-token'),
        hub_token('', 'hf_t0ken', False, test_id='the-default-hub'),
    ],
)
def test_a_hub_token_never_travels_in_clear_text(outcomes, name, endpoint, token, refused):
    output = refusal(outcomes[name])
    if refused:
        assert CLEAR_TOKEN % endpoint in output.message, output
        assert token not in output.shown
    else:
        assert output is None, output


def test_the_list_settings_are_the_argument_specs_lists():
    with open(os.path.join(VLLM_KIMI, 'meta', 'argument_specs.yml')) as handle:
        options = yaml.safe_load(handle)['argument_specs']['main']['options']
    with open(os.path.join(VLLM_KIMI, 'vars', 'main.yml')) as handle:
        listed = yaml.safe_load(handle)['_vllm_kimi_list_settings']
    assert listed == sorted(name for name, option in options.items() if option.get('type') == 'list')


# What `-e vllm_kimi_extra_args=--enforce-eager` gives: a text, which the argument spec's check lets through.
EXTRA_ARGS_AS_TEXT = case(LISTS, {'vllm_kimi_extra_args': '--enforce-eager'})
TWO_LISTS_AS_TEXT = case(LISTS, {'vllm_kimi_extra_args': '--enforce-eager', 'vllm_kimi_entrypoint': 'bin/vllm'})
EXTRA_ARGS_AS_A_LIST = case(LISTS, {'vllm_kimi_extra_args': ['--enforce-eager']})


def test_a_list_setting_given_as_text_is_refused_by_name(outcomes):
    output = list_refusal(outcomes[EXTRA_ARGS_AS_TEXT])
    assert 'vllm_kimi_extra_args must be a list, not a text' in output.message, output
    both = list_refusal(outcomes[TWO_LISTS_AS_TEXT])
    assert 'vllm_kimi_entrypoint, vllm_kimi_extra_args must be lists, not a text' in both.message, both
    assert list_refusal(outcomes[EXTRA_ARGS_AS_A_LIST]) is None


UNIX_SOCKET_WITHOUT_FRONT_DOOR = case(EXPOSURE, {'vllm_kimi_front_door': False})
TCP_WITHOUT_FRONT_DOOR = case(EXPOSURE, {'vllm_kimi_front_door': False, 'vllm_kimi_listen': 'tcp'})


def test_a_unix_socket_without_the_front_door_is_refused(outcomes):
    """Only the front door's workers may connect to vLLM's Unix socket: without the front door nothing would."""
    output = refusal(outcomes[UNIX_SOCKET_WITHOUT_FRONT_DOOR])
    assert 'vllm_kimi_listen unix serves vLLM on a Unix socket that only the front door reaches' in output.message, (
        output
    )
    assert 'set vllm_kimi_listen: tcp' in output.message
    assert refusal(outcomes[TCP_WITHOUT_FRONT_DOOR]) is None


INVENTORIES = sorted(glob.glob(os.path.join(REPO, 'inventories', '*', 'group_vars', 'vllm.yml')))
# Each inventory with its key from the vault, as the override refusals and the exposure refusals judge it.
INVENTORY_CASES = {
    inventory: (
        case(OVERRIDES, {'vault_vllm_kimi_api_key': KEY}, [inventory]),
        case(EXPOSURE, {'vault_vllm_kimi_api_key': KEY}, [inventory]),
    )
    for inventory in INVENTORIES
}


@pytest.mark.parametrize('inventory', INVENTORIES, ids=lambda path: path.split(os.sep)[-3])
def test_the_inventories_override_nothing_of_the_roles_and_open_nothing(outcomes, inventory):
    assert len(INVENTORIES) >= 3
    overrides, exposure = INVENTORY_CASES[inventory]
    assert override_refusal(outcomes[overrides]) is None
    assert refusal(outcomes[exposure]) is None


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
# Options the role does not render, then every option of OTHER_VARIANTS_OPTIONS.
UNRENDERED_OPTIONS = ['--enforce-eager', '--compilation-config', '{"custom_ops": ["all"]}']
EVERY_VARIANTS_OPTIONS = case(
    OVERRIDES,
    {'vllm_kimi_extra_args': UNRENDERED_OPTIONS + [word for words, _flag in OTHER_VARIANTS_OPTIONS for word in words]},
)
SHUTDOWN_TIMEOUT_OPTION = case(OVERRIDES, {'vllm_kimi_extra_args': ['--shutdown_timeout=5']})
ONLY_UNRENDERED_OPTIONS = case(OVERRIDES, {'vllm_kimi_extra_args': UNRENDERED_OPTIONS})


def test_every_option_the_role_renders_in_any_variant_is_refused_in_the_extra_arguments(outcomes):
    """vLLM keeps an option's last value, and the extra arguments come last: the options refused are read off the
    role's own command line in each of its variants, never listed by hand."""
    output = override_refusal(outcomes[EVERY_VARIANTS_OPTIONS])
    assert output.failed_task == 'Refuse extra arguments that set an option the role renders', output
    for _words, flag in OTHER_VARIANTS_OPTIONS:
        assert 'vllm_kimi_extra_args sets %s, which the role renders. ' % flag in output.message, (flag, output)
    # An option of _vllm_kimi_serve_flags names its variable.
    output = override_refusal(outcomes[SHUTDOWN_TIMEOUT_OPTION])
    assert 'vllm_kimi_extra_args sets --shutdown-timeout, which the role renders from vllm_kimi_shutdown_timeout. ' in (
        output.message
    ), output
    assert "vLLM keeps an option's last value, so the extra argument would override the role's silently" in (
        output.message
    )
    assert '--enforce-eager' not in output.shown and '--compilation-config' not in output.shown
    assert override_refusal(outcomes[ONLY_UNRENDERED_OPTIONS]) is None


OPTIONS_THAT_HAND_CLIENTS_MORE = case(
    OVERRIDES,
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


def test_extra_arguments_that_hand_clients_more_are_refused(outcomes):
    output = override_refusal(outcomes[OPTIONS_THAT_HAND_CLIENTS_MORE])
    assert output.failed_task == 'Refuse extra arguments that undo what the role keeps from clients', output
    for flag in (
        '--allowed-local-media-path',
        '--trust-request-chat-template',
        '--enable-prompt-embeds',
        '--config',
        '--api-key',
        '--model',
    ):
        assert 'vllm_kimi_extra_args passes %s:' % flag in output.message, output
    assert 'vLLM would read options from that file before the command line, none of them checked here' in (
        output.message
    )
    assert 'sk-sneaky' not in output.shown


def environment(variables):
    """The case of vllm_kimi_environment holding these variables, as the override refusals judge it."""
    return case(OVERRIDES, {'vllm_kimi_environment': variables})


@pytest.mark.parametrize(
    'name, refused_at',
    [
        pytest.param(
            environment({'NCCL_PROTO': 'LL', 'X\nLD_PRELOAD': '/tmp/x.so'}),
            'name 2 (counted from 1 as given): character 2 is "\\n"',
            id='newline',
        ),
        pytest.param(
            environment({'nccl_proto': 'LL'}), 'name 1 (counted from 1 as given): character 1 is "n"', id='lower-case'
        ),
        pytest.param(
            environment({'1X': '1'}), 'name 1 (counted from 1 as given): character 1 is "1"', id='digit-first'
        ),
        pytest.param(environment({'A=B': '1'}), 'name 1 (counted from 1 as given): character 2 is "="', id='equals'),
        pytest.param(environment({'': '1'}), 'name 1 (counted from 1 as given): it is empty', id='empty'),
        pytest.param(environment({'NCCL_PROTO': 'LL', '_X1': '1'}), None, id='names'),
    ],
)
def test_environment_names_that_are_no_variables_name_are_refused_by_position(outcomes, name, refused_at):
    output = override_refusal(outcomes[name])
    if refused_at is None:
        assert output is None, output
        return
    assert output.failed_task == "Refuse environment names that are no variable's name", output
    assert "vllm_kimi_environment's names must match ^[A-Z_][A-Z0-9_]*$" in output.message, output
    assert refused_at in output.message, output
    assert 'LD_PRELOAD' not in output.shown and '/tmp/x.so' not in output.shown


ROLES_OWN_ENVIRONMENT = environment(
    {
        'LD_PRELOAD': '/tmp/x.so',
        'VLLM_API_KEY': 'sk-sneaky',
        'NCCL_PROTO': 'LL',
        'PATH': '/home/x/bin:/usr/bin',
        'CUDA_HOME': '/opt/cuda',
    }
)


def test_environment_that_would_override_the_roles_own_or_reach_root_is_refused(outcomes):
    output = override_refusal(outcomes[ROLES_OWN_ENVIRONMENT])
    assert 'vllm_kimi_environment sets VLLM_API_KEY, which the role sets from vllm_kimi_api_key' in output.message, (
        output
    )
    # The release's bin/ leads the unit's PATH, the toolkit's follows: vllm_kimi_cuda_home names the toolkit.
    assert 'vllm_kimi_environment sets PATH, which the role sets from vllm_kimi_cuda_home' in output.message
    assert 'vllm_kimi_environment sets CUDA_HOME, which the role sets from vllm_kimi_cuda_home' in output.message
    assert (
        'vllm_kimi_environment sets LD_PRELOAD, which the dynamic loader reads in every command of the unit'
        in output.message
    )
    assert 'NCCL_PROTO' not in output.shown and 'sk-sneaky' not in output.shown


HOME_AND_CACHE_MOVED = environment({'TRITON_CACHE_DIR': '/var/lib/kept', 'HOME': '/srv/home', 'NCCL_PROTO': 'LL'})


def test_environment_that_would_move_home_or_a_cache_out_of_the_run_is_refused(outcomes):
    """vLLM loads its caches as code: a cache moved where it outlives a run would carry a compromise into the next."""
    output = override_refusal(outcomes[HOME_AND_CACHE_MOVED])
    assert (
        "vllm_kimi_environment sets HOME, TRITON_CACHE_DIR: the service's HOME and caches stay in its runtime"
        in output.message
    )
    assert 'NCCL_PROTO' not in output.shown


def cluster_case(group, head_host, worker_address):
    """The exposure refusals on the head of a two-node model, in group (vllm_kimi_cluster_group): the case's host
    (ansible_host head_host, no cluster address) and GROUP_node_b (vllm_kimi_cluster_address worker_address)."""
    CLUSTER_NODES[group] = {group + '_node_b': {'vllm_kimi_cluster_address': worker_address}}
    settings = {'vllm_kimi_cluster_group': group, 'vllm_kimi_api_key': KEY, 'ansible_host': head_host}
    return case(EXPOSURE, settings, groups=[group])


NODES_BY_NAME = cluster_case('kimi', 'head.example', 'b.example')
NODES_BY_IPV4_ADDRESS = cluster_case('kimi_ipv4', '10.0.0.1', '10.0.0.2')
NODES_BY_IPV4_AND_IPV6_ADDRESS = cluster_case('kimi_ipv6', '10.0.0.1', 'fd00::2')


def test_the_nodes_of_a_model_are_let_through_the_fence_by_ip_address(outcomes):
    """The fence allows each node's own address, not its network: a name cannot be one of IPAddressAllow's."""
    output = refusal(outcomes[NODES_BY_NAME])
    assert output.failed_task == 'Refuse cluster nodes the fence cannot let through by address', output
    assert "The nodes of vllm_kimi_cluster_group kimi are let through the unit's IP fence by address" in (
        output.message
    ), output
    assert 'and head.example, b.example is no IP address' in output.message
    assert refusal(outcomes[NODES_BY_IPV4_ADDRESS]) is None
    assert refusal(outcomes[NODES_BY_IPV4_AND_IPV6_ADDRESS]) is None


# A comma would carry more mount options into the front door's TemporaryFileSystem=, a line break more settings.
BUFFER_SPACE_WITH_MORE = case(
    EXPOSURE, {'vllm_kimi_api_key': KEY, 'vllm_kimi_front_buffer_space': '1g,exec\nUser=root'}
)
BUFFER_SPACE_OF_A_SIZE = case(EXPOSURE, {'vllm_kimi_api_key': KEY, 'vllm_kimi_front_buffer_space': '512M'})


def test_a_buffer_space_that_is_no_size_is_refused_by_name(outcomes):
    output = refusal(outcomes[BUFFER_SPACE_WITH_MORE])
    assert 'vllm_kimi_front_buffer_space must be a size in bytes, k, m or g (512m, 1g), got "1g,exec\\nUser=root".' in (
        output.message
    ), output
    assert refusal(outcomes[BUFFER_SPACE_OF_A_SIZE]) is None


CLIENT_KEYS_TWO_BAD = case(
    EXPOSURE, {'vllm_kimi_api_key': KEY, 'vllm_kimi_front_client_keys': [CLIENT_KEY, 'ck bad', '']}
)
CLIENT_KEYS_WITHOUT_VLLMS_KEY = case(
    EXPOSURE, {'vllm_kimi_front_client_keys': [CLIENT_KEY], 'vllm_kimi_allow_anonymous_endpoint': True}
)
CLIENT_KEYS_WITH_VLLMS_KEY = case(EXPOSURE, {'vllm_kimi_api_key': KEY, 'vllm_kimi_front_client_keys': [CLIENT_KEY]})


def test_client_keys_are_refused_by_position_without_showing_them(outcomes):
    output = refusal(outcomes[CLIENT_KEYS_TWO_BAD])
    assert 'vllm_kimi_front_client_keys must be a list of keys of letters, digits and punctuation only' in (
        output.message
    )
    assert 'the entries counted from 1 that are not: 2, 3.' in output.message and 'ck bad' not in output.shown, output
    output = refusal(outcomes[CLIENT_KEYS_WITHOUT_VLLMS_KEY])
    assert 'which hands vLLM its own key for them: set vllm_kimi_api_key as well' in output.message, output
    assert 'ck-good' not in output.shown
    assert refusal(outcomes[CLIENT_KEYS_WITH_VLLMS_KEY]) is None


# Each exposure refusal: (settings it refuses, a part of its message, settings beside them that it lets through).
WITH_KEY = {'vllm_kimi_api_key': KEY}
EACH_REFUSAL: dict[str, tuple[dict, str, dict]] = {
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
# Each refusal's case, and its case with the settings that mend it.
EACH_REFUSAL_CASES = {
    name: (case(EXPOSURE, refused), case(EXPOSURE, dict(refused, **mended)))
    for name, (refused, _message, mended) in EACH_REFUSAL.items()
}


def test_each_exposure_refusal_has_its_case():
    # The cluster's refusal needs an inventory of nodes: test_the_nodes_of_a_model_are_let_through_the_fence_by_ip_address.
    cluster = 'Refuse cluster nodes the fence cannot let through by address'
    assert sorted([*EACH_REFUSAL, cluster]) == sorted(EXPOSURE_ASSERTS)


@pytest.mark.parametrize('name', sorted(EACH_REFUSAL))
def test_each_exposure_refusal_stops_the_play_with_its_own_message(outcomes, name):
    _refused, message, _mended = EACH_REFUSAL[name]
    refused_case, mended_case = EACH_REFUSAL_CASES[name]
    output = refusal(outcomes[refused_case])
    assert output.failed_task == name and message in output.message, output
    assert refusal(outcomes[mended_case]) is None
