# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The built tarball installs with ansible-galaxy and its role works from a wider playbook by FQCN."""

import glob
import json
import os
import socket
import struct
import subprocess
import tarfile

import pytest

# Builds the tarball and installs it with ansible-galaxy, then runs each tag's phase: make test's, not make check's
pytestmark = pytest.mark.slow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
BIN = os.path.join(REPO, '.venv', 'bin')

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
        vllm_kimi_api_key: wider-playbook-key
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


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
    work = tmp_path_factory.mktemp('galaxy')
    subprocess.run(
        [os.path.join(BIN, 'ansible-galaxy'), 'collection', 'build', '--output-path', str(work), REPO],
        check=True,
        capture_output=True,
        text=True,
    )
    tarball = glob.glob(str(work / 'llmserve-vllm-*.tar.gz'))
    assert len(tarball) == 1
    subprocess.run(
        [
            os.path.join(BIN, 'ansible-galaxy'),
            'collection',
            'install',
            '--force',
            tarball[0],
            '-p',
            str(work / 'collections'),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return work, tarball[0]


def test_tarball_ships_the_collection_and_not_the_test_harness(installed):
    with tarfile.open(installed[1]) as archive:
        names = set(archive.getnames())
    for shipped in (
        'plugins/modules/gpu_preflight.py',
        'plugins/modules/kv_cache_quant.py',
        'plugins/modules/chat_check.py',
        'roles/vllm_kimi/tasks/main.yml',
        'roles/vllm_kimi/README.md',
        'roles/vllm_monitoring/README.md',
        'playbooks/deploy.yml',
        'meta/runtime.yml',
        'README.md',
        'docs/security.md',
        'LICENSE',
        'changelogs/changelog.yaml',
        'inventories/gpu/hosts.yml',
    ):
        assert shipped in names
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
        name for name in names if name.split('/')[0] in harness or name.startswith(('.', 'inventories/sandbox'))
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
        ANSIBLE_COLLECTIONS_PATH=str(work / 'collections'),
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
