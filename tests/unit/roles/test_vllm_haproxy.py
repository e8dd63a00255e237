# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vllm_haproxy role's configuration for an inventory of replicas of every shape, read by HAProxy itself
(`haproxy -c`, the check the role runs before it installs the file). The molecule scenario `fleet` serves through it
(tests/integration/fleet/test_rolling.py)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
ROLE = os.path.join(ROOT, 'roles', 'vllm_haproxy')
HAPROXY = shutil.which('haproxy') or '/usr/sbin/haproxy'
pytestmark = pytest.mark.skipif(
    not os.path.exists(HAPROXY), reason='haproxy is not installed (tools/host-packages.txt)'
)

# A replica reached at its IP address, one whose front door has a URL with a host name, one without a front door, and
# a model across two nodes whose worker serves no API.
REPLICAS = {
    'gpu-a': {'ansible_host': '10.0.0.1'},
    'gpu-b': {'vllm_kimi_front_url': 'https://localhost:9443'},
    'gpu-c': {'ansible_host': '10.0.0.3', 'vllm_kimi_front_door': False, 'vllm_kimi_port': 8001},
    'mn-head': {'ansible_host': '10.0.1.1'},
    'mn-worker': {'ansible_host': '10.0.1.2'},
}
MULTI_NODE = {'hosts': {'mn-head': {}, 'mn-worker': {}}, 'vars': {'vllm_kimi_cluster_group': 'kimi_mn'}}
INVENTORY = {'vllm': {'hosts': REPLICAS}, 'kimi_mn': MULTI_NODE}

PLAY = """
- hosts: localhost
  gather_facts: false
  vars:
    role_path: {role}
  vars_files:
    - {role}/defaults/main.yml
    - {role}/vars/main.yml
  tasks: {tasks}
"""
RENDER = [
    {
        'ansible.builtin.template': {
            'src': os.path.join(ROLE, 'templates', 'haproxy.cfg.j2'),
            'dest': '{{ out }}/haproxy.cfg',
            'mode': '0644',
        }
    }
]


def run_play(out, inventory, tasks, extra):
    """ansible-playbook on localhost with the role's defaults and vars and this inventory of replicas:
    (rc, stdout + stderr)."""
    inventory = json.loads(json.dumps(inventory))
    inventory['all'] = {
        'hosts': {'localhost': {'ansible_connection': 'local', 'ansible_python_interpreter': sys.executable}}
    }
    (out / 'hosts.json').write_text(json.dumps(inventory))
    (out / 'play.yml').write_text(PLAY.format(role=ROLE, tasks=json.dumps(tasks)))
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), 'ansible-playbook'), '-i', str(out / 'hosts.json'),
         str(out / 'play.yml'), '-e', json.dumps(extra)],
        capture_output=True, text=True, check=False, cwd=ROOT, env=dict(os.environ, ANSIBLE_CALLBACK_RESULT_FORMAT='json'),
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def failure(output):
    """The message of the task that failed the play (the default callback's result, as JSON)."""
    failed = output[output.index('fatal: [localhost]: FAILED! => ') :]
    result, _end = json.JSONDecoder().raw_decode(failed[failed.index('{') :])
    return result['msg']


@pytest.fixture(scope='module')
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp('haproxy')
    tls = out / 'tls'
    tls.mkdir()
    subprocess.run(
        ['openssl', 'req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes', '-days', '2',
         '-subj', '/CN=lb', '-keyout', str(tls / 'frontend.pem.key'), '-out', str(tls / 'frontend.pem')],
        check=True, capture_output=True,
    )  # fmt: skip
    shutil.copyfile(tls / 'frontend.pem', out / 'ca.pem')
    extra = {
        'out': str(out),
        '_vllm_haproxy_tls_dir': str(tls),
        'vllm_haproxy_replicas_ca': str(out / 'ca.pem'),
        'vllm_haproxy_socket': str(out / 'admin.sock'),
    }
    rc, output = run_play(out, INVENTORY, RENDER, extra)
    assert rc == 0, output
    return out / 'haproxy.cfg'


def test_each_replica_that_serves_is_a_server_at_its_front_door(rendered):
    servers = re.findall(r'^    server (.*)$', rendered.read_text(), re.M)
    ca = str(rendered.parent / 'ca.pem')
    assert servers == [
        # An address: the chain is checked (HAProxy matches names only).
        'gpu-a 10.0.0.1:8443 ssl verify required ca-file %s' % ca,
        # A name: sent as SNI, on health checks too, and matched against the certificate.
        'gpu-b localhost:9443 ssl verify required ca-file %s sni str(localhost) check-sni localhost verifyhost localhost'
        % ca,
        'gpu-c 10.0.0.3:8001',
        # The head of the model across nodes; its worker serves no API.
        'mn-head 10.0.1.1:8443 ssl verify required ca-file %s' % ca,
    ]


