# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""tools/sandbox for real: boot a sandbox host, reach it like a real host, tear it down without a trace.

Needs root, debootstrap and systemd-nspawn; the Debian tree is built once
(about a minute) and cached under .cache/sandbox, then a boot takes seconds.
No vLLM here: the molecule scenario deploys one. A deploy whose context does not
fit runs here, on a host the role has never touched: it stops in the preflight,
and the host is as it was.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests import support
from ansible_collections.llmserve.vllm.tools import fake_hub
from ansible_collections.llmserve.vllm.tools.sandbox import UNIFIED_CGROUP_ROOT

# The sandbox scenarios' helpers (deploy with every task's result recorded) sit beside their tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'sandbox'))
from sandbox_helpers import SANDBOX_VARS, Sandbox, first_failure  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
TOOL = os.path.join(REPO, 'tools', 'sandbox')
NAME = 'sandbox-lifecycle'
SSH_PORT = 2271
EXTRA_PORT = 8071
SANDBOX_DIR = os.path.join(REPO, '.cache', 'sandbox', NAME)
PREFLIGHT_TASK = 'Check GPUs, weights and KV cache against the requested context'
# MLA: (512 + 64) x 2 B x 3 layers = 3456 B/token; the sandbox inventory's 13.5 MiB of KV cache hold 4096 tokens.
MISFIT_MAX_MODEL_LEN = 8192
# What the role's first phases would leave on a host: the service user and group, its directories, root's records,
# the releases, the staged revisions, the environment files, the unit and the helper programs.
TOUCHED_BY_A_DEPLOY = (
    'getent passwd vllm vllm-kimi-front; getent group vllm; '
    'ls -d /var/lib/vllm-kimi /var/lib/llmserve-vllm /opt/vllm-kimi /srv/hub/tiny-kimi /etc/vllm-kimi '
    '/etc/systemd/system/vllm-kimi.service /etc/systemd/system/vllm-kimi-front.service /var/cache/vllm-kimi-front '
    '/usr/local/libexec/llmserve-* 2>&1; sha256sum /etc/passwd /etc/group'
)

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which('debootstrap') or not shutil.which('systemd-nspawn'),
        reason='needs root, debootstrap and systemd-nspawn (apt-get install debootstrap systemd-container)',
    ),
]


def tool(*args):
    proc = subprocess.run([TOOL] + list(args), capture_output=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout.decode())


def ssh(*command):
    return subprocess.run(
        [
            'ssh',
            '-p',
            str(SSH_PORT),
            '-i',
            os.path.join(SANDBOX_DIR, 'id_ed25519'),
            '-o',
            'UserKnownHostsFile=' + os.path.join(SANDBOX_DIR, 'known_hosts'),
            '-o',
            'StrictHostKeyChecking=yes',
            '-o',
            'IdentitiesOnly=yes',
            '-o',
            'BatchMode=yes',
            'root@127.0.0.1',
        ]
        + list(command),
        capture_output=True,
        check=False,
    )


def listening(port):
    with socket.socket() as sock:
        return sock.connect_ex(('127.0.0.1', port)) == 0


@pytest.fixture(scope='module')
def booted(tmp_path_factory):
    models = tmp_path_factory.mktemp('models')
    (models / 'tiny-chat').mkdir()
    (models / 'tiny-chat' / 'config.json').write_text('{"model_type": "llama"}\n')
    tool('destroy', NAME)
    first = tool('create', NAME, '--ssh-port', str(SSH_PORT), '--port', str(EXTRA_PORT), '--models', str(models))
    state = tool('status', NAME)['state']
    second = tool('create', NAME, '--ssh-port', str(SSH_PORT), '--port', str(EXTRA_PORT), '--models', str(models))
    yield {'first': first, 'second': second, 'state': state}
    tool('destroy', NAME)


def test_create_boots_once_and_then_changes_nothing(booted):
    assert booted['first'] == {'changed': True, 'name': NAME, 'ssh_port': SSH_PORT}
    assert booted['second'] == {'changed': False, 'name': NAME, 'ssh_port': SSH_PORT}


def test_systemd_is_pid_1_and_the_system_is_up(booted):
    result = ssh('cat /proc/1/comm; systemctl is-system-running')
    assert result.returncode in (0, 1), result.stderr.decode()
    comm, state = result.stdout.decode().split()
    assert comm == 'systemd'
    assert state in ('running', 'degraded')


def test_its_systemd_keeps_its_units_in_a_cgroup_tree_of_its_own(booted):
    """As each real host has its own: sandboxes side by side (the fleet beside the default scenario) never share the
    cgroup that a unit's IP fences are attached to, or that a stop kills."""
    with open('/proc/%d/cgroup' % booted['state']['init_pid']) as f:
        unified = [line.split(':', 2)[2].strip() for line in f if line.startswith('0::')]
    assert len(unified) == 1 and unified[0].startswith('/llmserve-%s/' % NAME), unified


def test_sshd_listens_on_loopback_only(booted):
    out = ssh('ss -ltnH sport = :%d' % SSH_PORT).stdout.decode()
    assert sorted(line.split()[3] for line in out.splitlines()) == ['127.0.0.1:%d' % SSH_PORT]


