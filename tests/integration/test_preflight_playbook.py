# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""playbooks/preflight.yml for real: ansible-playbook on an inventory of two local hosts.

One plans Kimi-K2.5 (its config, hf_quant_config.json with FP8 KV, an index only) for eight
RTX PRO 6000 given as vllm_kimi_preflight_gpus; the other sizes a tiny checkpoint for the CPU
build. The plan of each host is printed, and hosts whose start would fail fail.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.certificates import DAY, NOW, make_key, write_pair
from ansible_collections.llmserve.vllm.tests.support import make_kimi

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
PLAYBOOK = os.path.join(ROOT, 'playbooks', 'preflight.yml')
# 32 characters, the shortest key the preflight takes.
KEY = 'preflight-test-key-0123456789abc'
GPU_VARS = os.path.join(ROOT, 'inventories', 'gpu', 'group_vars', 'vllm.yml')
RTX = {'name': 'NVIDIA RTX PRO 6000 Blackwell Server Edition', 'memory_total_mib': 97887, 'compute_capability': '12.0'}


def make_tiny(d):
    d.mkdir()
    (d / 'config.json').write_text(
        json.dumps(
            {
                'model_type': 'llama',
                'num_hidden_layers': 2,
                'num_attention_heads': 4,
                'num_key_value_heads': 2,
                'head_dim': 64,
                'max_position_embeddings': 4096,
            }
        )
    )
    header = json.dumps(
        {'lm_head.weight': {'dtype': 'BF16', 'shape': [512, 256], 'data_offsets': [0, 262144]}}
    ).encode()
    with open(str(d / 'model.safetensors'), 'wb') as f:
        f.write(len(header).to_bytes(8, 'little') + header)
        f.truncate(8 + len(header) + 262144)


def run_playbook(tmp_path, hosts):
    # The front door's certificate, good for every host unless the host sets its own.
    certificate, key = write_pair(tmp_path, 'front')
    inventory = tmp_path / 'hosts.json'
    inventory.write_text(
        json.dumps(
            {
                'vllm': {
                    'hosts': hosts,
                    'vars': {
                        'ansible_connection': 'local',
                        'ansible_python_interpreter': sys.executable,
                        'vllm_kimi_front_tls_certificate': certificate,
                        'vllm_kimi_front_tls_key': key,
                        'vllm_kimi_front_url': 'https://localhost:8443',
                        # The preflight alone builds no release: no lock file to name.
                        'vllm_kimi_pip_require_hashes': False,
                    },
                }
            }
        )
    )
    env = dict(
        os.environ,
        ANSIBLE_COLLECTIONS_PATH=os.path.join(ROOT, '.build', 'collections'),
        ANSIBLE_NOCOLOR='1',
        ANSIBLE_CONFIG=os.path.join(ROOT, 'ansible.cfg'),
    )
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), 'ansible-playbook'), '-i', str(inventory), PLAYBOOK],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        text=True,
        timeout=300,
        check=False,
    )
    return proc.returncode, ' '.join(proc.stdout.split())


