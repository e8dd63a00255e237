# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The built tarball installs with ansible-galaxy and its role works from a wider playbook by FQCN."""

import fcntl
import glob
import json
import os
import pty
import re
import select
import shutil
import socket
import struct
import subprocess
import tarfile
import termios

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.certificates import write_pair
from ansible_collections.llmserve.vllm.tests.support import make_kimi

# Builds the tarball and installs it with ansible-galaxy, then runs each tag's phase: make test's, not make check's
# The built tarball and its installed tree are the module's fixtures: its tests run on one worker (make integration's
# --dist loadgroup), which builds them once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('collection_install')]

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
BIN = os.path.join(REPO, '.venv', 'bin')
QUICK_START = os.path.join(REPO, 'docs', 'quickstart.md')
# ansible-builder comes with galaxy-importer into the ecosystem venv (make ecosystem).
ECOSYSTEM_BIN = os.path.join(REPO, '.build', 'ecosystem', 'venv', 'bin')
# Every file the built tarball holds, one per line, sorted.
SHIPPED = os.path.join(REPO, 'tests', 'integration', 'collection-files.txt')
# Where ansible-galaxy installs the collection for a user who names no path, relative to the test's work directory.
COLLECTIONS = os.path.join('home', '.ansible', 'collections')
INSTALLED = os.path.join(COLLECTIONS, 'ansible_collections', 'llmserve', 'vllm')

WIDER_PLAYBOOK = """---
- name: Wider infrastructure play that plans an inference host
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Use the collection's role by its full name
      ansible.builtin.import_role:
        name: llmserve.vllm.vllm_kimi
      vars:
        vllm_kimi_accelerator: cpu
        vllm_kimi_model_path: {model}
        vllm_kimi_tensor_parallel_size: 1
        vllm_kimi_kv_cache_memory_bytes: 1048576
        vllm_kimi_max_model_len: auto
        vllm_kimi_port: {port}
        vllm_kimi_api_key: wider-playbook-key-of-at-least-32-characters
        vllm_kimi_front_tls_certificate: {certificate}
        vllm_kimi_front_tls_key: {key}
        # Checked mode builds no release: no lock file to name.
        vllm_kimi_pip_require_hashes: false

    - name: Keep the plan for the report
      ansible.builtin.copy:
        content: "{{{{ __vllm_kimi_preflight | to_json }}}}"
        dest: {report}
        mode: "0644"
      check_mode: false
      tags: [always]
"""


def write_tiny_llama(path):
    """A 1-layer GQA Llama config and a safetensors shard with a valid header."""
    path.mkdir()
    config = {
        'architectures': ['LlamaForCausalLM'],
        'model_type': 'llama',
        'hidden_size': 128,
        'num_hidden_layers': 1,
        'num_attention_heads': 2,
        'num_key_value_heads': 1,
        'head_dim': 64,
        'intermediate_size': 256,
        'vocab_size': 64,
        'max_position_embeddings': 4096,
        'torch_dtype': 'float32',
    }
    (path / 'config.json').write_text(json.dumps(config))
    header = json.dumps({'model.embed_tokens.weight': {'dtype': 'F32', 'shape': [64, 128], 'data_offsets': [0, 32768]}})
    header = header.encode() + b' ' * (-len(header) % 8)
    (path / 'model.safetensors').write_bytes(struct.pack('<Q', len(header)) + header + b'\0' * 32768)


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def galaxy_version():
    with open(os.path.join(REPO, 'galaxy.yml')) as handle:
        return yaml.safe_load(handle)['version']


def quick_start_commands():
    """The quick start's shell lines (docs/quickstart.md), each without its comment."""
    with open(QUICK_START) as handle:
        block = re.search(r'## The commands\n\n```bash\n(.*?)```', handle.read(), flags=re.DOTALL)
    assert block, 'docs/quickstart.md has no bash block under "## The commands"'
    return [line.partition('   #')[0].strip() for line in block.group(1).splitlines()]


def quick_start_command(start):
    """The one quick-start line that starts with start."""
    lines = [line for line in quick_start_commands() if line.startswith(start)]
    assert len(lines) == 1, (start, quick_start_commands())
    return lines[0]


