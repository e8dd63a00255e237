# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The gpu inventory renders the unit the real Kimi-K2.5 deployment needs."""

import base64
import json
import os
import re
import shlex
import subprocess

import pytest
import yaml

from ansible_collections.llmserve.vllm.plugins.filter.vllm import pinned_version
from ansible_collections.llmserve.vllm.tests.support import Canary, unpack_render

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
PLAYBOOK = os.path.join(REPO, 'tests', 'integration', 'playbooks', 'render_unit.yml')
ANSIBLE_PLAYBOOK = os.path.join(REPO, '.venv', 'bin', 'ansible-playbook')
# The controller's own interpreter: discovery on this host may find a broken pyenv shim.
LOCAL_PYTHON = os.path.join(REPO, '.venv', 'bin', 'python')


def render(tmp_path, group_vars_file, **extra_vars):
    extra = {
        'out_dir': str(tmp_path),
        'group_vars_file': group_vars_file,
        'ansible_python_interpreter': LOCAL_PYTHON,
        'max_model_len': 131072,
    }
    if group_vars_file in (GPU_VARS, NVLINK_VARS):
        # What the preflight finds in Kimi-K2.5's config (use_unified_vision_chunk: tests/fixtures/checkpoints/
        # kimi-k2.5-nvfp4), which the render does not run, and the key the inventory reads from the vault.
        extra.update(__vllm_kimi_preflight={'unified_vision_chunk': True}, vault_vllm_kimi_api_key='sk-vault-key')
    extra.update(extra_vars)
    subprocess.run(
        [ANSIBLE_PLAYBOOK, '-i', 'localhost,', '-c', 'local', PLAYBOOK, '-e', json.dumps(extra)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    unpack_render(tmp_path)
    unit = (tmp_path / 'unit.service').read_text()
    environment = (tmp_path / 'environment').read_text()
    return unit, environment


def exec_start(unit):
    line = [line for line in unit.splitlines() if line.startswith('ExecStart=')]
    assert len(line) == 1
    return shlex.split(line[0][len('ExecStart=') :])


NVIDIA_MODPROBE = 'ExecStartPre=+-/usr/bin/nvidia-modprobe -u -c=0'
# vLLM's Unix socket (vllm_kimi_listen unix, the default): its directory is the front door workers' group's, made
# (owner and mode set again) and emptied at each start: nothing an earlier run left there is there.
SOCKET_DIRECTORY = [
    'ExecStartPre=+/usr/bin/install -d -o vllm -g vllm-kimi-api -m 2750 /run/vllm-kimi-api',
    'ExecStartPre=+/usr/bin/find /run/vllm-kimi-api -mindepth 1 -delete',
]
# And emptied at each stop, after the run's last process.
EMPTY_SOCKET_DIRECTORY = '+/usr/bin/find /run/vllm-kimi-api -mindepth 1 -delete'
# The seeding of the per-run HOME from the sealed caches, as the service user: one line, its store named by hashes.
SEED = 'ExecStartPre=<seed>'
SANDBOX_VARS = os.path.join(REPO, 'inventories', 'sandbox', 'group_vars', 'vllm.yml')
GPU_VARS = os.path.join(REPO, 'inventories', 'gpu', 'group_vars', 'vllm.yml')
NVLINK_VARS = os.path.join(REPO, 'inventories', 'nvlink', 'group_vars', 'vllm.yml')


def start_pre(unit):
    """The ExecStartPre= lines of a unit, the seeding of the sealed caches as SEED."""
    return [
        SEED if line.startswith('ExecStartPre="/bin/sh" "-c" ') and '"seed"' in line else line
        for line in unit.splitlines()
        if line.startswith('ExecStartPre=')
    ]


def unit_settings(unit, section):
    """The Name=value settings of one section of a unit, each name with the list of its values."""
    body = unit.split('[%s]' % section, 1)[1].split('\n[', 1)[0]
    settings = {}
    for line in body.splitlines():
        if line and not line.startswith('#') and '=' in line:
            name, value = line.split('=', 1)
            settings.setdefault(name, []).append(value)
    return settings


def starts_allowed(starts, interval, burst):
    """Which of these start times (seconds) systemd's start limit lets through: ratelimit_below() of
    src/basic/ratelimit.c, a window that opens at the first start it lets through and counts burst starts."""
    allowed, begin, count = [], None, 0
    for t in starts:
        if begin is None or t - begin > interval:
            begin, count = t, 1
            allowed.append(True)
            continue
        count += 1
        allowed.append(count <= burst)
    return allowed


@pytest.mark.parametrize(
    'group_vars, start_timeout, interval',
    [
        (GPU_VARS, 3600, 3 * (300 + 3600 + 240 + 10)),
        (SANDBOX_VARS, 600, 3 * (300 + 600 + 240 + 10)),
    ],
    ids=['gpu-an-hour', 'sandbox-600s'],
)
def test_the_start_limit_stops_a_crash_loop_after_full_loads(tmp_path, group_vars, start_timeout, interval):
    unit, environment = render(tmp_path, group_vars)
    head, service = unit_settings(unit, 'Unit'), unit_settings(unit, 'Service')
    assert 'VLLM_ENGINE_READY_TIMEOUT_S="%d"' % start_timeout in environment.splitlines()
    assert (head['StartLimitIntervalSec'], head['StartLimitBurst']) == ([str(interval)], ['3'])
    # The longest a crash loop's start can take: the ExecStartPre= commands (TimeoutStartSec; under Type=exec the
    # load is not part of the start job), vLLM's engine coming up (VLLM_ENGINE_READY_TIMEOUT_S), the stop of
    # what is left after the crash, and the restart delay.
    assert service['Type'] == ['exec']
    cycle = start_timeout + sum(int(service[name][0]) for name in ('TimeoutStartSec', 'TimeoutStopSec', 'RestartSec'))
    burst = int(head['StartLimitBurst'][0])
    # Each start crashes at the end of a full load; start burst + 1 is refused, and the loop stops by itself.
    starts = [k * cycle for k in range(burst + 1)]
    assert starts_allowed(starts, int(head['StartLimitIntervalSec'][0]), burst) == [True] * burst + [False]
    # Before the fix (1800 s), every start of the same loop went through.
    assert starts_allowed(starts, 1800, burst) == [True] * (burst + 1)


def test_gpu_unit_waits_for_the_nvidia_devices(gpu_unit):
    unit = gpu_unit[0]
    head, service = unit_settings(unit, 'Unit'), unit_settings(unit, 'Service')
    assert head['After'] == ['network-online.target', 'modprobe@nvidia_uvm.service nvidia-persistenced.service']
    assert head['Wants'] == ['network-online.target', 'modprobe@nvidia_uvm.service nvidia-persistenced.service']
    assert start_pre(unit) == SOCKET_DIRECTORY + [SEED, NVIDIA_MODPROBE]
    assert service['DeviceAllow'][-2:] == ['char-nvidia m', 'char-nvidia-uvm m']
    assert service['NoNewPrivileges'] == ['yes'] and service['CapabilityBoundingSet'] == ['']


def test_cpu_unit_waits_for_no_nvidia_device(tmp_path):
    unit = render(tmp_path, SANDBOX_VARS)[0]
    head, service = unit_settings(unit, 'Unit'), unit_settings(unit, 'Service')
    assert (head['After'], head['Wants']) == (['network-online.target'], ['network-online.target'])
    assert 'nvidia' not in unit
    assert start_pre(unit) == [
        'ExecStartPre=+/usr/bin/python3 -I /usr/local/libexec/llmserve-shm-clean --min-age 60',
        *SOCKET_DIRECTORY,
        SEED,
    ]
    assert 'DeviceAllow' not in service


# The gpu inventory's render, made once for the tests that only read it: each render is an ansible-playbook run of
# some seconds, and ten tests read the same one.
@pytest.fixture(scope='module')
def gpu_render(tmp_path_factory):
    out = tmp_path_factory.mktemp('gpu-render')
    return out, render(out, GPU_VARS, vllm_kimi_api_key='sk-$ecret%key')


@pytest.fixture
def gpu_unit(gpu_render):
    return gpu_render[1]


def test_gpu_inventory_serves_kimi_with_the_seed_flags(gpu_unit):
    unit = gpu_unit[0]
    argv = exec_start(unit)
    assert re.match(r'^/opt/vllm-kimi/[0-9a-f]{12}/bin/vllm$', argv[0]), argv[0]
    assert argv[1:] == [
        'serve',
        '/shared/kimi-k2.5-nvfp4',
        '--served-model-name',
        'kimi-k2.5',
        '--uds',
        '/run/vllm-kimi-api/vllm.sock',
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
        '{"vision_chunk": 8}',
        '--reasoning-parser',
        'kimi_k2',
        '--shutdown-timeout',
        '120',
        '--max-num-seqs',
        '64',
    ]
    assert '--disable-log-requests' not in unit


def pinned_release_options():
    """The long options `vllm serve` of the release the role pins accepts (tools/vllm_serve_options.py's fixture)."""
    with open(os.path.join(REPO, 'roles', 'vllm_kimi', 'defaults', 'main.yml')) as handle:
        spec = yaml.safe_load(handle)['vllm_kimi_package_spec']
    path = os.path.join(REPO, 'tests', 'fixtures', 'vllm_serve_options', pinned_version(spec) + '.txt')
    with open(path) as handle:
        return {line.strip() for line in handle if line.startswith('--')}


def test_the_pinned_release_parses_every_option_the_gpu_inventory_renders(gpu_unit):
    """Each long option of the rendered command line is one the pinned release's `vllm serve` defines; the canary,
    an option vLLM removed (--disable-log-requests), is not."""
    options = pinned_release_options()
    assert '--disable-log-requests' not in options
    rendered = [arg.split('=', 1)[0] for arg in exec_start(gpu_unit[0]) if arg.startswith('--')]
    assert len(rendered) >= 15
    assert [option for option in rendered if option not in options] == []


MEDIA_LIMITS = ['--allowed-media-domains', 'media.invalid', '--limit-mm-per-prompt', '{"vision_chunk": 8}']
# The role's _vllm_kimi_serve_flags, in their order.
SERVE_FLAGS = ['--reasoning-parser', 'kimi_k2', '--shutdown-timeout', '120', '--max-num-seqs', '64']


@pytest.mark.parametrize(
    ('mode', 'flags'),
    [
        ('encoder_tensor_parallel', ['--mm-encoder-tp-mode', 'weights'] + MEDIA_LIMITS + SERVE_FLAGS),
        # A language model alone takes no media: no per-prompt limit, and still no media host.
        ('text_only', ['--language-model-only', '--allowed-media-domains', 'media.invalid'] + SERVE_FLAGS),
        ('', MEDIA_LIMITS + SERVE_FLAGS),
    ],
    ids=['tensor-parallel', 'text-only', 'no-encoder'],
)
def test_multimodal_mode_picks_the_encoders_flags(tmp_path, mode, flags):
    argv = exec_start(render(tmp_path, GPU_VARS, vllm_kimi_multimodal=mode)[0])
    assert argv[argv.index('--trust-remote-code') + 1 :] == flags


def test_no_tool_parser_no_auto_tool_choice(tmp_path):
    unit = render(tmp_path, GPU_VARS, vllm_kimi_tool_call_parser='')[0]
    argv = exec_start(unit)
    assert '--enable-auto-tool-choice' not in argv and '--tool-call-parser' not in argv
    assert argv[argv.index('--reasoning-parser') + 1] == 'kimi_k2'


def test_each_venv_spec_has_a_release_of_its_own(tmp_path):
    group_vars = GPU_VARS
    programs = {}
    for spec in ('vllm==0.33.0', 'vllm==0.33.1', 'vllm==0.33.0'):
        out = tmp_path / str(len(programs)) / spec
        out.mkdir(parents=True)
        programs.setdefault(spec, set()).add(exec_start(render(out, group_vars, vllm_kimi_package_spec=spec)[0])[0])
    assert [len(paths) for paths in programs.values()] == [1, 1]
    assert programs['vllm==0.33.0'] != programs['vllm==0.33.1']


def test_an_absolute_entrypoint_is_kept_as_given(tmp_path):
    unit = render(
        tmp_path,
        GPU_VARS,
        vllm_kimi_entrypoint=['/usr/local/bin/vllm', 'serve'],
    )[0]
    assert exec_start(unit)[:2] == ['/usr/local/bin/vllm', 'serve']


def test_gpu_unit_runs_unprivileged_with_gpu_devices_and_a_private_shm(gpu_unit):
    unit = gpu_unit[0]
    lines = unit.splitlines()
    assert lines[0].startswith('#')
    for expected in (
        'User=vllm',
        'Group=vllm',
        'KillMode=mixed',
        'LimitCORE=0',
        'Restart=always',
        'TimeoutStartSec=300',
        'LimitNOFILE=1048576',
        'DevicePolicy=closed',
        'DeviceAllow=char-nvidia rw',
        'DeviceAllow=char-nvidia-uvm rw',
        'TemporaryFileSystem=/dev/shm:size=64G,mode=1777',
        'NoNewPrivileges=yes',
        'ProtectSystem=strict',
        'PrivateUsers=no',
        'CapabilityBoundingSet=',
    ):
        assert expected in lines
    # With a private /dev/shm there is nothing stale to clean: the socket's directory, the seed, then nvidia-modprobe.
    assert start_pre(unit) == SOCKET_DIRECTORY + [SEED, NVIDIA_MODPROBE]


def test_shared_shm_gets_the_stale_segment_cleaner(tmp_path):
    unit = render(tmp_path, GPU_VARS, vllm_kimi_private_shm=False)[0]
    lines = unit.splitlines()
    assert start_pre(unit) == [
        'ExecStartPre=+/usr/bin/python3 -I /usr/local/libexec/llmserve-shm-clean --min-age 60',
        *SOCKET_DIRECTORY,
        SEED,
        NVIDIA_MODPROBE,
    ]
    assert not [line for line in lines if line.startswith('TemporaryFileSystem=')]


def test_api_key_lives_only_in_the_environment_file(gpu_unit):
    unit, environment = gpu_unit
    assert 'sk-' not in unit
    assert 'VLLM_API_KEY="sk-\\$ecret%key"' in environment.splitlines()
    assert 'NCCL_PROTO="LL"' in environment.splitlines()
    assert 'NCCL_P2P_LEVEL="SYS"' in environment.splitlines()
    assert 'VLLM_ENGINE_READY_TIMEOUT_S="3600"' in environment.splitlines()
    # One request makes 8 sequences at most, its prompts times its n, not vLLM's 1024 times 16384.
    assert 'VLLM_MAX_COMPLETION_PROMPTS=1' in environment.splitlines()
    assert 'VLLM_MAX_N_SEQUENCES=8' in environment.splitlines()


def test_the_sequences_of_one_request_stay_within_the_bound_however_many_prompts_it_lists(tmp_path):
    environment = render(tmp_path, GPU_VARS, vllm_kimi_max_completion_prompts=3)[1].splitlines()
    assert 'VLLM_MAX_COMPLETION_PROMPTS=3' in environment and 'VLLM_MAX_N_SEQUENCES=2' in environment


def test_an_environment_name_no_environment_file_carries_is_never_rendered(tmp_path):
    """The preflight refuses it by position; the template refuses it too, where a later phase runs on its own."""
    with pytest.raises(subprocess.CalledProcessError) as err:
        render(tmp_path, GPU_VARS, vllm_kimi_environment={'X\nLD_PRELOAD': '/tmp/x.so'})
    assert 'an environment variable name must match ^[A-Z_][A-Z0-9_]*$, and character 2 is "\\n"' in (
        err.value.stdout
    ), err.value.stdout
    assert not (tmp_path / 'environment').exists() or 'LD_PRELOAD' not in (tmp_path / 'environment').read_text()


def test_an_nvlink_node_leaves_nccl_its_own_choices(tmp_path):
    """The PCIe settings are the gpu inventory's: on the role's default environment, the NVLink inventory's NCCL_*
    are the role's own (its ranks meet on the loopback of their namespace)."""
    unit, environment = render(tmp_path, NVLINK_VARS)
    assert [line for line in environment.splitlines() if line.startswith('NCCL_')] == ['NCCL_SOCKET_IFNAME=lo']
    assert 'VLLM_API_KEY="sk-vault-key"' in environment.splitlines()
    assert exec_start(unit)[exec_start(unit).index('--tensor-parallel-size') + 1] == '8'


def test_extra_arguments_reach_vllm_unchanged(tmp_path):
    tricky = ['--override-generation-config', '{"temperature": 0.6}', '--chat-template', '/etc/tpl/$HOME%d.jinja']
    unit = render(tmp_path, GPU_VARS, vllm_kimi_extra_args=tricky)[0]
    line = [line for line in unit.splitlines() if line.startswith('ExecStart=')][0]
    assert '"/etc/tpl/$$HOME%%d.jinja"' in line
    assert '"{\\"temperature\\": 0.6}"' in line


def render_cluster(tmp_path, hosts, **extra_vars):
    """The unit's argv and the environment file of each host of a `kimi` cluster group."""
    inventory = tmp_path / 'hosts.yml'
    inventory.write_text(json.dumps({'all': {'children': {'kimi': {'hosts': hosts}}}}))
    playbook = tmp_path / 'play.yml'
    with open(PLAYBOOK) as source:
        playbook.write_text(source.read().replace('hosts: localhost', 'hosts: kimi').replace('../../../', REPO + '/'))
    rendered = {}
    for host in hosts:
        out = tmp_path / host
        out.mkdir()
        extra = {
            'out_dir': str(out),
            'vllm_kimi_cluster_group': 'kimi',
            'vllm_kimi_pipeline_parallel_size': 2,
            'group_vars_file': GPU_VARS,
            'max_model_len': 131072,
            'ansible_python_interpreter': LOCAL_PYTHON,
            # The key the gpu inventory reads from the vault.
            'vault_vllm_kimi_api_key': 'sk-vault-key',
        }
        extra.update(extra_vars)
        subprocess.run(
            [ANSIBLE_PLAYBOOK, '-i', str(inventory), '--limit', host, str(playbook), '-e', json.dumps(extra)],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        )
        unpack_render(out)
        unit = (out / 'unit.service').read_text()
        rendered[host] = (
            exec_start(unit),
            (out / 'environment').read_text().splitlines(),
            unit_settings(unit, 'Service'),
        )
    return rendered


def test_multi_node_cluster_drives_vllms_own_launcher(tmp_path):
    rendered = render_cluster(
        tmp_path,
        {
            'node-a': {'ansible_host': '10.0.0.1', 'ansible_connection': 'local'},
            'node-b': {'ansible_host': '10.0.0.2', 'ansible_connection': 'local'},
        },
    )
    head, worker = rendered['node-a'][0], rendered['node-b'][0]
    assert head[-8:] == ['--nnodes', '2', '--node-rank', '0', '--master-addr', '10.0.0.1', '--master-port', '29501']
    assert worker[-9:] == [
        '--nnodes',
        '2',
        '--node-rank',
        '1',
        '--master-addr',
        '10.0.0.1',
        '--master-port',
        '29501',
        '--headless',
    ]
    # Without VLLM_HOST_IP vLLM's queues between nodes listen on the default route's address.
    assert 'VLLM_HOST_IP="10.0.0.1"' in rendered['node-a'][1]
    assert 'VLLM_HOST_IP="10.0.0.2"' in rendered['node-b'][1]
    assert not [line for line in rendered['node-a'][1] if line.startswith('GLOO_SOCKET_IFNAME=')]


def test_multi_node_cluster_uses_the_cluster_network(tmp_path):
    rendered = render_cluster(
        tmp_path,
        {
            'node-a': {
                'ansible_host': 'a.example',
                'vllm_kimi_cluster_address': '192.168.50.1',
                'ansible_connection': 'local',
            },
            'node-b': {
                'ansible_host': 'b.example',
                'vllm_kimi_cluster_address': '192.168.50.2',
                'ansible_connection': 'local',
            },
        },
        vllm_kimi_cluster_interface='ens5f1',
    )
    assert rendered['node-b'][0][-5:] == ['--master-addr', '192.168.50.1', '--master-port', '29501', '--headless']
    for host, address in (('node-a', '192.168.50.1'), ('node-b', '192.168.50.2')):
        environment = rendered[host][1]
        assert 'VLLM_HOST_IP="%s"' % address in environment
        assert 'GLOO_SOCKET_IFNAME="ens5f1"' in environment
        assert 'NCCL_SOCKET_IFNAME="ens5f1"' in environment
        # The fence lets through the nodes' own addresses, not their whole network.
        assert rendered[host][2]['IPAddressAllow'] == ['localhost 192.168.50.1 192.168.50.2']


def test_the_front_door_answers_503_while_vllm_drains(gpu_render, tmp_path):
    """The unit's stop makes the marker the front door tests before any path: from the stop until vLLM's last
    process is gone, clients get 503 with Retry-After, not vLLM's 500 for a request its draining engine refuses."""
    out, (unit, _environment) = gpu_render
    service = unit_settings(unit, 'Service')
    marker = service['ExecStop'][0].split()[-1]
    # The marker first, then a second for what the door passed on just before it to reach vLLM's engine, which the
    # drain then finishes; only then systemd's SIGTERM.
    assert service['ExecStop'] == ['+-/usr/bin/touch ' + marker, '/usr/bin/sleep 1']
    # After the socket's directory, which each run's stop empties.
    assert service['ExecStopPost'] == [EMPTY_SOCKET_DIRECTORY, '+/bin/rm -f ' + marker]
    front = (out / 'front.nginx.conf').read_text()
    assert 'if (-f %s) {\n            return 503;' % marker in front
    assert 'error_page 502 503 = @vllm_down;' in front
    assert 'add_header Retry-After 30 always;' in front
    (tmp_path / 'no-front').mkdir()
    without_front_door = unit_settings(
        render(tmp_path / 'no-front', GPU_VARS, vllm_kimi_front_door=False, vllm_kimi_listen='tcp')[0], 'Service'
    )
    assert 'ExecStop' not in without_front_door and 'ExecStopPost' not in without_front_door
    (tmp_path / 'no-grace').mkdir()
    without_grace = unit_settings(render(tmp_path / 'no-grace', GPU_VARS, vllm_kimi_front_stop_grace=0)[0], 'Service')
    assert without_grace['ExecStop'] == ['+-/usr/bin/touch ' + marker]


def test_the_front_door_answers_503_until_the_gates_passed(gpu_render):
    """The closed marker, which tasks/deploy.yml makes before the restart and removes once the gates passed, is tested
    in the server's rewrite phase, before any location and before the key: every path, /health (a balancer's check)
    included, gets the 503 with Retry-After that a vLLM that is down gets."""
    out = gpu_render[0]
    front = (out / 'front.nginx.conf').read_text()
    server = front[front.index('    server {') :]
    closed = 'if (-f /run/vllm-kimi-front/vllm-gating) {\n            return 503;\n        }'
    assert closed in server
    assert server.index(closed) < server.index('location ')
    assert server.index('error_page 502 503 = @vllm_down;') < server.index(closed)
    down = server[server.index('location @vllm_down {') :]
    assert 'add_header Retry-After 30 always;' in down and 'return 503 ' in down


# What the smoke's unit may differ in: what it runs, how it runs once, and where its runtime copy of the
# environment and its runtime directory are (the service's own must not vanish when the smoke stops).
# How a stop ends (KillMode, ExecStop=, ExecStopPost=) too: the service drains its requests in flight behind the
# front door's draining marker, the smoke has none. And its UMask and the socket's directory: only the service creates
# vLLM's Unix socket, which the front door's group must be able to connect to.
SMOKE_DIFFERS_IN = {
    'Description', 'Type', 'ExecStart', 'ExecStartPre', 'TimeoutStartSec', 'TimeoutStopSec', 'Restart', 'RestartSec',
    'RuntimeDirectory', 'EnvironmentFile', 'KillMode', 'ExecStop', 'ExecStopPost', 'UMask', 'ReadWritePaths',
    'ExecPaths',
}  # fmt: skip


@pytest.mark.parametrize('group_vars', [GPU_VARS, SANDBOX_VARS], ids=['gpu', 'sandbox'])
def test_the_smoke_runs_in_the_services_own_sandbox(tmp_path, group_vars):
    unit = render(tmp_path, group_vars)[0]
    smoke = (tmp_path / 'smoke.service').read_text()
    service_settings, smoke_settings = unit_settings(unit, 'Service'), unit_settings(smoke, 'Service')
    differing = {
        name
        for name in set(service_settings) | set(smoke_settings)
        if service_settings.get(name) != smoke_settings.get(name)
    }
    assert differing <= SMOKE_DIFFERS_IN
    # The user, the fence, the devices and the hardening are the service's, line for line.
    for name in ('User', 'IPAddressDeny', 'IPAddressAllow', 'DevicePolicy', 'PrivateUsers', 'SystemCallFilter'):
        assert smoke_settings[name] == service_settings[name]
    assert smoke_settings['Type'] == ['oneshot'] and 'Restart' not in smoke_settings
    assert '[Install]' not in smoke and 'StartLimitBurst' not in smoke
    argv = exec_start(smoke)
    assert argv[1] == '/usr/local/libexec/llmserve-preload-smoke'
    # After "--", exactly what the service runs.
    assert argv[argv.index('--') + 1 :] == exec_start(unit)


def test_a_single_node_keeps_its_ranks_on_loopback(gpu_unit):
    environment = gpu_unit[1].splitlines()
    # Its ranks' Gloo and NCCL sockets stay inside the unit's IP fence (IPAddressAllow=localhost).
    assert [
        line
        for line in environment
        if line.split('=')[0] in ('VLLM_HOST_IP', 'GLOO_SOCKET_IFNAME', 'NCCL_SOCKET_IFNAME')
    ] == [
        'GLOO_SOCKET_IFNAME=lo',
        'NCCL_SOCKET_IFNAME=lo',
    ]


def test_service_settings_land_in_the_service_section(tmp_path):
    unit = render(
        tmp_path,
        GPU_VARS,
        vllm_kimi_service_settings={'CPUAffinity': '0-47', 'MemoryMax': '900G'},
    )[0]
    service = unit.split('[Service]', 1)[1].split('[Install]', 1)[0]
    assert 'CPUAffinity=0-47\nMemoryMax=900G\n' in service


# --- media fetches: the rendered settings, as vLLM's own code reads and applies them ---------------------------

VLLM_PYTHON = os.path.join(REPO, '.venv-vllm', 'bin', 'python')
# Run by .venv-vllm's python: vLLM's parser reads the media flags of the rendered command line, and its
# MediaConnector (what a chat request's image_url goes through) fetches the URL; prints the outcome as JSON.
# One process asks vLLM's own media fetch for every case of a test: vLLM's import is most of its time. Each case sets
# the VLLM_MEDIA_* variables it names and clears the others; vllm.envs reads them at each access.
FETCH_AS_VLLM = r"""
import json, os, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.multimodal.media.connector import MediaConnector
from vllm.multimodal.media.image import ImageMediaIO
from vllm.utils.argparse_utils import FlexibleArgumentParser

outcomes = []
for case in json.loads(sys.argv[1]):
    for name in [name for name in os.environ if name.startswith('VLLM_MEDIA')]:
        del os.environ[name]
    os.environ.update(case['environment'])
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(case['flags'])
    connector = MediaConnector(allowed_media_domains=args.allowed_media_domains)
    try:
        connector.load_from_url(case['url'], ImageMediaIO(), fetch_timeout=5)
        outcomes.append({'refused': None})
    except Exception as exc:
        outcomes.append({'refused': '%s: %s' % (type(exc).__name__, exc)})
print(json.dumps(outcomes))
"""


def media_flags(argv):
    """The command line's media flags: --allowed-media-domains with its values."""
    start = argv.index('--allowed-media-domains')
    end = next((i for i in range(start + 1, len(argv)) if argv[i].startswith('--')), len(argv))
    return argv[start:end]


def fetch_as_vllm(*cases):
    """vLLM's media fetch of each (flags, url, environment) in turn, in one process: [{'refused': reason or None}]."""
    asked = [
        {
            'flags': flags,
            'url': url,
            'environment': {k: v for k, v in environment.items() if k.startswith('VLLM_MEDIA')},
        }
        for flags, url, environment in cases
    ]
    proc = subprocess.run(
        [VLLM_PYTHON, '-c', FETCH_AS_VLLM, json.dumps(asked)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def environment_of(text):
    return dict(
        (name, value.strip('"')) for name, value in (line.split('=', 1) for line in text.splitlines() if '=' in line)
    )


@pytest.mark.vllm
@pytest.mark.skipif(
    not os.path.exists(VLLM_PYTHON), reason='needs the CPU build of vLLM in .venv-vllm (make vllm-venv)'
)
def test_media_from_a_loopback_url_is_refused_before_any_fetch(gpu_unit):
    unit, environment = gpu_unit
    flags = media_flags(exec_start(unit))
    canary = Canary()
    try:
        # Without the role's flag, vLLM's own default, the same fetch reaches the canary: the check can fail. Each
        # case asks its own query, so the hits say which one reached it.
        with_flags, without = fetch_as_vllm(
            (flags, canary.url + '?with-flags', environment_of(environment)), ([], canary.url + '?without', {})
        )
        assert with_flags['refused'] and 'allowed domains' in with_flags['refused'], with_flags
        assert without['refused'], 'the canary answers 404, which vLLM cannot decode'
        assert canary.hits == ['/cat.png?without']
    finally:
        canary.close()


@pytest.mark.vllm
@pytest.mark.skipif(
    not os.path.exists(VLLM_PYTHON), reason='needs the CPU build of vLLM in .venv-vllm (make vllm-venv)'
)
def test_an_allowed_media_host_cannot_redirect_vllm_elsewhere(tmp_path):
    # An operator allows one media host (here loopback, where the test's servers are); it answers with a redirect
    # to the canary.
    unit, environment = render(tmp_path, GPU_VARS, vllm_kimi_allowed_media_domains=['127.0.0.1'])
    flags = media_flags(exec_start(unit))
    assert flags == ['--allowed-media-domains', '127.0.0.1']
    env = environment_of(environment)
    assert env['VLLM_MEDIA_URL_ALLOW_REDIRECTS'] == '0'
    canary = Canary()
    # A redirector per case, each to its own query of the canary: the hits say which case reached it.
    redirectors = [Canary(to=canary.url + '?redirects-off'), Canary(to=canary.url + '?redirects-on')]
    try:
        # With redirects on (vLLM's default) the canary is reached: the redirect setting is what kept it out.
        kept_out, _followed = fetch_as_vllm(
            (flags, redirectors[0].url, env),
            (flags, redirectors[1].url, dict(env, VLLM_MEDIA_URL_ALLOW_REDIRECTS='1')),
        )
        assert kept_out['refused'], kept_out
        assert [r.hits for r in redirectors] == [['/cat.png'], ['/cat.png']]
        assert canary.hits == ['/cat.png?redirects-on']
    finally:
        canary.close()
        for redirector in redirectors:
            redirector.close()


def test_the_unit_fences_vllm_to_loopback_and_the_cluster_network(gpu_unit, tmp_path):
    service = unit_settings(gpu_unit[0], 'Service')
    assert service['IPAddressDeny'] == ['any']
    assert service['IPAddressAllow'] == ['localhost']
    assert service['WorkingDirectory'] == ['/']
    fenced = unit_settings(
        render(tmp_path, GPU_VARS, vllm_kimi_cluster_cidr='10.10.0.0/24', vllm_kimi_ip_address_allow=['192.0.2.7'])[0],
        'Service',
    )
    assert fenced['IPAddressAllow'] == ['localhost 10.10.0.0/24 192.0.2.7']


def test_code_and_caches_stay_out_of_what_the_service_user_keeps(gpu_unit):
    unit, environment = gpu_unit
    env = environment_of(environment)
    assert env['PYTHONDONTWRITEBYTECODE'] == '1' and env['VLLM_NO_USAGE_STATS'] == '1'
    # The model's remote code is copied afresh at each start: the runtime directory goes with each stop.
    assert env['HF_MODULES_CACHE'] == '/run/vllm-kimi/hf_modules'
    assert unit_settings(unit, 'Service')['RuntimeDirectory'] == ['vllm-kimi']
    # HOME and every cache are per run too, and nothing persistent is the service's to write.
    for name in ('HOME', 'XDG_CACHE_HOME', 'HF_HOME', 'VLLM_CACHE_ROOT', 'TRITON_CACHE_DIR'):
        assert env[name].startswith('/run/vllm-kimi/home'), (name, env[name])
    service = unit_settings(unit, 'Service')
    assert service['ReadWritePaths'] == ['-/run/vllm-kimi-api']
    # Each start first seeds HOME, as the service user (no "+"), from root's store of this release and command line.
    release = re.search(r'/opt/vllm-kimi/([0-9a-f]{12})/bin/', unit).group(1)
    [seed] = [line for line in service['ExecStartPre'] if '"seed"' in line]
    assert re.fullmatch(
        r'"/bin/sh" "-c" .* "seed" "/var/cache/vllm-kimi/%s-[0-9a-f]{12}" "/run/vllm-kimi/home"' % release, seed
    ), seed


# Run by .venv-vllm's python: vLLM's parser reads the command line's flags into its MultiModalConfig, which gives each
# modality's limit per prompt.
LIMITS_AS_VLLM = r"""
import json, sys
from vllm.config.multimodal import MultiModalConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

limits = []
for flags in json.loads(sys.argv[1]):
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(flags)
    config = MultiModalConfig(limit_per_prompt=args.limit_mm_per_prompt)
    limits.append({modality: config.get_limit_per_prompt(modality) for modality in ('vision_chunk', 'image', 'video')})
print(json.dumps(limits))
"""


def limits_as_vllm(*argvs):
    """The per-prompt media limits vLLM takes from each command line's --limit-mm-per-prompt, in one process (vLLM's
    import is most of its time)."""
    flags = [argv[argv.index('--limit-mm-per-prompt') :][:2] for argv in argvs]
    proc = subprocess.run(
        [VLLM_PYTHON, '-c', LIMITS_AS_VLLM, json.dumps(flags)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
@pytest.mark.skipif(
    not os.path.exists(VLLM_PYTHON), reason='needs the CPU build of vLLM in .venv-vllm (make vllm-venv)'
)
def test_kimis_media_limit_binds_its_vision_chunks(tmp_path, gpu_unit):
    """Kimi-K2.5 takes images and videos as one modality, vision_chunk: vLLM holds a prompt to the inventory's 8
    media items only where the limit names it. Under the names the inventory uses, it would allow vLLM's 999."""
    without_the_preflight = exec_start(render(tmp_path, GPU_VARS, __vllm_kimi_preflight={})[0])
    rendered, unnamed = limits_as_vllm(exec_start(gpu_unit[0]), without_the_preflight)
    assert rendered['vision_chunk'] == 8
    assert unnamed == {'vision_chunk': 999, 'image': 8, 'video': 0}


def test_a_single_node_serves_on_a_unix_socket_in_a_network_of_its_own(gpu_render, tmp_path):
    """No TCP port of vLLM's for another local user to reach or take, and no network for the unit: its ranks meet
    on its own loopback. The front door's workers, and root's gates, connect to the socket."""
    out, (unit, environment) = gpu_render
    service = unit_settings(unit, 'Service')
    argv = exec_start(unit)
    assert argv[argv.index('--uds') + 1] == '/run/vllm-kimi-api/vllm.sock'
    assert '--host' not in argv and '--port' not in argv
    assert service['PrivateNetwork'] == ['yes'] and service['UMask'] == ['0007']
    # The one path vLLM may write besides its runtime directory, emptied at each start and at each stop, after the
    # stop's last process (the draining marker's removal follows it).
    assert service['ReadWritePaths'] == ['-/run/vllm-kimi-api']
    assert service['ExecStopPost'] == [EMPTY_SOCKET_DIRECTORY, '+/bin/rm -f /run/vllm-kimi-front/vllm-draining']
    assert 'GLOO_SOCKET_IFNAME=lo' in environment.splitlines() and 'NCCL_SOCKET_IFNAME=lo' in environment.splitlines()
    front = (out / 'front.nginx.conf').read_text()
    assert 'server unix:/run/vllm-kimi-api/vllm.sock;' in front
    smoke = unit_settings((out / 'smoke.service').read_text(), 'Service')
    # The smoke proves the parallel start in the same network namespace shape, and creates no socket.
    assert smoke['PrivateNetwork'] == ['yes'] and smoke['UMask'] == ['0077']
    assert smoke['RuntimeDirectory'] == ['vllm-kimi-smoke']


@pytest.mark.parametrize(
    'extra, private_network',
    [
        ({'vllm_kimi_listen': 'tcp'}, False),
        ({'vllm_kimi_allowed_media_domains': ['upload.wikimedia.org']}, False),
        ({'vllm_kimi_ip_address_allow': ['192.0.2.7']}, False),
    ],
    ids=['tcp', 'media-host', 'more-addresses'],
)
def test_the_network_stays_where_vllm_needs_it(tmp_path, extra, private_network):
    """On TCP, or where a media host or another address is allowed, the unit keeps its network behind its IP fence."""
    unit = render(tmp_path, GPU_VARS, **extra)[0]
    service = unit_settings(unit, 'Service')
    assert ('PrivateNetwork' in service) is private_network
    assert service['IPAddressDeny'] == ['any']
    argv = exec_start(unit)
    front = (tmp_path / 'front.nginx.conf').read_text()
    if extra.get('vllm_kimi_listen') == 'tcp':
        assert argv[argv.index('--host') + 1 :][:3] == ['127.0.0.1', '--port', '8000'] and '--uds' not in argv
        assert service['UMask'] == ['0077'] and 'RuntimeDirectory' in service
        assert 'ReadWritePaths' not in service and 'vllm-kimi-api' not in unit
        assert 'server 127.0.0.1:8000;' in front
    else:
        assert '--uds' in argv and 'server unix:/run/vllm-kimi-api/vllm.sock;' in front


def nginx_single_quoted(text):
    """The value of an nginx single-quoted string, as nginx's configuration reader unescapes it."""
    assert text.startswith("'") and text.endswith("'"), text
    return re.sub(r"\\(['\"\\])", r'\1', text[1:-1])


def test_the_front_door_checks_the_key_on_every_path_but_health_after_the_limits(gpu_render, tmp_path):
    """Every path but /health asks for the key through auth_request, in nginx's access phase: after limit_req and
    limit_conn (preaccess) counted the request, so that wrong keys meet the client's limits, and before the body is
    read (content). The key is in a root-only file of its own, matched case-sensitively, as vLLM compares it."""
    out = gpu_render[0]
    front = (out / 'front.nginx.conf').read_text()
    assert 'include /etc/vllm-kimi/front.auth.conf;' in front
    check = 'auth_request /@llmserve-key;'
    (tmp_path / 'paths').mkdir()
    paths = ['/v1/chat/completions', '/health', '/invocations', '/tokenize', '/v1/models', '/version']
    render(tmp_path / 'paths', GPU_VARS, vllm_kimi_api_key='sk-$ecret%key', vllm_kimi_front_paths=paths)
    for rendered, expected in (
        (front, {'/v1/chat/completions', '/health'}),
        (tmp_path / 'paths' / 'front.nginx.conf', set(paths)),
    ):
        text = rendered if isinstance(rendered, str) else rendered.read_text()
        locations = dict(re.findall(r'location = (\S+) \{\n(.*?)\n        \}', text, re.S))
        assert set(locations) >= expected | {'/metrics', '/@llmserve-key'}, locations
        for path in set(locations) - {'/@llmserve-key'}:
            body = locations[path]
            assert (check in body) is (path not in ('/health', '/metrics')), (path, body)
            assert 'return 401' not in body, body
            if check in body:
                assert body.index(check) < body.index('proxy_pass'), body
    key_check = locations['/@llmserve-key']
    assert key_check.split() == [
        'internal;',
        'if',
        '($llmserve_authorized',
        '=',
        '0)',
        '{',
        'return',
        '401;',
        '}',
        'return',
        '204;',
    ]
    assert 'error_page 401 = @llmserve_unauthorized;' in front
    assert 'location @llmserve_unauthorized {' in front and 'return 401 \'{"error": "Unauthorized"}\';' in front
    # The limits are the server's, which every location takes.
    server = front[front.index('    server {') :]
    assert server.index('limit_req zone=llmserve_requests') < server.index('location')
    assert 'client_body_timeout 60s;' in front
    auth = (out / 'front.auth.conf').read_text()
    source = re.search(r'^    (\'.*\') 1;$', auth, re.M).group(1)
    pattern = nginx_single_quoted(source)
    assert pattern.startswith('~^') and pattern.endswith('$')
    key = 'sk-$ecret%key'
    assert re.fullmatch(pattern[1:], 'Bearer ' + key)
    assert not re.search(pattern[1:], 'bearer ' + key) and not re.search(pattern[1:], 'Bearer ' + key + 'x')
    assert not re.search(pattern[1:], 'Bearer sk-XecretXkey')
    # No key, no check.
    (tmp_path / 'open').mkdir()
    render(tmp_path / 'open', GPU_VARS, vllm_kimi_api_key='')
    assert 'auth_request' not in (tmp_path / 'open' / 'front.nginx.conf').read_text()


def upstream_block(front):
    return front[front.index('upstream vllm {') : front.index('    server {')]


def test_the_front_door_closes_idle_connections_to_vllm_well_before_uvicorn_does(gpu_render, tmp_path):
    """The door's idle connections to vLLM close at 4 s, uvicorn's at 30: a margin no busy host eats up. A user's
    VLLM_HTTP_TIMEOUT_KEEP_ALIVE is kept, and the door's stays below it."""
    out, (_unit, environment) = gpu_render
    assert 'keepalive_timeout 4s;' in upstream_block((out / 'front.nginx.conf').read_text())
    assert re.findall(r'^VLLM_HTTP_TIMEOUT_KEEP_ALIVE=.*$', environment, flags=re.MULTILINE) == [
        'VLLM_HTTP_TIMEOUT_KEEP_ALIVE=30'
    ]
    for seconds, door in (('75', '4s'), ('3', '2s'), ('1', '1s')):
        (tmp_path / seconds).mkdir()
        _unit, users = render(
            tmp_path / seconds, GPU_VARS, vllm_kimi_environment={'VLLM_HTTP_TIMEOUT_KEEP_ALIVE': seconds}
        )[:2]
        assert 'keepalive_timeout %s;' % door in upstream_block((tmp_path / seconds / 'front.nginx.conf').read_text())
        assert re.findall(r'^VLLM_HTTP_TIMEOUT_KEEP_ALIVE=.*$', users, flags=re.MULTILINE) == [
            'VLLM_HTTP_TIMEOUT_KEEP_ALIVE="%s"' % seconds
        ]
    (tmp_path / 'no-front').mkdir()
    _unit, without_door = render(tmp_path / 'no-front', GPU_VARS, vllm_kimi_front_door=False, vllm_kimi_listen='tcp')[
        :2
    ]
    assert 'VLLM_HTTP_TIMEOUT_KEEP_ALIVE' not in without_door


def test_the_front_door_bounds_each_client_and_buffers_in_memory_only(gpu_render):
    """Per client address: 32 requests in progress and 10 a second with a burst of 64; methods and bodies per path;
    descriptors for two per connection; request bodies in a tmpfs of the unit, never on the root filesystem."""
    out = gpu_render[0]
    front = (out / 'front.nginx.conf').read_text()
    server = front[front.index('    server {') :]
    assert 'limit_conn llmserve_clients 32;' in server and 'limit_conn_status 503;' in server
    assert 'limit_req_zone $binary_remote_addr zone=llmserve_requests:1m rate=10r/s;' in front
    assert 'limit_req zone=llmserve_requests burst=64 nodelay;' in server and 'limit_req_status 429;' in server
    assert 'worker_rlimit_nofile 8192;' in front and 'worker_connections 4096;' in front
    locations = dict(re.findall(r'location = (\S+) \{\n(.*?)\n        \}', front, re.S))
    for path in ('/health', '/v1/models'):
        assert 'client_max_body_size 1k;' in locations[path] and '!~ ^(GET|HEAD)$' in locations[path], path
    for path in ('/v1/chat/completions', '/v1/completions'):
        body = locations[path]
        assert (
            'if ($request_method != POST) {\n                return 405;' in body and 'client_max_body_size' not in body
        )
    service = unit_settings((out / 'front.service').read_text(), 'Service')
    assert service['LimitNOFILE'] == ['8192']
    # The master holds the keys: no core dump of it on disk.
    assert service['LimitCORE'] == ['0']
    assert service['TemporaryFileSystem'] == ['/var/cache/vllm-kimi-front:size=1g,mode=0755']
    assert 'CacheDirectory' not in service
    assert 'client_body_temp_path /var/cache/vllm-kimi-front/body;' in front


def test_a_key_with_quotes_and_backslashes_reaches_the_front_door_intact(tmp_path):
    key = 'sk-it\'s-a\\\\key"quoted'
    render(tmp_path, GPU_VARS, vllm_kimi_api_key=key)
    auth = (tmp_path / 'front.auth.conf').read_text()
    pattern = nginx_single_quoted(re.search(r'^    (\'.*\') 1;$', auth, re.M).group(1))
    assert re.fullmatch(pattern[1:], 'Bearer ' + key) and not re.search(pattern[1:], 'Bearer ' + key[:-1])


def test_each_client_key_opens_the_door_and_vllm_gets_its_own_key(tmp_path):
    """vLLM knows one key (VLLM_API_KEY): the door accepts each client's key and sends vLLM's own for it. A "$" in a
    key is literal, where nginx would read a variable."""
    key, client_keys = "sk-$main'key", ['ck-one', 'ck-$two\\x']
    render(tmp_path, GPU_VARS, vllm_kimi_api_key=key, vllm_kimi_front_client_keys=client_keys)
    auth = (tmp_path / 'front.auth.conf').read_text()
    authorized, upstream = re.findall(r'^map \$http_authorization (\$\w+) \{\n(.*?)\n\}', auth, re.M | re.S)
    assert authorized[0] == '$llmserve_authorized' and upstream[0] == '$llmserve_upstream_authorization'
    accepted = [nginx_single_quoted(source) for source in re.findall(r"^    ('.*') 1;$", authorized[1], re.M)]
    assert len(accepted) == 3
    for sent in [key] + client_keys:
        assert [pattern for pattern in accepted if re.fullmatch(pattern[2:], 'Bearer ' + sent)], sent
    handed = re.findall(r"^    ('.*') ('.*');$", upstream[1], re.M)
    assert len(handed) == 2
    for (source, value), sent in zip(handed, client_keys):
        assert re.fullmatch(nginx_single_quoted(source)[2:], 'Bearer ' + sent)
        assert nginx_single_quoted(value).replace('${llmserve_dollar}', '$') == 'Bearer ' + key
    assert 'geo $llmserve_dollar {\n    default "$";\n}' in auth
    front = (tmp_path / 'front.nginx.conf').read_text()
    assert front.count('proxy_set_header Authorization $llmserve_upstream_authorization;') == 1
    # Without client keys, vLLM gets the client's own header; the key file still names the header the door would send,
    # so that a door configured for client keys takes the file that revokes them all before the restart.
    render(tmp_path, GPU_VARS, vllm_kimi_api_key=key)
    auth = (tmp_path / 'front.auth.conf').read_text()
    assert 'map $http_authorization $llmserve_upstream_authorization {\n    default $http_authorization;\n}' in auth
    assert 'llmserve_dollar' not in auth
    assert 'proxy_set_header Authorization' not in (tmp_path / 'front.nginx.conf').read_text()


def test_behind_a_load_balancer_the_limits_count_its_clients(tmp_path):
    """From a trusted balancer the client is X-Forwarded-For's last untrusted address: the limits per client, the
    metrics sources and the log see the clients, not the balancer. Without one, nothing of the header is believed."""
    render(
        tmp_path,
        GPU_VARS,
        vllm_kimi_front_trusted_proxies=['10.0.0.5', '10.0.1.0/24'],
        vllm_kimi_front_metrics_sources=['10.0.0.5', '10.0.2.0/24'],
    )
    front = (tmp_path / 'front.nginx.conf').read_text()
    http = front[: front.index('    server {')]
    assert 'set_real_ip_from 10.0.0.5;\n    set_real_ip_from 10.0.1.0/24;\n' in http
    assert 'real_ip_header X-Forwarded-For;' in http and 'real_ip_recursive on;' in http
    assert http.index('real_ip_recursive on;') < http.index('limit_conn_zone $binary_remote_addr')
    # /metrics by the connection's own address: a client behind the balancer cannot name itself a source. allow and
    # deny would judge the address X-Forwarded-For names.
    geo = re.search(r'geo \$realip_remote_addr \$llmserve_metrics_source \{\n(.*?)\n    \}', http, re.S).group(1)
    assert geo.split() == ['default', '0;', '10.0.0.5', '1;', '10.0.2.0/24', '1;']
    metrics = re.search(r'location = /metrics \{\n(.*?)\n        \}', front, re.S).group(1)
    assert metrics.split() == [
        'if',
        '($llmserve_metrics_source',
        '=',
        '0)',
        '{',
        'return',
        '403;',
        '}',
        'proxy_pass',
        'http://vllm/metrics;',
    ]
    assert not re.search(r'^ *(allow|deny) ', front, re.M)
    (tmp_path / 'alone').mkdir()
    render(tmp_path / 'alone', GPU_VARS)
    assert 'real_ip' not in (tmp_path / 'alone' / 'front.nginx.conf').read_text()


def meminfo(available_kib):
    """A registered slurp of /proc/meminfo, as the preflight reads it."""
    text = 'MemTotal:       %d kB\nMemFree:         1024 kB\nMemAvailable:   %d kB\n' % (
        available_kib * 2,
        available_kib,
    )
    return {'content': base64.b64encode(text.encode()).decode()}


@pytest.mark.parametrize(
    ('strategy', 'available_kib', 'expected'),
    [
        ('auto', 12 * 2**20, ['--safetensors-load-strategy', 'prefetch']),
        # 10 GiB of checkpoint against 10.5 GiB available: more than 90 %, the page cache would evict what it read.
        ('auto', int(10.5 * 2**20), []),
        ('lazy', 12 * 2**20, ['--safetensors-load-strategy', 'lazy']),
        ('', 12 * 2**20, []),
    ],
    ids=['auto-fits', 'auto-too-big', 'lazy', 'none'],
)
def test_the_checkpoint_is_prefetched_where_the_page_cache_holds_it(tmp_path, strategy, available_kib, expected):
    preflight = {'unified_vision_chunk': True, 'weights_bytes_total': 10 * 2**30}
    unit = render(
        tmp_path,
        GPU_VARS,
        vllm_kimi_safetensors_load_strategy=strategy,
        __vllm_kimi_preflight=preflight,
        __vllm_kimi_meminfo=meminfo(available_kib),
    )[0]
    argv = exec_start(unit)
    found = argv[argv.index('--safetensors-load-strategy') :][:2] if '--safetensors-load-strategy' in argv else []
    assert found == expected


# systemd's default PATH for units (Debian bookworm's systemd 252), which the unit's PATH ends with.
SYSTEMD_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'


@pytest.mark.parametrize('group_vars', [GPU_VARS, SANDBOX_VARS], ids=['gpu', 'sandbox'])
def test_each_unit_may_map_code_from_its_own_runtime_directory_alone(tmp_path, group_vars):
    """Stock hosts mount /run noexec: the caches' shared objects load only where ExecPaths= names the runtime dir."""
    unit = render(tmp_path, group_vars)[0]
    smoke = (tmp_path / 'smoke.service').read_text()
    for text, runtime in ((unit, 'vllm-kimi'), (smoke, 'vllm-kimi-smoke')):
        settings = unit_settings(text, 'Service')
        assert settings['RuntimeDirectory'] == [runtime]
        assert settings['ExecPaths'] == ['/run/' + runtime]


@pytest.mark.parametrize(
    'group_vars, cuda_home, path_after_release, cuda_env',
    [
        pytest.param(GPU_VARS, '', SYSTEMD_PATH, None, id='gpu-no-toolkit'),
        pytest.param(
            GPU_VARS, '/usr/local/cuda', '/usr/local/cuda/bin:' + SYSTEMD_PATH, '/usr/local/cuda', id='gpu-toolkit'
        ),
        pytest.param(SANDBOX_VARS, '', SYSTEMD_PATH, None, id='cpu'),
    ],
)
def test_the_units_path_holds_the_release_first_then_the_toolkit(tmp_path, group_vars, cuda_home, path_after_release,
                                                                 cuda_env):  # fmt: skip
    """ninja (torch's and FlashInfer's JIT builds) is in the release's bin/, nvcc in the toolkit's: systemd's default
    PATH holds neither."""
    unit, environment = render(tmp_path, group_vars, cuda_home=cuda_home)
    env = environment_of(environment)
    release_bin = os.path.dirname(exec_start(unit)[0])
    assert re.fullmatch(r'/opt/vllm-kimi/[0-9a-f]{12}/bin', release_bin), release_bin
    assert env['PATH'] == release_bin + ':' + path_after_release
    assert env.get('CUDA_HOME') == cuda_env