def test_unknown_host_key_is_refused(booted, tmp_path):
    # The host key was pinned at create time; an empty known_hosts must not be trusted blindly.
    (tmp_path / 'known_hosts').write_text('')
    result = subprocess.run(
        [
            'ssh',
            '-p',
            str(SSH_PORT),
            '-i',
            os.path.join(SANDBOX_DIR, 'id_ed25519'),
            '-o',
            'UserKnownHostsFile=%s' % (tmp_path / 'known_hosts'),
            '-o',
            'StrictHostKeyChecking=yes',
            '-o',
            'BatchMode=yes',
            'root@127.0.0.1',
            'true',
        ],
        capture_output=True,
        check=False,
    )
    assert result.returncode == 255
    assert b'Host key verification failed' in result.stderr


def test_host_ca_bundle_and_pip_settings_are_carried_in(booted):
    with open('/etc/ssl/certs/ca-certificates.crt', 'rb') as f:
        host_bundle = f.read()
    result = ssh('cat /etc/ssl/certs/ca-certificates.crt')
    assert result.stdout == host_bundle
    pip_conf = ssh('cat /etc/pip.conf').stdout.decode().splitlines()
    assert 'cert = /etc/ssl/certs/ca-certificates.crt' in pip_conf
    assert 'cache-dir = /var/cache/pip' in pip_conf


def test_models_are_copied_in(booted):
    assert ssh('cat /srv/models/tiny-chat/config.json').stdout == b'{"model_type": "llama"}\n'


@pytest.fixture(scope='module')
def misfit_on_a_new_host(booted, tmp_path_factory):
    """The sandbox inventory's deploy, tiny-kimi staged from a fake Hub, with a context its KV cache cannot hold."""
    tiny_kimi = os.path.join(support.tiny_models(), 'tiny-kimi')
    with open(SANDBOX_VARS) as f:
        sandbox_vars = yaml.safe_load(f)
    root = str(tmp_path_factory.mktemp('hub'))
    commit = fake_hub.publish(root, 'llmserve/tiny-kimi', tiny_kimi, commit=sandbox_vars['vllm_kimi_model_revision'])
    inventory = tmp_path_factory.mktemp('inventory')
    os.symlink(os.path.dirname(SANDBOX_VARS), str(inventory / 'group_vars'))
    (inventory / 'hosts.yml').write_text(
        json.dumps(
            {
                'vllm': {
                    'hosts': {
                        NAME: {
                            'ansible_host': '127.0.0.1',
                            'ansible_port': SSH_PORT,
                            'ansible_user': 'root',
                            'ansible_ssh_private_key_file': os.path.join(SANDBOX_DIR, 'id_ed25519'),
                            'ansible_ssh_common_args': '-o UserKnownHostsFile=%s -o StrictHostKeyChecking=yes '
                            '-o IdentitiesOnly=yes' % os.path.join(SANDBOX_DIR, 'known_hosts'),
                            'vllm_kimi_port': EXTRA_PORT,
                        }
                    }
                }
            }
        )
    )
    sandbox = Sandbox(str(inventory / 'hosts.yml'))
    before = ssh(TOUCHED_BY_A_DEPLOY).stdout.decode()
    hub = fake_hub.FakeHub(root).start()
    try:
        rc, output, report = sandbox.deploy(
            '-e',
            'vllm_kimi_hf_endpoint=%s' % hub.url,
            '-e',
            'vllm_kimi_model_revision=%s' % commit,
            '-e',
            'vllm_kimi_max_model_len=%d' % MISFIT_MAX_MODEL_LEN,
        )
    finally:
        hub.stop()
    return {
        'rc': rc,
        'output': output,
        'report': report,
        'before': before,
        'after': ssh(TOUCHED_BY_A_DEPLOY).stdout.decode(),
    }


def test_a_misfit_context_on_a_new_host_stops_in_the_preflight(misfit_on_a_new_host):
    run = misfit_on_a_new_host
    name, result = first_failure(run['report'], NAME)
    assert run['rc'] == 2, run['output'][-3000:]
    assert name == PREFLIGHT_TASK, result
    assert str(MISFIT_MAX_MODEL_LEN) in result['msg'], result['msg']
    # Planned from the Hub: the revision's files were read there, not fetched onto the host.
    assert result['weights_source'] == 'hub', result


def test_a_misfit_context_on_a_new_host_changes_nothing_there(misfit_on_a_new_host):
    run = misfit_on_a_new_host
    assert run['report']['stats'][NAME]['changed'] == 0
    assert [e['task'] for e in run['report']['tasks'] if e['status'] == 'changed'] == []
    # Nothing of what a deploy leaves is there, before or after.
    assert 'vllm' not in run['before'].split(':', 1)[0]
    assert run['after'] == run['before']
    for path in ('/var/lib/vllm-kimi', '/opt/vllm-kimi', '/srv/hub/tiny-kimi', '/etc/systemd/system/vllm-kimi.service'):
        assert "cannot access '%s': No such file or directory" % path in run['after'], run['after']


def test_destroy_leaves_no_process_mount_port_or_directory(booted):
    state = booted['state']
    tool('destroy', NAME)
    namespaces = set()
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                namespaces.add(os.readlink('/proc/%s/ns/pid' % entry))
            except OSError:
                continue
    assert state['pid_ns'] not in namespaces
    assert not os.path.exists('/proc/%d' % state['nspawn_pid'])
    with open('/proc/self/mountinfo') as f:
        assert SANDBOX_DIR not in f.read()
    assert not listening(SSH_PORT)
    assert not os.path.exists(SANDBOX_DIR)
    assert not os.path.exists(os.path.join(UNIFIED_CGROUP_ROOT, 'llmserve-' + NAME))
    assert tool('destroy', NAME) == {'changed': False, 'name': NAME}
