# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the recorded run on a real GPU says (tests/fixtures/gpu_run; docs/testing.md, "A recorded run on a real GPU").

vLLM 0.26.0's CUDA build served tiny-kimi and a synthetic DeepSeek-V3-shaped checkpoint on the lent H100 with the
role's own plan. Read here: the start ledger from its logs, the preflight's KV-cache prediction against the tokens vLLM
reported, and the gates' verdicts on the answers it gave, replayed through the modules.
"""

import io
import json
import os
import sys
from unittest import mock

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._startup_log import startup_figures
from ansible_collections.llmserve.vllm.tests.support import REPO, module_args, recorded

sys.path.insert(0, os.path.join(REPO, 'tools', 'gpu_run'))
import device  # noqa: E402
import synthetic  # noqa: E402

GPU_RUN = 'gpu_run'
# The preflight's KV-cache tokens may miss vLLM's by this much (issue 51's acceptance).
KV_LIMIT = 0.03


def lines(name):
    return recorded(GPU_RUN, name).splitlines()


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


def sparse_synthetic(directory):
    """The synthetic checkpoint as the preflight reads it: config.json, the index and header-only sparse shards."""
    config = recorded_json('synthetic-checkpoint.json')['config']
    synthetic.write_headers(directory, config)
    return str(directory)


def logged_kv_tokens(log_name):
    return startup_figures(lines(log_name))['kv_tokens']


@pytest.mark.parametrize('mode', ['eager', 'compiled'])
def test_the_preflight_predicts_the_kv_cache_vllm_reported(tmp_path, mode, module_result):
    """The role's preflight for the device's GPU, on the synthetic checkpoint's headers, against the GPU KV cache size
    vLLM 0.26.0 logged there: within 3 %."""
    plan = recorded_json('synthetic-%s-plan.json' % mode)
    gpu = plan['preflight']['gpus'][0]
    args = dict(
        model_path=sparse_synthetic(tmp_path / 'synthetic'),
        gpus=[{k: gpu[k] for k in ('name', 'memory_total_mib', 'compute_capability')}],
        tensor_parallel_size=1,
        max_model_len=int(plan['plan']['max_model_len']),
        gpu_memory_utilization=0.9,
        vllm_version='0.26.0',
        _ansible_check_mode=True,
    )
    rc, result = module_result('gpu_preflight', args)
    assert rc == 0, result
    logged = logged_kv_tokens('synthetic-%s-start.log' % mode)
    predicted = result['predicted']['kv_cache_tokens']
    assert abs(predicted - logged) / logged <= KV_LIMIT, (predicted, logged)


class Replay:
    """The HTTP transport of a recorded gate: each request gets the answer vLLM gave it on the device. The module's
    requests must be the recorded ones, in order (its /health and /v1/models polls answered as they last were)."""

    def __init__(self, exchanges):
        self.polls = {e['path']: e for e in exchanges if e['method'] == 'GET' and e.get('status') == 200}
        self.posts = [e for e in exchanges if e['method'] == 'POST']

    def __call__(self, method, path, payload, timeout, limit):
        if method == 'GET':
            return self.polls[path]['status'], self.polls[path]['text']
        exchange = self.posts.pop(0)
        assert (path, payload) == (exchange['path'], exchange['payload'])
        return exchange['status'], exchange['text']


def replayed_gate(name, capsys, edit=None):
    """chat_check's result on the recorded answers, with the arguments the role's gate task gave it."""
    from ansible_collections.llmserve.vllm.plugins.modules import chat_check

    args = {k: v for k, v in recorded_json('tiny-gates.json')[name].items() if v is not None}
    exchanges = recorded_json('tiny-%s-exchanges.json' % name)
    if edit:
        exchanges = json.loads(edit(json.dumps(exchanges)))
    replay = Replay(exchanges)
    with (
        module_args(args),
        mock.patch.object(chat_check, 'make_transport', lambda *a, **k: replay),
        pytest.raises(SystemExit),
    ):
        chat_check.main()
    return json.loads(capsys.readouterr().out)