@pytest.mark.parametrize(
    'utilization, max_model_len, dcp, rc, expected',
    [
        (
            0.95,
            131072,
            'auto',
            0,
            [
                'Verdict: FITS with max_model_len 131072',
                'Strip the checkpoint FP8 KV cache: yes',
                'mla attention, 70272 bytes per token per GPU',
                'GPU 7, NVIDIA RTX PRO 6000 Blackwell Server Edition, 97887, 0, 12.0',
                # vLLM's default 1024 sequences: what TRITON_MLA's decode workspace takes from the KV cache.
                'max_num_seqs 1024: TRITON_MLA decode workspace 4.01 GiB per GPU = 61238 KV-cache tokens (256 splits)',
                # Plain tensor parallelism holds it: no decode context parallelism.
                'Decode context parallel size: 1 (not needed); max_num_seqs 1024 (default)',
            ],
        ),
        (
            0.9,
            262144,
            1,
            2,
            [
                'Verdict: DOES NOT FIT with max_model_len 262144',
                "Problem: To serve at least one request with the model''s max seq len (262144), (17.16 GiB KV cache is needed",
                'Weights: 581.90 GB in the checkpoint, 69.32 GiB on the most loaded GPU (config), planned with 1.39 GiB margin',
                'Reserve: 10.68 GiB per GPU (estimated)',
                'max_num_seqs 1024: TRITON_MLA decode workspace 5.89 GiB per GPU = 89944 KV-cache tokens (376 splits)',
                'Remedy: set vllm_kimi_max_model_len to 71008 (fits at vllm_kimi_gpu_memory_utilization 0.9)',
                'Remedy: no vllm_kimi_gpu_memory_utilization fits vllm_kimi_max_model_len 262144: it needs 3.90 GiB more',
                # What vllm_kimi_decode_context_parallel_size: 1 forbids, named as the way to the asked context.
                'Remedy: set vllm_kimi_decode_context_parallel_size to 2 with vllm_kimi_max_num_seqs 256 (or auto)',
            ],
        ),
        (
            0.9,
            262144,
            'auto',
            0,
            [
                # The native context: TP 8 cannot hold it, DCP 2 can, with a --max-num-seqs sized for its workspace.
                'Verdict: FITS with max_model_len 262144',
                'Decode context parallel size: 2 (planned); max_num_seqs 256 (planned); 1.06 requests of max_model_len',
                'max_num_seqs 256: TRITON_MLA decode workspace 2.94 GiB per GPU',
                'Warning: vllm_kimi_decode_context_parallel_size 2 (planned)',
            ],
        ),
    ],
)
def test_preflight_playbook_plans_kimi(tmp_path, utilization, max_model_len, dcp, rc, expected):
    make_kimi(tmp_path / 'kimi')
    make_tiny(tmp_path / 'tiny')
    code, out = run_playbook(
        tmp_path,
        {
            'kimi': {
                'vllm_kimi_model_path': str(tmp_path / 'kimi'),
                'vllm_kimi_max_model_len': max_model_len,
                'vllm_kimi_gpu_memory_utilization': utilization,
                'vllm_kimi_decode_context_parallel_size': dcp,
                'vllm_kimi_preflight_gpus': [RTX] * 8,
                'vllm_kimi_port': 18431,
                'vllm_kimi_api_key': KEY,
            },
            'tiny': {
                'vllm_kimi_model_path': str(tmp_path / 'tiny'),
                'vllm_kimi_accelerator': 'cpu',
                'vllm_kimi_tensor_parallel_size': 1,
                'vllm_kimi_kv_cache_memory_bytes': 1048576,
                'vllm_kimi_max_model_len': 1024,
                'vllm_kimi_port': 18432,
                'vllm_kimi_api_key': KEY,
            },
        },
    )
    assert code == rc, out
    for text in expected + [
        'Verdict: FITS with max_model_len 1024',
        'GPUs: none (accelerator cpu)',
        'max_num_seqs -: no MLA decode workspace in the KV budget',
    ]:
        assert text in out
    # The play's plan alone: the role's own summary of it is not printed as well.
    assert 'weights per GPU' not in out, out


def answers(out, host):
    """What the plan task printed for host, from the joined output (YAML: a quote inside quotes is doubled)."""
    found = re.search(r'ok: \[%s\] => msg: - (.*?)(?= ok: \[| fatal: \[| TASK \[| PLAY RECAP)' % re.escape(host), out)
    return found.group(1).replace("''", "'") if found else ''


def tiny_cpu_host(tmp_path):
    """The variables of a CPU host that serves the tiny model, which the preflight can plan: each test changes one."""
    make_tiny(tmp_path / 'tiny')
    return {
        'vllm_kimi_model_path': str(tmp_path / 'tiny'),
        'vllm_kimi_accelerator': 'cpu',
        'vllm_kimi_tensor_parallel_size': 1,
        'vllm_kimi_kv_cache_memory_bytes': 1048576,
        'vllm_kimi_max_model_len': 1024,
        'vllm_kimi_api_key': KEY,
    }


