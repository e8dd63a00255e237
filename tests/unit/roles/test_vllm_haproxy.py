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

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
ROLE = os.path.join(ROOT, 'roles', 'vllm_haproxy')
HAPROXY = shutil.which('haproxy') or '/usr/sbin/haproxy'
pytestmark = pytest.mark.skipif(
    not os.path.exists(HAPROXY), reason='haproxy is not installed (tools/host-packages.txt)'
)

# A replica reached at its IP address, one whose front door has a URL with a host name, one without a front door, and
# a model across two nodes whose worker serves no API.
INVENTORY = {
    'vllm': {
        'hosts': {
            'gpu-a': {'ansible_host': '10.0.0.1'},
            'gpu-b': {'vllm_kimi_front_url': 'https://localhost:9443'},
            'gpu-c': {'ansible_host': '10.0.0.3', 'vllm_kimi_front_door': False, 'vllm_kimi_port': 8001},
            'mn-head': {'ansible_host': '10.0.1.1'},
            'mn-worker': {'ansible_host': '10.0.1.2'},
        }
    },
    'kimi_mn': {'hosts': {'mn-head': {}, 'mn-worker': {}}, 'vars': {'vllm_kimi_cluster_group': 'kimi_mn'}},
}

PLAY = """
- hosts: localhost
  gather_facts: false
  vars:
    role_path: {role}
  vars_files:
    - {role}/defaults/main.yml
    - {role}/vars/main.yml
  tasks:
    - ansible.builtin.template:
        src: {role}/templates/haproxy.cfg.j2
        dest: "{{{{ out }}}}/haproxy.cfg"
        mode: "0644"
"""


@pytest.fixture(scope='module')
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp('haproxy')
    inventory = json.loads(json.dumps(INVENTORY))
    inventory['all'] = {
        'hosts': {'localhost': {'ansible_connection': 'local', 'ansible_python_interpreter': sys.executable}}
    }
    (out / 'hosts.json').write_text(json.dumps(inventory))
    (out / 'play.yml').write_text(PLAY.format(role=ROLE))
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
    subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), 'ansible-playbook'), '-i', str(out / 'hosts.json'),
         str(out / 'play.yml'), '-e', json.dumps(extra)],
        check=True, capture_output=True, cwd=ROOT,
    )  # fmt: skip
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
