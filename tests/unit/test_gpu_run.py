# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The GPU run's harness without the device (tools/gpu_run; docs/testing.md, "A recorded run on a real GPU").

The synthetic checkpoint the device generates has exactly the headers the preflight plans from here, and call 3
joins, checks and unpacks the payload's parts as they were packed. What the device calls recorded
(tests/fixtures/gpu_run: start logs, the gates' HTTP exchanges and results, the plans served) is judged again here:
chat_check's verdicts on the recorded answers, the start ledger on the real logs, the preflight's prediction.
"""

import io
import json
import os
import sys

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import resolve_kv_cache_dtype
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import scan
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._chat_check import ChatCheck, CheckFailed
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._startup_log import startup_figures
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._gpu_preflight import plan as preflight_plan
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._reserve import estimate
from ansible_collections.llmserve.vllm.tests.support import REPO, recorded

sys.path.insert(0, os.path.join(REPO, 'tools', 'gpu_run'))
import device  # noqa: E402
import synthetic  # noqa: E402

GPU_RUN = 'gpu_run'


def recorded_json(name):
    return json.loads(recorded(GPU_RUN, name))


def test_the_synthetic_fixture_is_the_generators_output():
    """The headers the preflight reads here are those of the checkpoint generated on the device."""
    described = synthetic.describe(synthetic.config(synthetic.LAYERS, synthetic.EXPERTS))
    assert described == recorded_json('synthetic-checkpoint.json')


def test_the_header_only_shards_hold_the_described_headers(tmp_path):
    """What the preflight reads here (the sparse shards) is, tensor for tensor, what the device generates."""
    described = recorded_json('synthetic-checkpoint.json')
    synthetic.write_headers(tmp_path, described['config'])
    for shard, content in described['shards'].items():
        path = tmp_path / shard
        with path.open('rb') as source:
            size = int.from_bytes(source.read(8), 'little')
            header = json.loads(source.read(size))
        assert [[n, h['shape'], h['dtype']] for n, h in header.items()] == content['tensors']
        assert path.stat().st_size == 8 + size + content['data_bytes']


def parts_of(tmp_path, payload):
    """A site packed and split as payload.py packs it, parts 1 and 2 in the device's ~/stage, 3 beside device.py."""
    import hashlib
    import lzma
    import tarfile

    site, here, stage = tmp_path / 'site', tmp_path / 'here', tmp_path / 'stage'
    for folder in (site / 'vllm', here, stage):
        folder.mkdir(parents=True)
    (site / 'vllm' / '__init__.py').write_text(payload)
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode='w') as archive:
        archive.add(site, arcname='.')
    whole = lzma.compress(packed.getvalue(), preset=9)
    (here / 'SHA256SUMS').write_text('%s  site.tar.xz\n' % hashlib.sha256(whole).hexdigest())
    third = len(whole) // 3 + 1
    for part, folder in ((1, stage), (2, stage), (3, here)):
        (folder / ('part-%d' % part)).write_bytes(whole[(part - 1) * third : part * third])
    return here, stage


def test_call_3_joins_checks_and_unpacks_the_parts(tmp_path, monkeypatch):
    here, stage = parts_of(tmp_path, 'VERSION = "0.26.0"\n')
    monkeypatch.setattr(device, 'HERE', here)
    monkeypatch.setattr(device, 'STAGE', stage)
    monkeypatch.setattr(device, 'SITE', tmp_path / 'unpacked')
    device.unpack()
    assert (tmp_path / 'unpacked' / 'vllm' / '__init__.py').read_text() == 'VERSION = "0.26.0"\n'


