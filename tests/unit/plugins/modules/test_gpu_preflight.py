# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run llmserve.vllm.gpu_preflight as Ansible runs it (a subprocess reading its arguments file).

nvidia-smi is a small shell script put first on PATH that prints the output captured on a
real two-GPU H200 machine (tests/fixtures/nvidia-smi, made with capture.sh there).
"""

import json
import os
import stat
import time

import pytest

from ansible_collections.llmserve.vllm.tests import support
from ansible_collections.llmserve.vllm.tests.support import checkpoint_config, fake_dev, fixture_path, warning_texts

SMI = fixture_path('nvidia-smi')
GIB = 1024**3


def fake_nvidia_smi(
    tmp_path, gpu='query-gpu-idle', apps='query-apps-idle', rc=0, before=':', persistence='query-persistence-on'
):
    """A nvidia-smi that answers the queries with the captured output, after the shell command before."""
    bindir = tmp_path / 'bin'
    bindir.mkdir()
    script = bindir / 'nvidia-smi'
    script.write_text(
        '#!/bin/sh\n%s\ncase "$1" in\n'
        '  --query-gpu=uuid,persistence_mode) cat "%s/%s.txt"; exit %d;;\n'
        '  --query-gpu=*) cat "%s/%s.txt"; exit %d;;\n'
        '  --query-compute-apps=*) cat "%s/%s.txt";;\n'
        'esac\n' % (before, SMI, persistence, rc, SMI, gpu, rc, SMI, apps)
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(bindir)


LLAMA = checkpoint_config('tiny-llama')


@pytest.fixture
def module_result(tmp_path):
    """The shared module runner; gpu_preflight's device directory is the H200 host's (tests/fixtures/h200) unless given."""
    workdir = tmp_path / 'module-run'
    workdir.mkdir()
    dev = fake_dev(tmp_path / 'dev')

    def run(module, args, path_prefix=None, timeout=120):
        if module == 'gpu_preflight':
            args = dict({'dev_path': dev}, **args)
        return support.module_result(module, workdir, args, path_prefix, timeout=timeout)

    return run


@pytest.fixture
def model(tmp_path):
    d = tmp_path / 'model'
    d.mkdir()
    (d / 'config.json').write_text(json.dumps(LLAMA))
    header = json.dumps(
        {'model.embed_tokens.weight': {'dtype': 'BF16', 'shape': [512, 256], 'data_offsets': [0, 262144]}}
    )
    with open(str(d / 'model.safetensors'), 'wb') as f:
        f.write(len(header).to_bytes(8, 'little') + header.encode())
        f.truncate(8 + len(header) + 262144)
    return str(d)


FIT = dict(tensor_parallel_size=2, max_model_len=4096, _ansible_check_mode=True)
UVM_MISSING = (
    '%s/nvidia-uvm does not exist: CUDA needs the nvidia_uvm kernel module and its device node, and the service '
    '(NoNewPrivileges, no capabilities) cannot create them. Remedies: run nvidia-modprobe -u -c=0 as root, or load '
    'the nvidia_uvm module (modprobe nvidia_uvm, and list it in /etc/modules-load.d to have it at boot).'
)


def test_a_missing_nvidia_uvm_fails_naming_the_remedy(tmp_path, model, module_result):
    # The H200 host's /dev without the node that loading nvidia_uvm creates.
    dev = fake_dev(tmp_path / 'dev-without-uvm', drop=('nvidia-uvm', 'nvidia-uvm-tools'))
    rc, r = module_result('gpu_preflight', dict(FIT, model_path=model, dev_path=dev), fake_nvidia_smi(tmp_path))
    assert (rc, r['msg']) == (1, UVM_MISSING % dev)
    assert r['fits'] is False


def test_the_h200_hosts_devices_pass(tmp_path, model, module_result):
    rc, r = module_result('gpu_preflight', dict(FIT, model_path=model), fake_nvidia_smi(tmp_path))
    assert (rc, r['problems']) == (0, [])
    assert not [w for w in warning_texts(r) if 'persistence' in w]
    assert [g['persistence_mode'] for g in r['gpus']] == ['Enabled', 'Enabled']


def test_persistence_mode_off_warns(tmp_path, model, module_result):
    bindir = fake_nvidia_smi(tmp_path, persistence='query-persistence-off')
    rc, r = module_result('gpu_preflight', dict(FIT, model_path=model), bindir)
    assert (rc, r['fits']) == (0, True)
    assert warning_texts(r)[-1] == (
        'persistence mode is off on GPU 1: the driver tears a GPU down whenever no process holds it and sets it up '
        'again at the next start, which slows every start; enable nvidia-persistenced (or nvidia-smi -pm 1)'
    )
    assert [g['persistence_mode'] for g in r['gpus']] == ['Enabled', 'Disabled']


def test_planned_gpus_judge_no_device(tmp_path, model, module_result):
    # The gpus option plans for hardware not at hand: this host's devices say nothing about it.
    gpus = [{'name': 'NVIDIA H200', 'memory_total_mib': 143771, 'compute_capability': '9.0'}] * 2
    dev = fake_dev(tmp_path / 'dev-without-uvm', drop=('nvidia-uvm',))
    rc, r = module_result('gpu_preflight', dict(FIT, model_path=model, dev_path=dev, gpus=gpus))
    assert (rc, r['problems']) == (0, [])


def test_reads_nvidia_smi_and_fits(tmp_path, model, module_result):
    rc, r = module_result(
        'gpu_preflight',
        dict(model_path=model, tensor_parallel_size=2, max_model_len=4096, _ansible_check_mode=True),
        fake_nvidia_smi(tmp_path),
    )
    assert rc == 0, r
    assert r['changed'] is False
    assert [(g['index'], g['name'], g['memory_total_mib'], g['processes']) for g in r['gpus']] == [
        (0, 'NVIDIA H200', 143771, []),
        (1, 'NVIDIA H200', 143771, []),
    ]
    assert r['driver_version'] == '580.159.04'
    assert r['weights_bytes_total'] == 262144
    assert r['weights_bytes_per_gpu'] == 131072
    assert r['kv_cache_bytes_per_token'] == 512
    # The headers' weights, every tensor's bytes: no margin beside them.
    assert (r['weights_source'], r['weights_margin_bytes_per_gpu']) == ('headers', 0)
    assert r['kv_cache_bytes'] == -(-143771 * 1024 * 1024 * 9 // 10) - 131072 - 5 * GIB
    assert (r['max_model_len'], r['fits'], r['problems'], r['strip_fp8_kv_cache']) == (4096, True, [], False)


def test_stale_processes_fail_with_their_pids(tmp_path, model, module_result):
    rc, r = module_result(
        'gpu_preflight',
        dict(model_path=model, tensor_parallel_size=2, max_model_len=4096),
        fake_nvidia_smi(tmp_path, 'query-gpu-busy', 'query-apps-busy'),
    )
    assert rc == 1
    assert r['msg'] == (
        'GPU 1 (NVIDIA H200) memory is held by PID 579 (%s, 20998 MiB): 119.89 GiB free, vLLM needs 126.36 GiB '
        'at gpu_memory_utilization 0.9; stop them (stale vLLM workers?).' % 'python3'
    )
    assert [p['pid'] for g in r['gpus'] for p in g['processes']] == [578, 579]


@pytest.mark.parametrize(
    'args, message',
    [
        (
            dict(nvidia_smi_path='/nonexistent/nvidia-smi'),
            '/nonexistent/nvidia-smi not found: is the NVIDIA driver installed? (set nvidia_smi_path, or gpus to plan without GPUs)',
        ),
        (
            dict(nvidia_smi_path='no-such-nvidia-smi'),
            'no-such-nvidia-smi not found on PATH: is the NVIDIA driver installed? (set nvidia_smi_path, or gpus to plan without GPUs)',
        ),
        (dict(tensor_parallel_size=0), 'tensor_parallel_size must be at least 1, got 0'),
        (dict(gpu_memory_utilization=1.5), 'gpu_memory_utilization must be more than 0 and at most 1, got 1.5'),
        (dict(max_model_len='long'), "max_model_len must be an integer or auto, got 'long'"),
        (dict(max_model_len=0), 'max_model_len must be a positive integer or auto, got 0'),
        (dict(accelerator='cpu'), 'accelerator is cpu but all of the following are missing: kv_cache_memory_bytes'),
    ],
)
def test_bad_input_messages(tmp_path, model, args, message, module_result):
    rc, r = module_result('gpu_preflight', dict(args, model_path=model))
    assert rc == 1
    assert r['msg'] == message


def test_failing_nvidia_smi(tmp_path, model, module_result):
    rc, r = module_result(
        'gpu_preflight', dict(model_path=model), fake_nvidia_smi(tmp_path, gpu='query-bad-field', rc=2)
    )
    assert rc == 1
    assert r['msg'] == (
        '%s/nvidia-smi --query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid '
        '--format=csv,noheader,nounits failed with exit code 2: Field "no_such_field" is not a valid field '
        'to query.' % (tmp_path / 'bin')
    )


def test_a_hung_nvidia_smi_is_killed_at_the_deadline(tmp_path, model, module_result):
    """A wedged driver hangs nvidia-smi in the kernel: the preflight must fail at nvidia_smi_timeout, not wait with it."""
    start = time.monotonic()
    rc, r = module_result(
        'gpu_preflight', dict(model_path=model, nvidia_smi_timeout=2), fake_nvidia_smi(tmp_path, before='sleep 60')
    )
    assert time.monotonic() - start < 30
    assert rc == 1
    assert r['msg'] == (
        '%s/nvidia-smi --query-gpu=index,name,memory.total,memory.used,compute_cap,driver_version,uuid '
        '--format=csv,noheader,nounits did not finish within 2 seconds and was killed: is the NVIDIA driver '
        'hung? (nvidia_smi_timeout sets the deadline)' % (tmp_path / 'bin')
    )


RTX = [
    {'name': 'NVIDIA RTX PRO 6000 Blackwell Server Edition', 'memory_total_mib': 97887, 'compute_capability': '12.0'}
]
# ceil(0.9 x 97887 MiB) - 5 GiB reserve - 1 MiB: leaves exactly 1 MiB of KV budget, 1024 tokens of 1024 B.
TIGHT = -(-97887 * 1024 * 1024 * 9 // 10) - 5 * GIB - 1048576


@pytest.mark.parametrize(
    'args, rc, message',
    [
        (dict(weights_bytes_per_gpu=TIGHT, max_model_len=1024), 0, None),
        (
            dict(weights_bytes_per_gpu=TIGHT, max_model_len=4096),
            1,
            "To serve at least one request with the model's max seq len (4096), (0.00 GiB KV cache is needed, which is larger than "
            'the available KV cache memory (0.00 GiB). Based on the available memory, the estimated maximum model length is 1024. '
            'Remedies: set max_model_len to 1024 (fits at gpu_memory_utilization 0.9); set gpu_memory_utilization to 0.91 '
            '(fits max_model_len 4096).',
        ),
        (
            dict(kv_cache_memory_bytes=1048576, max_model_len=4096),
            1,
            "To serve at least one request with the model's max seq len (4096), (0.00 GiB KV cache is needed, which is larger than "
            'the available KV cache memory (0.00 GiB). Based on the available memory, the estimated maximum model length is 1024. '
            'Remedies: set max_model_len to 1024 (fits in kv_cache_memory_bytes 1048576); set kv_cache_memory_bytes to at least '
            '4194304 (fits max_model_len 4096).',
        ),
        (
            dict(weights_bytes_per_gpu=84 * GIB, max_model_len=4096),
            1,
            'No available memory for the cache blocks: weights (84.00 GiB per GPU) + reserve (5.00 GiB) exceed 86.03 GiB at '
            'gpu_memory_utilization 0.9. Remedies: set gpu_memory_utilization to at least 0.94; spread the model over more GPUs '
            '(tensor_parallel_size x pipeline_parallel_size).',
        ),
    ],
)
def test_misfit_in_vllm_words_with_remedies(tmp_path, model, args, rc, message, module_result):
    result_rc, r = module_result('gpu_preflight', dict(args, model_path=model, gpus=RTX))
    assert result_rc == rc
    assert r.get('msg') == message
    assert r['fits'] is (rc == 0)
    assert r['gpus'][0]['name'] == 'NVIDIA RTX PRO 6000 Blackwell Server Edition'


ROLE_NAMES = {
    'max_model_len': 'vllm_kimi_max_model_len',
    'gpu_memory_utilization': 'vllm_kimi_gpu_memory_utilization',
    'tensor_parallel_size': 'vllm_kimi_tensor_parallel_size',
    'pipeline_parallel_size': 'vllm_kimi_pipeline_parallel_size',
    'nvidia_smi_path': 'vllm_kimi_nvidia_smi_path',
    'gpus': 'vllm_kimi_preflight_gpus',
}


def test_setting_names_put_the_callers_names_in_the_remedies_and_keep_vllms_words(tmp_path, model, module_result):
    rc, r = module_result(
        'gpu_preflight',
        dict(model_path=model, gpus=RTX, weights_bytes_per_gpu=TIGHT, max_model_len=4096, setting_names=ROLE_NAMES),
    )
    assert rc == 1
    assert r['remedies'] == [
        'set vllm_kimi_max_model_len to 1024 (fits at vllm_kimi_gpu_memory_utilization 0.9)',
        'set vllm_kimi_gpu_memory_utilization to 0.91 (fits vllm_kimi_max_model_len 4096)',
    ]
    # The problem is vLLM's own message, word for word.
    assert r['problems'] == [
        "To serve at least one request with the model's max seq len (4096), (0.00 GiB KV cache is needed, which is larger "
        'than the available KV cache memory (0.00 GiB). Based on the available memory, the estimated maximum model '
        'length is 1024.'
    ]
    assert r['msg'].endswith(
        'Remedies: set vllm_kimi_max_model_len to 1024 (fits at vllm_kimi_gpu_memory_utilization 0.9); '
        'set vllm_kimi_gpu_memory_utilization to 0.91 (fits vllm_kimi_max_model_len 4096).'
    )


@pytest.mark.parametrize(
    'args, message',
    [
        (
            dict(nvidia_smi_path='/nonexistent/nvidia-smi'),
            '/nonexistent/nvidia-smi not found: is the NVIDIA driver installed? (set vllm_kimi_nvidia_smi_path, or '
            'vllm_kimi_preflight_gpus to plan without GPUs)',
        ),
        (
            dict(gpu_memory_utilization=1.5),
            'vllm_kimi_gpu_memory_utilization must be more than 0 and at most 1, got 1.5',
        ),
        (
            dict(setting_names=dict(ROLE_NAMES, max_len='x')),
            'setting_names maps max_len, which is no option of this module',
        ),
    ],
)
def test_setting_names_put_the_callers_names_in_refusals(tmp_path, model, args, message, module_result):
    rc, r = module_result('gpu_preflight', dict(dict(setting_names=ROLE_NAMES, model_path=model), **args))
    assert rc == 1
    assert r['msg'] == message


def test_misfit_without_failing_picks_the_length_that_fits(tmp_path, model, module_result):
    rc, r = module_result(
        'gpu_preflight',
        dict(model_path=model, gpus=RTX, weights_bytes_per_gpu=TIGHT, max_model_len=4096, fail_on_misfit=False),
    )
    assert rc == 0
    assert (r['max_model_len'], r['max_model_len_fit'], r['fits'], r['problems']) == (1024, 1024, False, [])


NOTHING_FITS = (
    'No context length fits: the KV cache budget of 1 bytes per GPU holds not one block of 16 tokens (16384 bytes).'
)


@pytest.mark.parametrize(
    'config, args, message',
    [
        # The KV cache would take 0 or fewer bytes a token: it "fit" with kv_cache_tokens 0.
        (
            {'model_type': 'deepseek_v3', 'num_hidden_layers': 2, 'max_position_embeddings': 4096},
            {},
            'config.json has no kv_lora_rank: cannot size the KV cache',
        ),
        (dict(LLAMA, head_dim=-64), {}, 'config.json: head_dim is -64, where an integer of at least 1 was expected'),
        # A budget short of one block: auto chose max_model_len 0 and the module succeeded.
        (LLAMA, dict(kv_cache_memory_bytes=1), NOTHING_FITS),
        (LLAMA, dict(kv_cache_memory_bytes=1, fail_on_misfit=False), NOTHING_FITS),
        (LLAMA, dict(kv_cache_memory_bytes=1, max_model_len=16), NOTHING_FITS),
    ],
)
def test_nothing_fits_is_never_a_fit(tmp_path, model, config, args, message, module_result):
    with open(os.path.join(model, 'config.json'), 'w') as f:
        json.dump(config, f)
    args = dict(dict(model_path=model, accelerator='cpu', kv_cache_memory_bytes=GIB, max_model_len='auto'), **args)
    rc, r = module_result('gpu_preflight', args)
    assert (rc, r['msg']) == (1, message)
    assert r.get('fits', False) is False


def test_cpu_accelerator(tmp_path, model, module_result):
    rc, r = module_result(
        'gpu_preflight', dict(model_path=model, accelerator='cpu', kv_cache_memory_bytes=1048576, max_model_len='auto')
    )
    assert rc == 0, r
    assert (r['gpus'], r['kv_cache_tokens'], r['max_model_len'], r['max_model_len_fit']) == ([], 1024, 1024, 1024)
    assert warning_texts(r) == ["max_model_len auto: 1024 tokens fit, below the model's 4096"]


def test_a_recorded_measurement_of_the_same_key_sets_the_plan(tmp_path, model, module_result):
    args = dict(model_path=model, accelerator='cpu', kv_cache_memory_bytes=1048576, max_model_len='auto')
    rc, first = module_result('gpu_preflight', dict(args, measurements_dir=str(tmp_path / 'none-yet')))
    assert rc == 0 and first['kv_cache_tokens_source'] == 'predicted', first
    measured = tmp_path / 'measurements'
    measured.mkdir()
    record = {'memory_key_id': first['memory_key_id'], 'startup': {'kv_tokens': 960, 'kv_cache_device': 'CPU'}}
    (measured / ('%s.json' % first['memory_key_id'])).write_text(json.dumps(record))
    # Passed over: a file named for another key, one that is not JSON, and a link.
    (measured / ('%s.json' % ('0' * 16))).write_text(json.dumps(dict(record, memory_key_id='1' * 16)))
    (measured / 'broken.json').write_text('{"memory_key_id": ')
    (measured / 'link.json').symlink_to(measured / ('%s.json' % first['memory_key_id']))
    rc, second = module_result('gpu_preflight', dict(args, measurements_dir=str(measured)))
    assert rc == 0, second
    assert (second['kv_cache_tokens_source'], second['kv_cache_tokens'], second['max_model_len_fit']) == (
        'measured',
        960,
        960,
    )
    assert second['predicted']['kv_cache_tokens'] == 1024
    assert second['measured'] == record


MLA_FP8 = {
    'model_type': 'deepseek_v3',
    'num_hidden_layers': 3,
    'kv_lora_rank': 64,
    'qk_rope_head_dim': 32,
    'num_attention_heads': 4,
    'num_key_value_heads': 4,
    'head_dim': 64,
    'hidden_size': 256,
    'max_position_embeddings': 4096,
    'dtype': 'bfloat16',
}
HF_QUANT_FP8 = {
    'producer': {'name': 'modelopt', 'version': '0.29.0'},
    'quantization': {'quant_algo': 'NVFP4', 'group_size': 16, 'kv_cache_quant_algo': 'FP8', 'exclude_modules': []},
}


@pytest.mark.parametrize(
    'policy, stripped, dtypes, per_token',
    [
        ('auto', True, ('bfloat16', 'bfloat16'), 576),
        # ModelOpt's FP8 resolves to fp8_e4m3; the record only says "FP8", which vLLM's plain fp8 means too.
        ('keep', False, ('fp8_e4m3', 'fp8'), 288),
    ],
)
def test_decision_is_taken_on_the_checkpoint_as_shipped(tmp_path, policy, stripped, dtypes, per_token, module_result):
    """After kv_cache_quant stripped the FP8 KV cache, the next preflight must decide the same (not restore it)."""
    model = tmp_path / 'mla'
    model.mkdir()
    (model / 'config.json').write_text(json.dumps(MLA_FP8, indent=2) + '\n')
    (model / 'hf_quant_config.json').write_text(json.dumps(HF_QUANT_FP8, indent=2) + '\n')
    args = dict(
        model_path=str(model),
        tensor_parallel_size=1,
        gpus=RTX,
        weights_bytes_per_gpu=GIB,
        kv_cache_memory_bytes=576 * 1024,
        max_model_len=512,
        fp8_kv_cache_policy=policy,
    )
    rc, before = module_result('gpu_preflight', args)
    assert rc == 0, before
    rc, strip_result = module_result('kv_cache_quant', {'path': str(model), 'state': 'absent'})
    assert (rc, strip_result['changed']) == (0, True), strip_result
    assert json.loads((model / 'hf_quant_config.json').read_text())['quantization']['kv_cache_quant_algo'] is None
    rc, after = module_result('gpu_preflight', args)
    assert rc == 0, after
    for result, dtype in zip((before, after), dtypes):
        assert (result['strip_fp8_kv_cache'], result['fp8_kv_cache_stripped']) == (True, stripped)
        assert (result['kv_cache_dtype'], result['kv_cache_bytes_per_token']) == (dtype, per_token)
    assert after['kv_cache_dtype_source'].startswith(
        'the checkpoint as shipped asks for an FP8 KV cache (stripped earlier '
        'by llmserve.vllm.kv_cache_quant, see .llmserve-kv-cache-quant.json)'
    )


# ---------------------------------------------------------------- before the download, the headers from the Hub

HUB_TOKEN = 'preflight-hub-token'
HUB_CONFIG = dict(LLAMA, vocab_size=512, intermediate_size=512, tie_word_embeddings=False)


@pytest.fixture
def staged(tmp_path):
    """A two-shard checkpoint published on the fake Hub (token required), and a model_path with only its config and
    weights index, as the role stages it before the weights are fetched."""
    from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._tensor_layout import checkpoint_tensors
    from ansible_collections.llmserve.vllm.tools import fake_hub

    source = tmp_path / 'source'
    source.mkdir()
    (source / 'config.json').write_text(json.dumps(HUB_CONFIG))
    tensors = sorted(checkpoint_tensors(HUB_CONFIG).items())
    shards = {'model-00001-of-00002.safetensors': tensors[::2], 'model-00002-of-00002.safetensors': tensors[1::2]}
    weight_map = {}
    for shard, members in shards.items():
        header, offset = {}, 0
        for name, nbytes in members:
            header[name] = {'dtype': 'BF16', 'shape': [nbytes // 2], 'data_offsets': [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = shard
        raw = json.dumps(header).encode()
        with open(str(source / shard), 'wb') as f:
            f.write(len(raw).to_bytes(8, 'little') + raw)
            f.truncate(8 + len(raw) + offset)
    index = json.dumps({'metadata': {'total_size': sum(nbytes for name, nbytes in tensors)}, 'weight_map': weight_map})
    (source / 'model.safetensors.index.json').write_text(index)
    commit = fake_hub.publish(str(tmp_path / 'hub'), 'org/tiny', str(source))
    staged = tmp_path / 'staged'
    staged.mkdir()
    for name in ('config.json', 'model.safetensors.index.json'):
        (staged / name).write_bytes((source / name).read_bytes())
    server = fake_hub.FakeHub(str(tmp_path / 'hub'), token=HUB_TOKEN).start()
    yield str(source), str(staged), dict(repo_id='org/tiny', revision=commit, endpoint=server.url), server
    server.stop()


H200_PAIR = [{'name': 'NVIDIA H200', 'memory_total_mib': 143771, 'compute_capability': '9.0'}] * 2


def test_before_the_download_the_hub_headers_size_every_tensor(staged, module_result):
    """The plan from the shards' headers read over byte ranges is the plan once the shards are there, byte for byte;
    the token reaches the Hub and no output."""
    source, model, hub, server = staged
    args = dict(FIT, gpus=H200_PAIR, reserve_bytes_per_gpu=5 * GIB)
    rc, before = module_result('gpu_preflight', dict(args, model_path=model, hub=dict(hub, token=HUB_TOKEN)))
    assert rc == 0, before
    assert before['weights_source'] == 'hub'
    ranges = [asked for method, path, asked in server.requests if '/resolve/' in path]
    assert sorted(ranges)[:2] == ['bytes=0-7', 'bytes=0-7'] and len(ranges) == 4
    rc, after = module_result('gpu_preflight', dict(args, model_path=source))
    assert rc == 0, after
    assert after['weights_source'] == 'headers'
    for key in ('weights_bytes_per_gpu', 'weights_margin_bytes_per_gpu', 'kv_cache_bytes', 'kv_cache_tokens'):
        assert before[key] == after[key], key
    assert HUB_TOKEN not in json.dumps(before)


def test_headers_the_hub_refuses_leave_the_prediction_and_say_why(staged, module_result):
    model, hub = staged[1:3]
    rc, r = module_result('gpu_preflight', dict(FIT, gpus=H200_PAIR, model_path=model, hub=dict(hub, token='wrong')))
    assert rc == 0, r
    assert r['weights_source'] == 'config'
    (warning,) = [w for w in warning_texts(r) if 'Hub' in w]
    assert warning.startswith("the shards' headers could not be read from the Hub, so the weights are predicted: ")
    assert '401' in warning and 'wrong' not in warning


# ---------------------------------------------------------------- nothing on the host yet: the plan from the Hub revision

PLAN_FIGURES = (
    'weights_bytes_total',
    'weights_bytes_per_gpu',
    'weights_margin_bytes_per_gpu',
    'reserve_bytes_per_gpu',
    'kv_cache_dtype',
    'kv_cache_bytes_per_token',
    'kv_cache_bytes',
    'kv_cache_tokens',
    'max_model_len',
    'memory_key_id',
)


def test_an_indexed_revision_with_nothing_local_is_planned_as_with_its_files(tmp_path, staged, module_result):
    """A model_path that does not exist yet: config, index and headers come from the Hub in memory, the plan equals
    the plan of the downloaded checkpoint figure for figure, and nothing is created on the host."""
    source, hub, server = staged[0], staged[2], staged[3]
    absent = tmp_path / 'models' / 'org--tiny' / hub['revision']
    args = dict(FIT, gpus=H200_PAIR)
    rc, before = module_result('gpu_preflight', dict(args, model_path=str(absent), hub=dict(hub, token=HUB_TOKEN)))
    assert rc == 0, before
    assert (before['changed'], before['config_source'], before['weights_source']) == (False, 'hub', 'hub')
    rc, after = module_result('gpu_preflight', dict(args, model_path=source))
    assert rc == 0, after
    assert (after['config_source'], after['weights_source']) == ('local', 'headers')
    assert dict((k, before[k]) for k in PLAN_FIGURES) == dict((k, after[k]) for k in PLAN_FIGURES)
    assert not (tmp_path / 'models').exists()
    assert HUB_TOKEN not in json.dumps(before)
    # The shards' headers only, never a whole shard.
    shard_requests = [ranged for method, path, ranged in server.requests if path.endswith('.safetensors')]
    assert len(shard_requests) == 4 and all(shard_requests)


@pytest.fixture
def single_file_hub(tmp_path, model):
    """The model fixture's checkpoint (config.json and one model.safetensors, no index) on the fake Hub."""
    from ansible_collections.llmserve.vllm.tools import fake_hub

    commit = fake_hub.publish(str(tmp_path / 'hub'), 'org/single', model)
    server = fake_hub.FakeHub(str(tmp_path / 'hub'), token=HUB_TOKEN).start()
    yield dict(repo_id='org/single', revision=commit, endpoint=server.url)
    server.stop()