def test_each_host_the_preflight_cannot_answer_for_fails_with_its_cause(tmp_path):
    """Four hosts the preflight has no plan for, each for its own cause: each prints that cause in the role's words
    (the variable to change), not an error of the playbook's own templates, and fails."""
    missing = str(tmp_path / 'no-such-checkpoint')
    cpu = tiny_cpu_host(tmp_path)
    code, out = run_playbook(
        tmp_path,
        {
            'lost': dict(cpu, vllm_kimi_model_path=missing, vllm_kimi_port=18433),
            'no-driver': dict(
                cpu,
                vllm_kimi_accelerator='nvidia',
                vllm_kimi_nvidia_smi_path='/nonexistent/nvidia-smi',
                vllm_kimi_port=18434,
            ),
            'unpinned': dict(cpu, vllm_kimi_model_repo='llmserve/tiny-kimi', vllm_kimi_model_revision='main'),
            'exposed': dict(cpu, vllm_kimi_listen='tcp', vllm_kimi_host='0.0.0.0', vllm_kimi_port=18435),
        },
    )
    assert code == 2, out
    expected = {
        'lost': 'vllm_kimi_model_path %s does not exist' % missing,
        'no-driver': '/nonexistent/nvidia-smi not found: is the NVIDIA driver installed? (set vllm_kimi_nvidia_smi_path, '
        'or vllm_kimi_preflight_gpus to plan without GPUs)',
        'unpinned': "vllm_kimi_model_revision 'main' is not a full 40-hex commit",
        'exposed': 'vllm_kimi_host 0.0.0.0 is not a loopback address',
    }
    for host, cause in expected.items():
        assert 'The preflight could not answer: ' + cause in answers(out, host), (host, out)
        assert re.search(r'%s : ok=\d+ changed=0 unreachable=0 failed=1' % re.escape(host), out), (host, out)
    assert 'has no attribute' not in out, out


def test_the_front_doors_certificate_is_judged_before_anything_changes(tmp_path):
    """A host each for a certificate nginx or its clients would refuse: each fails the preflight with the file and the
    fix, in the role's words; a good one and one about to expire (a warning with its date) pass."""
    cpu = tiny_cpu_host(tmp_path)
    pairs = {
        'expired': write_pair(tmp_path, 'expired', not_before=NOW - 400 * DAY, not_after=NOW - DAY),
        'mismatched': write_pair(tmp_path, 'mismatched', cert_key=make_key()),
        'expiring': write_pair(tmp_path, 'expiring', not_after=NOW + 9 * DAY + DAY / 2),
    }
    hosts = {
        name: dict(cpu, vllm_kimi_front_tls_certificate=cert, vllm_kimi_front_tls_key=key)
        for name, (cert, key) in pairs.items()
    }
    hosts['good'] = cpu
    hosts['elsewhere'] = dict(cpu, vllm_kimi_front_url='https://gpu1.example.com:8443')
    hosts['missing'] = dict(cpu, vllm_kimi_front_tls_certificate=str(tmp_path / 'none.pem'))
    code, out = run_playbook(tmp_path, hosts)
    assert code == 2, out
    refused = {
        'expired': 'vllm_kimi_front_tls_certificate %s expired on ' % pairs['expired'][0],
        'mismatched': 'vllm_kimi_front_tls_key %s does not belong to vllm_kimi_front_tls_certificate %s (another EC '
        "P-256 key than the certificate's), and nginx would not start"
        % (pairs['mismatched'][1], pairs['mismatched'][0]),
        'elsewhere': 'vllm_kimi_front_tls_certificate %s does not name gpu1.example.com, the host of vllm_kimi_front_url '
        'https://gpu1.example.com:8443: its subjectAltName names DNS:localhost, IP:127.0.0.1, and clients refuse it. '
        'Issue it with subjectAltName DNS:gpu1.example.com' % (tmp_path / 'front.pem'),
        'missing': 'vllm_kimi_front_tls_certificate %s does not exist: ' % (tmp_path / 'none.pem'),
    }
    for host, cause in refused.items():
        assert 'The preflight could not answer: ' + cause in answers(out, host), (host, out)
        assert re.search(r'%s : ok=\d+ changed=0 unreachable=0 failed=1' % host, out), (host, out)
    for host in ('good', 'expiring'):
        assert 'Verdict: FITS with max_model_len 1024' in answers(out, host), (host, out)
        assert re.search(r'%s : ok=\d+ changed=0 unreachable=0 failed=0' % host, out), (host, out)
    assert 'vllm_kimi_front_tls_certificate %s expires on %s, in 9 days' % (
        pairs['expiring'][0], (NOW + 9 * DAY + DAY / 2).strftime('%Y-%m-%d %H:%M:%S UTC')) in out, out  # fmt: skip


