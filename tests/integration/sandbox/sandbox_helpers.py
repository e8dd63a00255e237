# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""How the sandbox fault tests act on a deployed sandbox host (see conftest.py)."""

import json
import os
import re
import subprocess
import tempfile
import time

import requests
import testinfra
import yaml

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
BIN = os.path.join(REPO, '.venv', 'bin')
PLAYBOOK = os.path.join(REPO, 'playbooks', 'deploy.yml')
CALLBACKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'callback_plugins')
ROLE_DEFAULTS = os.path.join(REPO, 'roles', 'vllm_kimi', 'defaults', 'main.yml')
INVENTORY = os.environ.get('LLMSERVE_SANDBOX_INVENTORY') or os.environ.get('MOLECULE_INVENTORY_FILE')
# testinfra's ansible backend runs ansible and ansible-inventory from PATH.
if BIN not in os.environ.get('PATH', '').split(os.pathsep):
    os.environ['PATH'] = BIN + os.pathsep + os.environ.get('PATH', '')
SANDBOX_VARS = os.path.join(REPO, 'inventories', 'sandbox', 'group_vars', 'vllm.yml')
# The sandbox CA (tools/sandbox) that signed the front doors' certificates.
CA = os.path.join(REPO, '.cache', 'sandbox', 'ca', 'ca.pem')
# The tool the role's tool gate offers by default (vllm_kimi_tool_gate), as a client's agent would.
WEATHER_TOOL = {
    'type': 'function',
    'function': {
        'name': 'get_weather',
        'description': 'Current weather of a city.',
        'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']},
    },
}


def revision(name):
    """The fake Hub's commit for a named revision, as the sandbox inventory documents it ("#   name: <commit>")."""
    with open(SANDBOX_VARS) as f:
        found = re.findall(r'^#   %s: ([0-9a-f]{40}) ' % re.escape(name), f.read(), re.M)
    assert len(found) == 1, 'inventories/sandbox/group_vars/vllm.yml documents no single revision %r' % name
    return found[0]


DEPLOYMENTS = '/var/lib/llmserve-vllm/vllm-kimi/deployments'


def served(sandbox):
    """What serves now: the unit and environment files, the last good link, and the running process."""
    files = sandbox.sh('sha256sum /etc/systemd/system/%s.service /etc/%s/environment' % (sandbox.unit, sandbox.unit))
    return {
        'files': files,
        'last_good': sandbox.sh('readlink %s/last-good' % DEPLOYMENTS).strip(),
        'process': sandbox.show('MainPID', 'NRestarts', 'ExecMainStartTimestampMonotonic', 'ActiveState'),
    }


def ansible_env(**extra):
    env = dict(os.environ)
    env.setdefault('ANSIBLE_COLLECTIONS_PATH', os.path.join(REPO, '.build', 'collections'))
    env.update({'ANSIBLE_NOCOLOR': '1', 'ANSIBLE_FORCE_COLOR': '0', 'PATH': BIN + os.pathsep + env['PATH']})
    env.update(extra)
    return env


