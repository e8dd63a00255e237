# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Changes that break what Kimi's users rely on, one per replica, deployed at once (molecule scenario `fleet`).

playbooks/deploy.yml runs on the three replica sandboxes together (vllm_deploy_at_once), each with a change of its
own:

- sandbox-fleet-1 stages the revision that never closes its thinking (`thinks-forever`): the answer never
  leaves the reasoning, and the coherence gate says so;
- sandbox-fleet-2 stages the revision that answers but ignores the tools it is offered (`ignores-tools`):
  the tool gate fails;
- sandbox-fleet-3 keeps the right revision but serves it without the reasoning parser: the thinking spills
  into `content`, markup and all, and the coherence gate refuses it.

Each host is rolled back by itself; afterwards every replica answers and calls tools again, judged with the
official `openai` client, and the one rolled back from a revision still does after a restart. The revisions are
the fake Hub's, named in inventories/sandbox/group_vars/vllm.yml.
"""

import json
import os
import subprocess
import sys
import tempfile

import openai
import pytest
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'sandbox'))
from sandbox_helpers import (  # noqa: E402
    BIN,
    CALLBACKS,
    REPO,
    ROLE_DEFAULTS,
    SANDBOX_VARS,
    WEATHER_TOOL,
    ad_hoc,
    ansible_env,
    first_failure,
    revision,
    task_results,
)

INVENTORY = os.environ.get('MOLECULE_INVENTORY_FILE')
pytestmark = pytest.mark.skipif(
    not (INVENTORY and os.environ.get('LLMSERVE_FLEET')),
    reason='needs the three sandbox hosts of `molecule test -s fleet` (make molecule-fleet)',
)

DEPLOY = os.path.join(REPO, 'playbooks', 'deploy.yml')
GATE_TASK = 'Wait until vLLM answers the coherence prompt correctly'
FINAL_TASK = 'Stop with the cause and where the host stands now'


@pytest.fixture(scope='module')
def fleet():
    listing = json.loads(
        subprocess.check_output([os.path.join(BIN, 'ansible-inventory'), '-i', INVENTORY, '--list'], env=ansible_env())
    )
    hosts = sorted(listing['vllm']['hosts'])
    # The role's defaults, then the sandbox inventory's settings over them.
    with open(ROLE_DEFAULTS) as f:
        settings = yaml.safe_load(f)
    with open(SANDBOX_VARS) as f:
        settings.update(yaml.safe_load(f))
    return hosts, {host: listing['_meta']['hostvars'][host]['vllm_kimi_port'] for host in hosts}, settings


def deploy(host_vars):
    fd, record = tempfile.mkstemp(prefix='llmserve-record-', suffix='.json')
    os.close(fd)
    fd, extra_inventory = tempfile.mkstemp(prefix='llmserve-hostvars-', suffix='.yml')
    with os.fdopen(fd, 'w') as f:
        yaml.safe_dump({'vllm': {'hosts': host_vars}}, f)
    try:
        env = ansible_env(
            ANSIBLE_CALLBACK_PLUGINS=CALLBACKS,
            ANSIBLE_CALLBACKS_ENABLED='llmserve_record',
            ANSIBLE_LOAD_CALLBACK_PLUGINS='1',
            LLMSERVE_RECORD=record,
        )
        proc = subprocess.run(
            # At once, as a maintenance window would: three changes, each rolled back by itself.
            [os.path.join(BIN, 'ansible-playbook'), '-i', INVENTORY, '-i', extra_inventory, DEPLOY]
            + ['-e', 'vllm_deploy_at_once=true'],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            check=False,
        )
        with open(record) as f:
            report = json.load(f)
    finally:
        os.unlink(record)
        os.unlink(extra_inventory)
    return proc.returncode, proc.stdout.decode(errors='replace'), report


def last_good(host):
    """The deployment the host's last-good record names."""
    return json.loads(
        ad_hoc(INVENTORY, host, 'cat /var/lib/llmserve-vllm/vllm-kimi/deployments/last-good/record.json')
    )['deployment']