def user_environment(work, extra=None):
    """A user's environment in work: an empty home, no collections path or configuration of this checkout's."""
    env = {key: value for key, value in os.environ.items() if not key.startswith('ANSIBLE_')}
    env.update(HOME=str(work / 'home'), PATH=BIN + os.pathsep + env['PATH'], ANSIBLE_NOCOLOR='1', **(extra or {}))
    return env


def run_as_user(line, work, cwd=None):
    """A quick-start line as a user runs it in work."""
    return subprocess.run(
        line, shell=True, cwd=str(cwd or work), env=user_environment(work), capture_output=True, text=True, check=False
    )


def take_the_terminal():
    """In the child: a session of its own whose controlling terminal is its standard input, the pseudo-terminal."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def run_in_terminal(line, work, cwd, password, env=None):
    """A quick-start line in a terminal, as ansible-vault's editor and password prompts need: each prompt that ends in
    "password:" is answered with password. Returns the exit status and what the terminal showed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        line, shell=True, cwd=str(cwd), env=user_environment(work, env), stdin=slave, stdout=slave, stderr=slave,
        preexec_fn=take_the_terminal,
    )  # fmt: skip
    os.close(slave)
    shown = b''
    while select.select([master], [], [], 300)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the program has ended and closed the terminal
            break
        shown += chunk
        if shown.rstrip().lower().endswith(b'password:'):
            os.write(master, password.encode() + b'\n')
    os.close(master)
    return proc.wait(timeout=60), shown.decode(errors='replace')


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
    """The tarball built, then installed as the quick start installs it, into an empty home's collections path."""
    work = tmp_path_factory.mktemp('galaxy')
    (work / 'home').mkdir()
    subprocess.run(
        [os.path.join(BIN, 'ansible-galaxy'), 'collection', 'build', '--output-path', str(work), REPO],
        check=True,
        capture_output=True,
        text=True,
    )
    tarball = glob.glob(str(work / 'llmserve-vllm-*.tar.gz'))
    assert len(tarball) == 1
    # The documented line names the release galaxy.yml builds.
    result = run_as_user(quick_start_command('ansible-galaxy collection install'), work)
    assert result.returncode == 0, result.stdout + result.stderr
    assert os.path.isdir(str(work / INSTALLED))
    return work, tarball[0]


def test_tarball_ships_the_committed_file_list(installed):
    """What a release ships is reviewed: the tarball's files are tests/integration/collection-files.txt, nothing
    generated (antsibull-changelog's cache and fragments, caches, the build's own state) among them."""
    with tarfile.open(installed[1]) as archive:
        names = sorted(member.name for member in archive.getmembers() if not member.isdir())
    with open(SHIPPED) as handle:
        committed = handle.read().split()
    if names != committed:
        os.makedirs(os.path.join(REPO, '.build'), exist_ok=True)
        with open(os.path.join(REPO, '.build', 'collection-files.txt'), 'w') as handle:
            handle.write('\n'.join(names) + '\n')
    assert names == committed, (
        'the tarball ships other files than %s; where that is meant: cp .build/collection-files.txt %s'
        % (os.path.relpath(SHIPPED, REPO), os.path.relpath(SHIPPED, REPO))
    )


def test_tarball_ships_the_collection_and_not_the_test_harness(installed):
    with tarfile.open(installed[1]) as archive:
        names = set(archive.getnames())
    harness = (
        'tests',
        'molecule',
        'bench',
        'tools',
        'mk',
        'Makefile',
        'pytest.ini',
        'ansible.cfg',
        'ruff.toml',
        'CONTRIBUTING.md',
    )
    assert not [
        name
        for name in names
        if name.split('/')[0] in harness
        or name.startswith(('.', 'inventories/sandbox', 'changelogs/.plugin-cache.yaml', 'changelogs/fragments'))
    ]