def test_call_3_refuses_parts_that_do_not_make_the_whole(tmp_path, monkeypatch):
    here, stage = parts_of(tmp_path, 'VERSION = "0.26.0"\n')
    (stage / 'part-2').write_bytes(b'left from another payload')
    monkeypatch.setattr(device, 'HERE', here)
    monkeypatch.setattr(device, 'STAGE', stage)
    monkeypatch.setattr(device, 'SITE', tmp_path / 'unpacked')
    with pytest.raises(SystemExit, match=r'^the joined parts in .*/stage have sha256 [0-9a-f]{64}, SHA256SUMS says'):
        device.unpack()
    assert not (tmp_path / 'unpacked').exists()


def log_figures(name):
    return startup_figures(recorded(GPU_RUN, name).splitlines())


def test_the_start_ledger_of_vllm_0_26_on_an_h100():
    """The synthetic checkpoint's eager start (vLLM 0.26.0's CUDA build, one H100 80GB HBM3): every figure the ledger
    reads, from the log as the process wrote it."""
    assert log_figures('synthetic-eager-start.log') == {
        'weights_gib': 55.39,
        'available_kv_gib': 11.27,
        'kv_tokens': 2625920,
        'max_concurrency': 20.03,
        'cudagraph_gib': 0.0,
        'weights_seconds': 10.865409,
        'weights_read_seconds': 10.68,
        'engine_init_seconds': 14.31,
        'weights_gib_per_second': 5.186,
        'kv_cache_device': 'GPU',
        'backends': [
            'FLASH_ATTN_MLA attention',
            'FLASH_ATTN MLA prefill',
            'TRITON Unquantized MoE',
            'TritonExperts MoE',
        ],
    }


def test_tiny_kimi_finds_no_mla_prefill_backend_on_sm90():
    """vLLM 0.26.0's only MLA prefill backend on SM90 without FlashInfer takes DeepSeek's head sizes (128 + 64, 128),
    and the miniature's are 64 + 64, 64: its start fails before loading, with the decode backend chosen."""
    log = recorded(GPU_RUN, 'tiny-start.log')
    assert 'ValueError: No valid MLA prefill backend found' in log
    assert log_figures('tiny-start.log') == {'backends': ['FLASH_ATTN_MLA attention']}
    assert recorded_json('tiny-results.json')['stop'] == {
        'signal': None,
        'exit_code': 1,
        'stop_seconds': 0.0,
        'killed_after_grace': False,
    }


def synthetic_plan(tmp_path):
    """The role's plan for the H100 recomputed by the preflight as it is now, from what the recorded plan was made of
    (tests/fixtures/gpu_run/synthetic-eager-plan.json: its memory key, its GPU and the checkpoint's headers)."""
    recorded_plan = recorded_json('synthetic-eager-plan.json')['preflight']
    key = recorded_plan['memory_key']
    config = recorded_json('synthetic-checkpoint.json')['config']
    synthetic.write_headers(tmp_path, config)
    params = dict(
        tensor_parallel_size=key['tensor_parallel_size'],
        pipeline_parallel_size=key['pipeline_parallel_size'],
        gpu_memory_utilization=key['gpu_memory_utilization'],
        max_model_len=recorded_plan['max_model_len'],
        kv_cache_dtype='auto',
        block_size=key['block_size'],
        multimodal=key['multimodal'],
        accelerator='nvidia',
        vllm_version=key['given']['package'].split('==')[1],
        memory_key=key['given'],
        fail_on_misfit=True,
    )
    dtype = resolve_kv_cache_dtype('auto', str(tmp_path), config)
    return preflight_plan(params, config, scan(str(tmp_path)), recorded_plan['gpus'], [], dtype)


def test_the_preflight_predicts_the_kv_cache_vllm_reported_within_3_percent(tmp_path):
    """The plan for the H100 against the GPU KV cache size vLLM 0.26.0 logged there. The plan recorded on the day
    predicted 1,937,376 tokens (-26.2 %); docs/preflight-accuracy.md, "A real GPU", says which terms moved."""
    assert recorded_json('synthetic-eager-plan.json')['preflight']['predicted']['kv_cache_tokens'] == 1937376
    r = synthetic_plan(tmp_path)
    logged = log_figures('synthetic-eager-start.log')['kv_tokens']
    assert (r['weights_source'], r['weights_margin_bytes_per_gpu']) == ('headers', 0)
    assert (r['reserve']['cuda_graphs'], r['reserve']['driver']) == (0, int(481 * 2**20 * 0.9))
    assert abs(r['kv_cache_tokens'] - logged) / logged <= 0.03, (r['kv_cache_tokens'], logged)


