# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""chat_check's unit rule against a real systemd: the sandbox host (tools/sandbox).

The service is a stand-in for vLLM (targets/chat_check/files/fake_vllm.py) that logs vLLM's
loading lines and then serves, or dies with vLLM's KV-cache refusal; systemd, its restart
logic, NRestarts, journald and journalctl are real, and the module runs on the sandbox over
SSH as it does on a GPU host. The real vLLM behind the module is exercised by the role's
sandbox tests.

The sandbox is the one `tools/sandbox create NAME` booted; NAME comes from LLMSERVE_SANDBOX
(default: sandbox, the one inventories/sandbox points at).
"""

import json
import os
import re
import subprocess

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
PLAYBOOK = os.path.join(REPO, 'tests', 'integration', 'targets', 'chat_check', 'playbook.yml')
ANSIBLE_PLAYBOOK = os.path.join(REPO, '.venv', 'bin', 'ansible-playbook')
SANDBOX = os.environ.get('LLMSERVE_SANDBOX', 'sandbox')
SANDBOX_DIR = os.path.join(REPO, '.cache', 'sandbox', SANDBOX)
KV_REFUSAL = (
    "ValueError: To serve at least one request with the model's max seq len (1024), (0.0 GiB KV cache is "
    'needed, which is larger than the available KV cache memory (0.0 GiB). Based on the available memory, '
    'the estimated maximum model length is 128. Try increasing `gpu_memory_utilization` (which also controls '
    'CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See '
    'https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.'
)
ENGINE_FAILED = (
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"
)
PROGRESS = [
    'Loading safetensors checkpoint shards: 100% Completed | 2/2 [00:02<00:00,  1.00s/it]',
    'Loading weights took 6.00 seconds',
    'CPU KV cache size: 4,096 tokens, Maximum concurrency for 1,024 tokens per request: 4.00x',
    'INFO:     Application startup complete.',
]


def sandbox_state():
    try:
        with open(os.path.join(SANDBOX_DIR, 'state.json')) as f:
            state = json.load(f)
        os.kill(state['init_pid'], 0)
        return state
    except (OSError, ValueError, KeyError):
        return None


pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(
        sandbox_state() is None,
        reason='needs the sandbox host %s up (tools/sandbox create %s --ssh-port PORT)' % (SANDBOX, SANDBOX),
    ),
]


@pytest.fixture(scope='module')
def inventory(tmp_path_factory):
    state = sandbox_state()
    path = tmp_path_factory.mktemp('chat_check') / 'hosts.yml'
    path.write_text(
        json.dumps(
            {
                'all': {
                    'hosts': {
                        'sandbox': {
                            'ansible_host': '127.0.0.1',
                            'ansible_port': state['ssh_port'],
                            'ansible_user': 'root',
                            'ansible_ssh_private_key_file': os.path.join(SANDBOX_DIR, 'id_ed25519'),
                            'ansible_ssh_common_args': '-o UserKnownHostsFile=%s -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes'
                            % os.path.join(SANDBOX_DIR, 'known_hosts'),
                        }
                    }
                }
            }
        )
    )
    return str(path)


def scenario(inventory, tmp_path, **extra_vars):
    result_file = tmp_path / 'result.json'
    extra_vars['chatcheck_result_file'] = str(result_file)
    env = dict(
        os.environ,
        ANSIBLE_COLLECTIONS_PATH=os.path.join(REPO, '.build', 'collections'),
        ANSIBLE_CONFIG=os.path.join(REPO, 'ansible.cfg'),
    )
    proc = subprocess.run(
        [ANSIBLE_PLAYBOOK, '-i', inventory, PLAYBOOK, '-e', json.dumps(extra_vars)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=540,
        check=False,
    )
    output = proc.stdout.decode('utf-8', 'replace')
    assert proc.returncode == 0, output
    return json.loads(result_file.read_text())


def test_a_healthy_unit_passes_with_its_loading_progress(inventory, tmp_path):
    result = scenario(inventory, tmp_path, chatcheck_mode='good')
    assert result.get('failed') is not True, result
    assert (result['answer'], result['restarts'], result['unit_state']['ActiveState'], result['progress']) == (
        'The capital of France is Paris.',
        0,
        'active',
        PROGRESS,
    ), result
    # The stand-in loads for 6 s before it listens: long enough that a loaded machine still polls it while it loads.
    assert 1.0 <= result['healthy_after'] <= result['elapsed'] < 60, result


def test_one_crash_while_loading_is_tolerated(inventory, tmp_path):
    # kill -9 during the load; systemd restarts the unit 3 s later, while the module waits.
    result = scenario(
        inventory,
        tmp_path,
        chatcheck_mode='good',
        chatcheck_restart='on-failure',
        chatcheck_restart_sec=3,
        chatcheck_kill=True,
    )
    assert result.get('failed') is not True, result
    # Progress is that of the run that came up, not the killed one.
    assert (result['answer'], result['restarts'], result['unit_state']['NRestarts'], result['progress']) == (
        'The capital of France is Paris.',
        1,
        '1',
        PROGRESS,
    ), result


def test_a_unit_that_fails_fails_the_wait_at_once_with_the_reason(inventory, tmp_path):
    result = scenario(inventory, tmp_path, chatcheck_mode='refuse', chatcheck_restart='no', chatcheck_timeout=300)
    assert result['failed'] is True
    assert re.match(
        r'The unit llmserve-chatcheck-refuse\.service failed \(ActiveState=failed, SubState=failed, '
        r'Result=exit-code, ExecMainStatus=1, NRestarts=0\) while waiting [0-9.]+ s for http://127\.0\.0\.1:18791 '
        r'to answer\. From its journal:\n',
        result['msg'],
    ), result['msg']
    journal = [
        KV_REFUSAL,
        ENGINE_FAILED,
        'llmserve-chatcheck-refuse.service: Main process exited, code=exited, status=1/FAILURE',
        "llmserve-chatcheck-refuse.service: Failed with result 'exit-code'.",
    ]
    assert result['msg'].endswith('From its journal:\n' + '\n'.join('  ' + line for line in journal))
    assert result['journal'] == journal
    # Progress of the run that failed: its loading got this far.
    assert result['progress'] == PROGRESS[:2]
    assert result['restarts'] == 0
    # At once: the stand-in dies after a 6 s load; the timeout is 300 s.
    assert result['elapsed'] < 30


def test_a_restart_loop_fails_the_wait_at_once(inventory, tmp_path):
    result = scenario(
        inventory,
        tmp_path,
        chatcheck_mode='refuse',
        chatcheck_restart='on-failure',
        # Each restart 3 s apart: a loaded machine's wait still sees the second before a third comes.
        chatcheck_restart_sec=3,
        chatcheck_load_seconds=1,
        chatcheck_timeout=300,
    )
    assert result['failed'] is True
    assert result['msg'].startswith(
        'The unit llmserve-chatcheck-refuse.service is in a restart loop: systemd restarted it 2 times while '
        'waiting (more than max_restarts=1) (ActiveState='
    ), result['msg']
    assert KV_REFUSAL in result['journal']
    assert result['journal'][-1] == 'llmserve-chatcheck-refuse.service: Scheduled restart job, restart counter is at 2.'
    assert result['restarts'] == 2
    assert result['unit_state']['NRestarts'] == '2'
    assert result['elapsed'] < 30