def test_haproxy_accepts_the_configuration(rendered):
    check = subprocess.run([HAPROXY, '-c', '-f', str(rendered)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_frontend_takes_clients_over_tls_and_the_statistics_stay_on_loopback(rendered):
    text = rendered.read_text()
    assert 'bind 0.0.0.0:443 ssl crt %s/tls/frontend.pem\n' % rendered.parent in text
    assert 'bind 127.0.0.1:8404\n' in text and 'stats admin' not in text
    assert 'stats socket %s/admin.sock mode 660 level admin\n' % rendered.parent in text
    assert 'retry-on conn-failure empty-response 503\n' in text and 'option httpchk GET /health\n' in text


def test_a_client_gives_its_slot_back_within_seconds_and_one_address_holds_a_share(rendered):
    """The bounds that hold without a key, at the role's defaults; tests/integration/fleet/test_balancer_limits.py
    shows what they hold against a real HAProxy."""
    text = rendered.read_text()
    defaults = re.search(r'^defaults\n(.*?)\n\n', text, re.S | re.M).group(1)
    assert re.findall(r'^    (timeout (?:client|client-fin|http-request|server) .*)$', defaults, re.M) == [
        'timeout client 10s',
        'timeout client-fin 5s',
        'timeout http-request 10s',
        'timeout server 3600s',
    ]
    frontend = re.search(r'^frontend vllm_api\n(.*?)\n\n', text, re.S | re.M).group(1)
    assert re.findall(r'^    ((?:stick-table|tcp-request) .*)$', frontend, re.M) == [
        'stick-table type ipv6 size 100k expire 30s store conn_cur,conn_rate(10s)',
        'tcp-request connection track-sc0 src,ipmask(32,64)',
        'tcp-request connection reject if { sc0_conn_cur gt 128 }',
        'tcp-request connection reject if { sc0_conn_rate gt 500 }',
    ]


def ca_refusal():
    """The role's refusal of a replica reached by IP address without a CA, as tasks/main.yml has it."""
    with open(os.path.join(ROLE, 'tasks', 'main.yml')) as handle:
        tasks = yaml.safe_load(handle)
    return [task for task in tasks if task['name'].startswith('Check that each replica reached by IP address')]


NO_CA = (
    ": HAProxy matches a replica's certificate against a host name, never an IP address, so the CA is the whole check "
    "and the host's CA bundle would accept any public certificate. Set vllm_haproxy_replicas_ca to the CA that signed "
    "the replicas' front-door certificates (their vllm_kimi_front_tls_ca), or reach each by a host name its "
    'certificate holds (vllm_kimi_front_url).'
)


@pytest.mark.parametrize(
    'replicas, ca, refused',
    [
        pytest.param(REPLICAS, '', 'gpu-a, mn-head (10.0.0.1:8443, 10.0.1.1:8443)', id='ipv4-no-ca'),
        pytest.param({'v6': {'ansible_host': 'fd00::5'}}, '', 'v6 ([fd00::5]:8443)', id='ipv6-no-ca'),
        pytest.param(
            {'by-url': {'vllm_kimi_front_url': 'https://10.0.0.9:9443'}},
            '',
            'by-url (10.0.0.9:9443)',
            id='url-ip-no-ca',
        ),
        pytest.param(REPLICAS, '/etc/site-ca.pem', None, id='ipv4-with-ca'),
        pytest.param({'gpu-b': {'vllm_kimi_front_url': 'https://gpu-b.example:9443'}}, '', None, id='name-no-ca'),
        pytest.param(
            {'gpu-c': {'ansible_host': '10.0.0.3', 'vllm_kimi_front_door': False}}, '', None, id='plain-http-no-ca'
        ),
    ],
)
def test_a_replica_reached_by_ip_address_needs_a_ca_the_operator_names(tmp_path, replicas, ca, refused):
    inventory = {'vllm': {'hosts': replicas}}
    if 'mn-head' in replicas:
        inventory['kimi_mn'] = MULTI_NODE
    rc, output = run_play(tmp_path, inventory, ca_refusal(), {'vllm_haproxy_replicas_ca': ca})
    if refused is None:
        assert rc == 0, output
    else:
        assert rc == 2, output
        assert failure(output) == refused + NO_CA