def test_the_reserve_of_vllm_0_26_on_the_h100_is_the_profile_vllm_logged():
    """vLLM 0.26.0 printed 4.38 GiB of peak activation: the sampler's dummy run (1,024 x 163,840 logits at 14 bytes
    and the Triton buffer of 132 rows) with the batch's hidden states, over the Triton experts' workspace."""
    config = recorded_json('synthetic-checkpoint.json')['config']
    parts = estimate(config, 1, 0.9, 81559 * 2**20, vllm_version='0.26.0', gpu_name='NVIDIA H100 80GB HBM3', eager=True)
    sampler = 1024 * 163840 * 14 + 132 * 163840 * 4 + 2 * 1024 * 7168 * 2 + 8192 * 7168 * 2
    workspace = 2 * 8192 * 8 * 7168 * 2
    assert parts['activation'] == sampler + workspace
    assert round(parts['activation'] / 2**30, 2) == 4.15  # vLLM: 4.38; what is not derived is named in the docs


# The arguments chat_check's constructor takes from the gate's (the rest are the transport's: socket, key).
CHAT_CHECK_ARGUMENTS = (
    'url',
    'model',
    'prompt',
    'expect',
    'max_tokens',
    'timeout',
    'interval',
    'extra_body',
    'expect_reasoning',
    'tool_call',
    'long_prompt',
    'stream',
)


def replayed_chat_check(plan, gate, doctor=None):
    """chat_check's verdict on what the server answered on the device: the gate's arguments as the role rendered
    them (tests/fixtures/gpu_run/<plan>-gates.json), each request held to the one sent there and answered with what
    the server answered (DOCTOR may change an answer first)."""
    exchanges = recorded_json('%s-%s-exchanges.json' % (plan, gate))
    arguments = recorded_json('%s-gates.json' % plan)[gate]

    def http(method, path, payload, timeout, limit):
        entry = exchanges.pop(0)
        assert (method, path, payload) == (entry['method'], entry['path'], entry['payload'])
        return entry['status'], doctor(path, entry['text']) if doctor else entry['text']

    check = ChatCheck(
        http,
        api_key_set=True,
        sleep=lambda seconds: None,
        **{k: arguments[k] for k in CHAT_CHECK_ARGUMENTS if k in arguments},
    )
    verdict = check.run()
    assert exchanges == [], 'the check asked less than it asked on the device'
    return verdict


MINIATURE_PLANS = ('miniature-eager', 'miniature')
PARIS = 'The capital of France is Paris.'


@pytest.mark.parametrize('plan', MINIATURE_PLANS)
def test_the_miniature_answers_the_role_gates_on_an_h200(plan):
    """tiny-kimi-gpu served by vLLM 0.26.0's CUDA build with the role's argv, eager and compiled: chat_check's
    verdicts on the recorded answers are those of the run (thinking on with the tool gate, thinking off, the long
    prompt)."""
    coherence = replayed_chat_check(plan, 'coherence')
    assert (coherence['answer'], coherence['reasoning']) == (PARIS, 'The user asks for the capital of France.')
    assert coherence['tool_call']['name'] == 'get_weather'
    assert coherence['tool_call']['arguments'] == {'city': 'Paris'}
    assert coherence['tool_call']['finish_reason'] == 'tool_calls'
    for gate in ('thinking_off', 'long_prompt'):
        verdict = replayed_chat_check(plan, gate)
        assert (verdict['answer'], verdict['reasoning']) == (PARIS, None)
    assert replayed_chat_check(plan, 'long_prompt')['prompt_tokens'] == 397
    results = recorded_json('%s-results.json' % plan)
    assert [results[gate].get('failed', False) for gate in ('coherence', 'thinking_off', 'long_prompt')] == [False] * 3