@pytest.fixture(scope='module')
def broken_changes(fleet):
    hosts, ports, settings = fleet
    before = {host: last_good(host) for host in hosts}
    rc, output, report = deploy(
        {
            hosts[0]: {'vllm_kimi_model_revision': revision('thinks-forever')},
            hosts[1]: {'vllm_kimi_model_revision': revision('ignores-tools')},
            hosts[2]: {'vllm_kimi_reasoning_parser': ''},
        }
    )
    return before, rc, output, report


def client(fleet, host):
    hosts, ports, settings = fleet
    return openai.OpenAI(
        base_url='http://127.0.0.1:%d/v1' % ports[host],
        api_key=settings['vllm_kimi_api_key'],
        timeout=120,
        max_retries=0,
    )


def assert_answers_and_calls_tools(fleet):
    hosts, ports, settings = fleet
    for host in hosts:
        ask = client(fleet, host).chat.completions.create
        model = settings['vllm_kimi_served_model_name']
        answer = ask(
            model=model,
            temperature=0,
            max_tokens=256,
            messages=[{'role': 'user', 'content': settings['vllm_kimi_coherence_prompt']}],
        ).choices[0]
        assert answer.finish_reason == 'stop' and 'Paris' in answer.message.content, (host, answer)
        assert (answer.message.model_extra or {}).get('reasoning'), (host, answer)
        call = ask(
            model=model,
            temperature=0,
            max_tokens=256,
            tools=[WEATHER_TOOL],
            messages=[{'role': 'user', 'content': 'What is the weather in Paris?'}],
        ).choices[0]
        assert call.finish_reason == 'tool_calls', (host, call)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in call.message.tool_calls] == [
            ('get_weather', {'city': 'Paris'})
        ], (host, call)


@pytest.mark.parametrize(
    ('index', 'cause'),
    [
        (0, 'never left the reasoning'),
        (1, 'has no tool call, where it should call get_weather'),
        (2, 'has reasoning or tool-call markup left in its content'),
    ],
    ids=['thinks-forever', 'ignores-tools', 'no-reasoning-parser'],
)
def test_each_broken_change_fails_its_gate_and_is_rolled_back(fleet, broken_changes, index, cause):
    hosts, ports, settings = fleet
    before, rc, output, report = broken_changes
    host = hosts[index]
    assert rc == 2, output[-3000:]
    name, result = first_failure(report, host)
    assert name == GATE_TASK, (host, name, result)
    assert cause in result['msg'], result['msg']
    final = dict(task_results(report, host))[FINAL_TASK]
    assert 'Rolled back: %s is back on deployment %s' % (host, before[host]) in final['msg'], final['msg']
    assert last_good(host) == before[host]


def test_after_the_rollbacks_every_replica_answers_and_calls_tools(fleet, broken_changes):
    assert_answers_and_calls_tools(fleet)


def test_after_a_restart_the_replica_rolled_back_from_a_revision_still_answers_and_calls_tools(fleet, broken_changes):
    """The rollback of a revision left nothing the unit reads pointing at the failed one: a plain restart comes back
    to the last good revision. One replica: the default scenario restarts after the rollback of a command line
    (test_changes.py), and each restart here costs a vLLM start of about half a CPU-minute."""
    hosts, ports, settings = fleet
    ad_hoc(INVENTORY, hosts[0], 'systemctl restart vllm-kimi')
    rc = subprocess.run(
        [os.path.join(BIN, 'ansible-playbook'), '-i', INVENTORY, '--limit', hosts[0]]
        + [os.path.join(REPO, 'playbooks', 'gate.yml')],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ansible_env(),
        cwd=REPO,
        check=False,
    )
    assert rc.returncode == 0, rc.stdout.decode(errors='replace')[-3000:]
    assert_answers_and_calls_tools(fleet)