# What the operator adds, each refused on a host of the gpu inventory before anything changes: (settings, message).
OPERATOR_INPUT_REFUSED = {
    'one-character-key': (
        {'vault_vllm_kimi_api_key': 'k'},
        'vllm_kimi_api_key is shorter than 32 characters, short enough to be guessed',
    ),
    'newline-in-a-name': (
        {'vllm_kimi_environment': {'NCCL_PROTO': 'LL', 'X\nLD_PRELOAD': '/tmp/x.so'}},
        "vllm_kimi_environment's names must match ^[A-Z_][A-Z0-9_]*$, which the environment file carries as one "
        'variable each: name 2 (counted from 1 as given): character 2 is "\\n".',
    ),
    'config-file': (
        {'vllm_kimi_extra_args': ['--config', 'x.yaml']},
        'vllm_kimi_extra_args passes --config: vLLM would read options from that file before the command line',
    ),
    'node-rank': ({'vllm_kimi_extra_args': ['--node-rank', '0']}, 'vllm_kimi_extra_args sets --node-rank,'),
    'encoder-mode': (
        {'vllm_kimi_extra_args': ['--mm-encoder-tp-mode=weights']},
        'vllm_kimi_extra_args sets --mm-encoder-tp-mode,',
    ),
    'remote-code': (
        {'vllm_kimi_extra_args': ['--trust-remote-code']},
        'vllm_kimi_extra_args sets --trust-remote-code,',
    ),
    'tool-choice': (
        {'vllm_kimi_extra_args': ['--enable-auto-tool-choice']},
        'vllm_kimi_extra_args sets --enable-auto-tool-choice,',
    ),
}


def test_what_the_operator_adds_is_refused_on_the_gpu_inventory_before_anything_changes(tmp_path):
    """The gpu inventory's settings, a host each with one thing added that would undo a guarantee: each fails the
    preflight with its own message and no change; the same settings with an harmless extra argument plan."""
    with open(GPU_VARS) as handle:
        gpu = yaml.safe_load(handle)
    # The test's own certificate (run_playbook's), and the checkpoint's files.
    for name in ('vllm_kimi_front_tls_certificate', 'vllm_kimi_front_tls_key'):
        del gpu[name]
    make_kimi(tmp_path / 'kimi')
    host = dict(
        gpu,
        vault_vllm_kimi_api_key=KEY,
        vllm_kimi_model_path=str(tmp_path / 'kimi'),
        vllm_kimi_preflight_gpus=[RTX] * 8,
    )
    hosts = {name: dict(host, **settings) for name, (settings, _message) in OPERATOR_INPUT_REFUSED.items()}
    hosts['harmless'] = dict(host, vllm_kimi_extra_args=['--enforce-eager'])
    code, out = run_playbook(tmp_path, hosts)
    assert code == 2, out
    for name, (_settings, message) in OPERATOR_INPUT_REFUSED.items():
        assert 'The preflight could not answer: ' + message in answers(out, name), (name, out)
        assert re.search(r'%s : ok=\d+ changed=0 unreachable=0 failed=1' % re.escape(name), out), (name, out)
    assert 'Verdict: FITS with max_model_len 131072' in answers(out, 'harmless'), out
    assert re.search(r'harmless : ok=\d+ changed=0 unreachable=0 failed=0', out), out
    assert KEY not in out and '/tmp/x.so' not in out