@pytest.mark.parametrize(
    'gate, wrong, right, message',
    [
        ('coherence', 'Lyon', 'Paris', 'did not match'),
        ('coherence', '"arguments":"Lyon"', '"arguments":"Paris"', 'city'),
        ('thinking_off', 'Lyon', 'Paris', 'did not match'),
    ],
)
def test_the_recorded_verdicts_turn_on_the_answers(gate, wrong, right, message):
    """The same exchanges with the answer or the tool call's city changed fail the gate."""
    with pytest.raises(CheckFailed, match=message):
        replayed_chat_check('miniature', gate, doctor=lambda path, text: text.replace(right, wrong))


def test_the_miniature_serves_the_load_probe_and_stops_gracefully():
    """load_probe against the compiled server (4 clients, 10 s, 128 tokens a request), then SIGTERM as systemd
    sends it: every request answered, the process group gone in well under --shutdown-timeout, exit 0."""
    for plan in MINIATURE_PLANS:
        results = recorded_json('%s-results.json' % plan)
        probe = results['load_probe']
        assert (probe['failed_requests'], probe['errors']) == (0, [])
        assert probe['output_tokens'] == 128 * probe['requests']
        assert results['stop']['signal'] == 'SIGTERM'
        assert (results['stop']['exit_code'], results['stop']['killed_after_grace']) == (0, False)
        assert results['stop']['stop_seconds'] < 5
    eager, compiled = (recorded_json('%s-results.json' % plan)['load_probe'] for plan in MINIATURE_PLANS)
    assert compiled['output_tokens_per_second'] > 3 * eager['output_tokens_per_second']


def test_the_start_ledger_of_the_miniature_compiled_on_an_h200():
    """The role's own start (torch.compile and CUDA graphs) on one H200: every figure the ledger reads."""
    assert 'NVIDIA H200, 143771, 0, 9.0, 580.159.04' in recorded(GPU_RUN, 'device-h200.txt')
    assert recorded_json('miniature-results.json')['gpu_model'] == 'h200'
    assert log_figures('miniature-start.log') == {
        'weights_gib': 0.04,
        'available_kv_gib': 125.27,
        'kv_tokens': 38919600,
        'max_concurrency': 4750.93,
        'cudagraph_gib': 0.19,
        'compile_seconds': 13.25,
        'graph_capture_seconds': 5.0,
        'weights_seconds': 0.338162,
        'weights_read_seconds': 0.02,
        'engine_init_seconds': 24.22,
        'weights_gib_per_second': 2.0,
        'kv_cache_device': 'GPU',
        'backends': [
            'FLASH_ATTN_MLA attention',
            'FLASH_ATTN MLA prefill',
            'TRITON Unquantized MoE',
            'TritonExperts MoE',
        ],
    }
    eager = log_figures('miniature-eager-start.log')
    assert (eager['kv_tokens'], eager['cudagraph_gib'], 'compile_seconds' in eager) == (38968752, 0.0, False)


@pytest.mark.parametrize('plan', MINIATURE_PLANS)
def test_the_preflight_predicts_the_miniatures_kv_cache_on_an_h200(plan):
    """The role's plan for the H200 against vLLM's `GPU KV cache size`: a weights-free case, where the reserve alone
    makes the difference (38,990,176 predicted; 38,968,752 eager and 38,919,600 with CUDA graphs)."""
    predicted = recorded_json('%s-plan.json' % plan)['preflight']['kv_cache_tokens']
    reported = log_figures('%s-start.log' % plan)['kv_tokens']
    assert abs(predicted - reported) / reported < 0.003