def test_a_single_file_revision_with_nothing_local_is_planned_from_its_header(
    tmp_path, model, single_file_hub, module_result
):
    absent = tmp_path / 'rev'
    args = dict(FIT, gpus=H200_PAIR)
    rc, before = module_result(
        'gpu_preflight', dict(args, model_path=str(absent), hub=dict(single_file_hub, token=HUB_TOKEN))
    )
    assert rc == 0, before
    assert (before['config_source'], before['weights_source'], before['weights_bytes_total']) == ('hub', 'hub', 262144)
    rc, after = module_result('gpu_preflight', dict(args, model_path=model))
    assert rc == 0, after
    assert dict((k, before[k]) for k in PLAN_FIGURES) == dict((k, after[k]) for k in PLAN_FIGURES)
    assert not absent.exists()


@pytest.mark.parametrize(
    'hub, message',
    [
        (
            dict(revision='0' * 40, token=HUB_TOKEN),
            '{endpoint}/org/single/resolve/{revision}/config.json answered HTTP 404: no revision {revision} in '
            'org/single (the Hub says: Invalid rev id: {revision})',
        ),
        (
            dict(),
            '{endpoint}/org/single/resolve/{revision}/config.json answered HTTP 401: the repository is private or '
            'gated: set hub.token to a token that has access to org/single '
            '(the Hub says: Invalid credentials in Authorization header)',
        ),
        (
            dict(token='not-' + HUB_TOKEN),
            '{endpoint}/org/single/resolve/{revision}/config.json answered HTTP 401: the token in hub.token was refused '
            '(the Hub says: Invalid credentials in Authorization header)',
        ),
    ],
    ids=['no-revision', 'gated-without-token', 'token-refused'],
)
def test_a_config_the_hub_does_not_give_fails_naming_url_and_cause(
    tmp_path, single_file_hub, hub, message, module_result
):
    absent = tmp_path / 'rev'
    option = dict(single_file_hub, **hub)
    rc, r = module_result('gpu_preflight', dict(FIT, gpus=H200_PAIR, model_path=str(absent), hub=option))
    assert (rc, r['msg']) == (1, message.format(**option))
    assert HUB_TOKEN not in json.dumps(r)
    assert not absent.exists()