def run_wider_playbook(installed, tmp_path, *args):
    work = installed[0]
    model = tmp_path / 'model'
    write_tiny_llama(model)
    playbook = tmp_path / 'site.yml'
    report = tmp_path / 'plan.json'
    # The front door's certificate, which the preflight judges before anything changes: one for the play's host.
    certificate, key = tmp_path / 'front.pem', tmp_path / 'front.key'
    subprocess.run(
        ['openssl', 'req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes',
         '-subj', '/CN=localhost', '-addext', 'subjectAltName=DNS:localhost', '-days', '365',
         '-keyout', str(key), '-out', str(certificate)],
        check=True, capture_output=True,
    )  # fmt: skip
    playbook.write_text(
        WIDER_PLAYBOOK.format(model=model, port=free_port(), report=report, certificate=certificate, key=key)
    )
    (tmp_path / 'ansible.cfg').write_text('[defaults]\n')
    env = dict(
        os.environ,
        ANSIBLE_COLLECTIONS_PATH=str(work / COLLECTIONS),
        ANSIBLE_NOCOLOR='1',
        ANSIBLE_CONFIG=str(tmp_path / 'ansible.cfg'),
        ANSIBLE_PYTHON_INTERPRETER=os.path.join(BIN, 'python'),
    )
    # Outside the checkout, so that only the installed tarball can provide llmserve.vllm.
    result = subprocess.run(
        [os.path.join(BIN, 'ansible-playbook'), '-i', 'localhost,', '-c', 'local', '--check', str(playbook)]
        + list(args),
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return result, report


def test_role_runs_from_the_installed_collection_in_a_wider_playbook(installed, tmp_path):
    result, report = run_wider_playbook(installed, tmp_path, '--tags', 'vllm_kimi_preflight')
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = json.loads(report.read_text())
    # vLLM downcasts a float32 checkpoint to its platform's first dtype, bfloat16: 1 MiB of KV cache / (2 x 1 KV head x 64 x 2 bytes x 1 layer)
    # = 4096 tokens, which is also the model's max_position_embeddings.
    assert plan['kv_cache_dtype'] == 'bfloat16'
    assert plan['kv_cache_bytes_per_token'] == 256
    assert plan['kv_cache_tokens'] == 4096
    assert plan['max_model_len'] == 4096
    assert plan['changed'] is False


# Each documented tag (README) with a task only that phase runs.
PHASE_TASKS = {
    'vllm_kimi_preflight': 'Show the serving plan the preflight derived',
    'vllm_kimi_user': 'Ensure the non-root service user exists with its state directory as home',
    'vllm_kimi_venv': 'Show the release the service will run',
    'vllm_kimi_checkpoint': "Ensure the checkpoint's FP8 KV-cache quantization follows the policy",
    'vllm_kimi_service': 'Ensure the systemd unit is installed',
}


@pytest.mark.parametrize('tag', sorted(PHASE_TASKS))
def test_each_documented_tag_runs_its_phase_on_its_own(installed, tmp_path, tag):
    result, report = run_wider_playbook(installed, tmp_path, '--tags', tag)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ran = [task for task in PHASE_TASKS.values() if 'TASK [llmserve.vllm.vllm_kimi : %s]' % task in result.stdout]
    # The preflight's plan is what every later phase reads: it runs under every tag.
    assert ran == sorted({PHASE_TASKS[tag], PHASE_TASKS['vllm_kimi_preflight']}, key=list(PHASE_TASKS.values()).index)


def planning_gpus(count):
    """The GPUs docs/quickstart.md gives a preflight run without them, as many as the inventory's tensor parallel."""
    with open(QUICK_START) as handle:
        block = re.search(r'```json\n(.*?)```', handle.read(), flags=re.DOTALL)
    gpus = json.loads(block.group(1))['vllm_kimi_preflight_gpus']
    return {'vllm_kimi_preflight_gpus': gpus * count}


def make_the_copy_yours(inventory, tmp_path):
    """What the quick start leaves to the user, here for hosts on this machine: each host's checkpoint and front-door
    certificate where its host_vars say, reached without SSH, as root without sudo (which this machine lacks)."""
    make_kimi(tmp_path / 'kimi')
    with open(str(inventory / 'hosts.yml')) as handle:
        hosts = sorted(yaml.safe_load(handle)['vllm']['hosts'])
    certificate, key = write_pair(tmp_path, 'front', names=['DNS:%s' % host for host in hosts])
    (inventory / 'host_vars').mkdir()
    for host in hosts:
        (inventory / 'host_vars' / (host + '.yml')).write_text(
            json.dumps({
                'ansible_connection': 'local',
                'ansible_python_interpreter': os.path.join(BIN, 'python'),
                'ansible_become': False,
                'vllm_kimi_model_path': str(tmp_path / 'kimi'),
                'vllm_kimi_front_tls_certificate': certificate,
                'vllm_kimi_front_tls_key': key,
            })
        )  # fmt: skip
    return hosts


def test_the_quick_start_plans_the_real_case_from_the_installed_collection(installed, tmp_path):
    """docs/quickstart.md's lines as a user runs them: the installed collection's inventories/gpu copied, the vault
    made with ansible-vault create, and ansible-playbook llmserve.vllm.preflight printing each host's plan."""
    work, password = installed[0], 'quick-start-vault-password'
    for start in ('cp -r', 'mkdir -p'):
        result = run_as_user(quick_start_command(start), work, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    # ansible-vault create's editor writes the one line the quick start says the file holds.
    editor = 'sh -c \'echo "vault_vllm_kimi_api_key: quick-start-key-of-at-least-32-characters" > "$0"\''
    rc, shown = run_in_terminal(
        quick_start_command('ansible-vault create'), work, tmp_path, password, env={'EDITOR': editor}
    )
    assert rc == 0, shown
    assert 'quick-start-key' not in (tmp_path / 'inventory' / 'group_vars' / 'all' / 'vault.yml').read_text()
    hosts = make_the_copy_yours(tmp_path / 'inventory', tmp_path)
    (tmp_path / 'gpus.json').write_text(json.dumps(planning_gpus(8)))
    preflight = quick_start_command('ansible-playbook llmserve.vllm.preflight') + ' -e @gpus.json'
    rc, shown = run_in_terminal(preflight, work, tmp_path, password)
    out = ' '.join(shown.split())
    assert rc == 0, out
    for host in hosts:
        assert re.search(r'%s : ok=\d+ changed=0 unreachable=0 failed=0' % re.escape(host), out), out
    for line in (
        'GPU 7, NVIDIA RTX PRO 6000 Blackwell Server Edition, 97887, 0, 12.0',
        'Strip the checkpoint FP8 KV cache: yes',
        'max_num_seqs 64: TRITON_MLA decode workspace',
        'Verdict: FITS with max_model_len 131072',
    ):
        assert out.count(line) == len(hosts), (line, out)
    # The vault's password is what the inventory needs: without the flag Ansible stops before any host is asked.
    result = run_as_user(preflight.replace(' --ask-vault-pass', ''), work, cwd=tmp_path)
    assert result.returncode != 0
    assert 'Attempting to decrypt but no vault secrets found' in result.stdout + result.stderr, (
        result.stdout + result.stderr
    )


def test_an_execution_environment_builds_with_the_collection_and_its_system_packages(installed, tmp_path):
    """docs/quickstart.md's execution environment: ansible-builder create writes its context, naming the collection,
    and ansible-builder's introspection of the installed collection finds bindep.txt through
    meta/execution-environment.yml."""
    builder = shutil.which('ansible-builder', path=ECOSYSTEM_BIN + os.pathsep + os.environ['PATH'])
    assert builder, 'ansible-builder is missing: make ecosystem installs it into %s' % ECOSYSTEM_BIN
    with open(QUICK_START) as handle:
        definition = re.search(r'## In an execution environment\n.*?```yaml\n(.*?)```', handle.read(), flags=re.DOTALL)
    (tmp_path / 'execution-environment.yml').write_text(definition.group(1))
    created = subprocess.run(
        [builder, 'create', '-f', 'execution-environment.yml', '--context', 'context'],
        cwd=str(tmp_path), capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert created.returncode == 0, created.stdout + created.stderr
    with open(str(tmp_path / 'context' / '_build' / 'requirements.yml')) as handle:
        assert yaml.safe_load(handle) == {'collections': [{'name': 'llmserve.vllm', 'version': galaxy_version()}]}
    # ansible-builder reads meta/execution-environment.yml, which ships; without it, it would fall back to bindep.txt.
    with open(str(installed[0] / INSTALLED / 'meta' / 'execution-environment.yml')) as handle:
        assert yaml.safe_load(handle) == {'version': 1, 'dependencies': {'system': 'bindep.txt'}}
    found = subprocess.run(
        [builder, 'introspect', str(installed[0] / COLLECTIONS)], capture_output=True, text=True, check=False
    )
    assert found.returncode == 0, found.stdout + found.stderr
    assert yaml.safe_load(found.stdout) == {
        'python': [],
        'system': [
            'openssh-client [platform:dpkg]  # from collection llmserve.vllm',
            'openssh-clients [platform:rpm]  # from collection llmserve.vllm',
        ],
    }