def ad_hoc(inventory, host, command):
    """What `command` printed on host, run by Ansible's ad-hoc command module, after Ansible's header line ("host |
    CHANGED | rc=0 >>"). Ansible's and Python's warnings go to stderr and are left out (a new cryptography's
    deprecation of DSA, which ansible-core imports, printed one before the output); a failure shows both."""
    proc = subprocess.run(
        [os.path.join(BIN, 'ansible'), host, '-i', inventory, '-m', 'ansible.builtin.command', '-a', command],
        capture_output=True,
        env=ansible_env(),
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode(errors='replace')[-3000:]
    return proc.stdout.decode().partition('\n')[2]


class Sandbox:
    """One host of the `vllm` group of INVENTORY, and the ways the tests act on it."""

    def __init__(self, inventory):
        self.inventory = os.path.abspath(inventory)
        listing = json.loads(
            subprocess.check_output(
                [os.path.join(BIN, 'ansible-inventory'), '-i', self.inventory, '--list'], env=ansible_env()
            )
        )
        self.name = listing['vllm']['hosts'][0]
        with open(ROLE_DEFAULTS) as f:
            self.vars = yaml.safe_load(f)
        self.vars.update(listing['_meta']['hostvars'][self.name])
        # testinfra's own SSH does not render templated connection settings
        # (inventories/sandbox uses {{ inventory_dir }}); Ansible itself does.
        templated = any('{{' in str(v) for k, v in self.vars.items() if k.startswith('ansible_'))
        self.host = testinfra.get_host(
            'ansible://' + self.name, ansible_inventory=self.inventory, force_ansible=templated
        )
        self.unit = self.vars['vllm_kimi_service_name']
        # Where vLLM serves on the sandbox, as the role renders it (vllm_kimi_listen): its Unix socket, or its port.
        self.unix_socket = (
            '/run/%s-api/vllm.sock' % self.unit if self.vars.get('vllm_kimi_listen', 'unix') == 'unix' else None
        )

    def sh(self, command, *args):
        return self.host.check_output(command, *args)

    def show(self, *props):
        out = self.sh('systemctl show %s %s' % (self.unit, ' '.join('-p ' + p for p in props)))
        return dict(line.split('=', 1) for line in out.splitlines())

    def journal(self, lines=40):
        return self.host.run('journalctl -u %s --no-pager -n %s', self.unit, str(lines)).stdout

    def _ansible(self, argv):
        """Run an ansible command against this host; (rc, output, the recorded results)."""
        fd, record = tempfile.mkstemp(prefix='llmserve-record-', suffix='.json')
        os.close(fd)
        try:
            env = ansible_env(
                ANSIBLE_CALLBACK_PLUGINS=CALLBACKS,
                ANSIBLE_CALLBACKS_ENABLED='llmserve_record',
                ANSIBLE_LOAD_CALLBACK_PLUGINS='1',
                LLMSERVE_RECORD=record,
            )
            proc = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO, check=False
            )
            output = proc.stdout.decode(errors='replace')
            try:
                with open(record) as f:
                    report = json.load(f)
            except ValueError:
                raise AssertionError(
                    '%s recorded no results (rc %d):\n%s' % (argv[0], proc.returncode, output[-4000:])
                ) from None
        finally:
            os.unlink(record)
        return proc.returncode, output, report

    def deploy(self, *extra):
        """ansible-playbook playbooks/deploy.yml on this host; (rc, output, recorded results)."""
        return self._ansible(
            [os.path.join(BIN, 'ansible-playbook'), '-i', self.inventory, '--limit', self.name, PLAYBOOK] + list(extra)
        )

    def gate(self, timeout=300, api_key=None, max_model_len=None):
        """The role's coherence gate (llmserve.vllm.chat_check) run on its own, with the inventory's key unless another
        is given, and the context a deploy's gate finds planned where one is given; the module's result, with failed
        as the play saw it."""
        args = {
            'url': 'http://localhost' if self.unix_socket else 'http://127.0.0.1:%s' % self.vars['vllm_kimi_port'],
            'unix_socket': self.unix_socket,
            'model': self.vars['vllm_kimi_served_model_name'],
            'api_key': api_key or self.vars['vllm_kimi_api_key'],
            'prompt': self.vars['vllm_kimi_coherence_prompt'],
            'expect': self.vars['vllm_kimi_coherence_expect'],
            'timeout': timeout,
            'unit': self.unit + '.service',
        }
        if max_model_len is not None:
            args['max_model_len'] = max_model_len
        rc, output, report = self._ansible(
            [
                os.path.join(BIN, 'ansible'),
                self.name,
                '-i',
                self.inventory,
                '-m',
                'llmserve.vllm.chat_check',
                '-a',
                json.dumps(args),
            ]
        )
        # The recorded result holds what the module returned; whether it failed is the callback's status.
        task = report['tasks'][-1]
        return dict(task['result'], failed=task['status'] == 'failed')

    def wait_for(self, what, predicate, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(1)
        raise AssertionError('%s did not happen within %d s; journal:\n%s' % (what, timeout, self.journal()))


def task_results(report, host):
    """(task name, that host's result) for every task and handler the play ran, in order."""
    for entry in report['tasks']:
        if entry['host'] == host:
            yield entry['task'], entry['result']


def item_labels(output, task):
    """The item labels the default callback printed for the first run of a loop task (its progress lines)."""
    header = re.search(r'^TASK \[[^\]]*: %s\] \**$' % re.escape(task), output, re.M)
    assert header, 'the play shows no task %r' % task
    section = output[header.end() :].split('\nTASK [', 1)[0].split('\nRUNNING HANDLER [', 1)[0]
    return re.findall(r'^(?:ok|changed|failed|fatal): \[[^\]]+\] => \(item=(.*)\)', section, re.M)


def first_failure(report, host):
    for entry in report['tasks']:
        if entry['host'] == host and entry['status'] in ('failed', 'unreachable'):
            return entry['task'], entry['result']
    return None, None


class Prometheus:
    def __init__(self, port):
        self.url = 'http://127.0.0.1:%d/api/v1' % port

    def query(self, expression):
        """{frozenset of labels: value} of an instant query."""
        reply = requests.get(self.url + '/query', params={'query': expression}, timeout=10)
        reply.raise_for_status()
        body = reply.json()
        assert body['status'] == 'success', body
        return {frozenset(item['metric'].items()): float(item['value'][1]) for item in body['data']['result']}

    def value(self, expression):
        result = self.query(expression)
        assert len(result) <= 1, result
        return next(iter(result.values())) if result else None

    def wait(self, what, expression, predicate, timeout=90):
        """Poll until predicate(result of expression) holds: scrapes come every 5 s."""
        deadline = time.time() + timeout
        while True:
            result = self.query(expression)
            if predicate(result):
                return result
            if time.time() > deadline:
                raise AssertionError('%s: %s is %s after %d s' % (what, expression, result, timeout))
            time.sleep(2)


def prometheus_of(sandbox):
    """The Prometheus that scrapes this sandbox (molecule's default scenario, prepare.yml), or None: make demo's has
    none."""
    port = sandbox.vars.get('sandbox_prometheus_port')
    return Prometheus(int(port)) if port else None


def ours(name, sandbox):
    """One of the role's own series (node_exporter's textfile) of this sandbox's service."""
    return '%s{service="%s"}' % (name, sandbox.unit)


def textfile_value(sandbox, name):
    """The value of one of the role's own samples as the host's textfile holds it now (what node_exporter serves
    at its next scrape), or None where the file has no such sample."""
    path = '%s/llmserve_%s.prom' % (
        sandbox.vars['vllm_kimi_metrics_textfile_dir'],
        re.sub('[^A-Za-z0-9_]', '_', sandbox.unit),
    )
    for line in sandbox.sh('cat %s 2>/dev/null || true' % path).splitlines():
        if line.startswith(ours(name, sandbox) + ' '):
            return float(line.rsplit(' ', 1)[1])
    return None