def test_without_hub_a_missing_model_path_is_still_refused(tmp_path, module_result):
    rc, r = module_result('gpu_preflight', dict(FIT, gpus=H200_PAIR, model_path=str(tmp_path / 'rev')))
    assert (rc, r['msg']) == (1, 'model_path %s does not exist' % (tmp_path / 'rev'))


def test_the_hubs_hf_quant_config_decides_the_kv_cache_as_the_local_one_does(tmp_path, module_result):
    from ansible_collections.llmserve.vllm.tools import fake_hub

    model = tmp_path / 'mla'
    model.mkdir()
    (model / 'config.json').write_text(json.dumps(MLA_FP8))
    (model / 'hf_quant_config.json').write_text(json.dumps(HF_QUANT_FP8))
    commit = fake_hub.publish(str(tmp_path / 'hub'), 'org/mla', str(model))
    server = fake_hub.FakeHub(str(tmp_path / 'hub')).start()
    try:
        args = dict(gpus=RTX, weights_bytes_per_gpu=GIB, kv_cache_memory_bytes=576 * 1024, max_model_len=512)
        args.update(fp8_kv_cache_policy='keep', _ansible_check_mode=True)
        hub = dict(repo_id='org/mla', revision=commit, endpoint=server.url)
        rc, before = module_result('gpu_preflight', dict(args, model_path=str(tmp_path / 'rev'), hub=hub))
    finally:
        server.stop()
    assert rc == 0, before
    rc, after = module_result('gpu_preflight', dict(args, model_path=str(model)))
    assert rc == 0, after
    assert (before['config_source'], after['config_source']) == ('hub', 'local')
    for key in ('kv_cache_dtype', 'kv_cache_dtype_source', 'kv_cache_bytes_per_token', 'strip_fp8_kv_cache'):
        assert before[key] == after[key], key
    assert before['kv_cache_dtype'] == 'fp8_e4m3'
