# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_kimi's node_exporter textfile (templates/metrics.prom.j2), rendered by Ansible as the role renders it, for a
passed change, a rollback after a failed load probe and a first deploy that failed: every sample exactly, and the
file through `promtool check metrics`, Prometheus's own linter of the exposition format."""

import subprocess

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO, run_local_play

TEMPLATE = REPO + '/roles/vllm_kimi/templates/metrics.prom.j2'
with open(REPO + '/roles/vllm_kimi/vars/main.yml') as role_vars:
    START_PHASES = yaml.safe_load(role_vars)['_vllm_kimi_start_phases']
RELEASE = {'release': '0123456789ab', 'vllm_version': '0.32.0', 'model_revision': '5eed' + '0' * 35 + '1'}
GATE = {'elapsed': 21.5, 'healthy_after': 19.25, 'tokens_per_second': 41.7}
PERF = {
    'requests': 96,
    'output_tokens_per_second': 455.2,
    'time_to_first_token': {'p50': 0.38, 'p95': 1.49, 'max': 1.55},
    'time_per_output_token': {'p50': 0.011, 'p95': 0.02, 'max': 0.03},
}
SERVICE = 'service="vllm-kimi"'

CASES = {
    'passed': dict(passed=True, gate=GATE, serving=RELEASE, perf=PERF, rollbacks={'total': 2, 'last': 1796000000}),
    'rolled back': dict(
        passed=False,
        gate=GATE,
        serving=RELEASE,
        perf=dict(PERF, failed=True, output_tokens_per_second=90.0),
        rollbacks={'total': 3, 'last': 1796040000},
    ),
    'measured': dict(
        passed=True,
        gate=GATE,
        serving=dict(
            RELEASE,
            memory={
                'key_id': '3f1c2a9b8d7e6f50',
                'planned_from': 'predicted',
                'predicted': {'kv_cache_tokens': 201088},
                'measured': {'kv_tokens': 212000, 'available_kv_gib': 14.2},
            },
        ),
        perf={},
        rollbacks={'total': 0, 'last': 0},
    ),
    # A start on eight GPUs as Kimi-K2.6's was logged (tests/fixtures/startup_logs), its ledger in the record.
    'ledger': dict(
        passed=True,
        gate=GATE,
        serving=dict(
            RELEASE,
            start={
                'weights_seconds': 48.817523,
                'weights_gib': 71.16,
                'weights_gib_per_second': 1.458,
                'compile_seconds': 43.51,
                'graph_capture_seconds': 4.0,
                'engine_init_seconds': 97.94,
                'api_ready_seconds': 181.2,
            },
        ),
        perf={},
        rollbacks={'total': 0, 'last': 0},
    ),
    'first deploy failed': dict(
        passed=False,
        gate={'elapsed': 3.2, 'healthy_after': None},
        serving={},
        perf={},
        rollbacks={'total': 0, 'last': 0},
    ),
}


def render(tmp_path, case):
    out = tmp_path / 'llmserve_vllm_kimi.prom'
    rendered = {
        'vllm_kimi_service_name': 'vllm-kimi',
        '_metrics_gate_passed': case['passed'],
        '_metrics_gate': case['gate'],
        '_metrics_serving': case['serving'],
        '_metrics_perf': case['perf'],
        '_metrics_rollbacks': case['rollbacks'],
        '_vllm_kimi_start_phases': START_PHASES,
    }
    rc, output = run_local_play(
        tmp_path, [{'ansible.builtin.template': {'src': TEMPLATE, 'dest': str(out), 'mode': '0644'}}], rendered
    )
    assert rc == 0, output
    return out.read_text()


def samples(text):
    """{series: value} of the exposition text."""
    found = {}
    for line in text.splitlines():
        if line and not line.startswith('#'):
            series, value = line.rsplit(' ', 1)
            assert series not in found, 'duplicate series %s' % series
            found[series] = float(value)
    return found


@pytest.mark.parametrize('name', CASES)
def test_promtool_accepts_the_textfile(tmp_path, promtool, name):
    text = render(tmp_path, CASES[name])
    proc = subprocess.run([promtool, 'check', 'metrics'], input=text, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr


def test_a_passed_change(tmp_path):
    found = samples(render(tmp_path, CASES['passed']))
    last_run = found.pop('llmserve_gate_last_run_timestamp_seconds{%s}' % SERVICE)
    assert last_run > 1.7e9
    assert found == {
        'llmserve_gate_success{%s}' % SERVICE: 1.0,
        'llmserve_gate_duration_seconds{%s}' % SERVICE: 21.5,
        'llmserve_gate_time_to_healthy_seconds{%s}' % SERVICE: 19.25,
        'llmserve_gate_output_tokens_per_second{%s}' % SERVICE: 41.7,
        'llmserve_release_info{%s,release="0123456789ab",vllm_version="0.32.0",model_revision="%s"}'
        % (SERVICE, RELEASE['model_revision']): 1.0,
        'llmserve_rollbacks_total{%s}' % SERVICE: 2.0,
        'llmserve_rollback_last_timestamp_seconds{%s}' % SERVICE: 1796000000.0,
        'llmserve_perf_gate_success{%s}' % SERVICE: 1.0,
        'llmserve_perf_gate_output_tokens_per_second{%s}' % SERVICE: 455.2,
        'llmserve_perf_gate_time_to_first_token_seconds{%s,quantile="0.5"}' % SERVICE: 0.38,
        'llmserve_perf_gate_time_to_first_token_seconds{%s,quantile="0.95"}' % SERVICE: 1.49,
        'llmserve_perf_gate_time_per_output_token_seconds{%s,quantile="0.5"}' % SERVICE: 0.011,
        'llmserve_perf_gate_time_per_output_token_seconds{%s,quantile="0.95"}' % SERVICE: 0.02,
        'llmserve_perf_gate_time_to_first_token_seconds_count{%s}' % SERVICE: 96.0,
        'llmserve_perf_gate_time_per_output_token_seconds_count{%s}' % SERVICE: 96.0,
    }


def test_a_rollback_after_a_slow_change(tmp_path):
    found = samples(render(tmp_path, CASES['rolled back']))
    assert found['llmserve_gate_success{%s}' % SERVICE] == 0
    assert found['llmserve_perf_gate_success{%s}' % SERVICE] == 0
    assert found['llmserve_perf_gate_output_tokens_per_second{%s}' % SERVICE] == 90.0
    assert found['llmserve_rollbacks_total{%s}' % SERVICE] == 3
    assert found['llmserve_rollback_last_timestamp_seconds{%s}' % SERVICE] == 1796040000
    # What serves after the rollback.
    assert [series for series in found if series.startswith('llmserve_release_info')] == [
        'llmserve_release_info{%s,release="0123456789ab",vllm_version="0.32.0",model_revision="%s"}'
        % (SERVICE, RELEASE['model_revision'])
    ]


def test_the_predicted_and_the_measured_kv_cache_are_two_series_and_the_error_a_third(tmp_path):
    found = samples(render(tmp_path, CASES['measured']))
    assert found['llmserve_kv_cache_tokens{%s,source="predicted"}' % SERVICE] == 201088
    assert found['llmserve_kv_cache_tokens{%s,source="measured"}' % SERVICE] == 212000
    assert found['llmserve_kv_cache_prediction_error_ratio{%s}' % SERVICE] == round((201088 - 212000) / 212000, 6)
    # A record without vLLM's figures (passed, rolled back above) has none of the three.
    assert not [series for series in samples(render(tmp_path, CASES['passed'])) if 'kv_cache' in series]


def test_a_starts_ledger_is_a_series_per_phase_it_logged(tmp_path):
    found = samples(render(tmp_path, CASES['ledger']))
    assert {series: value for series, value in found.items() if series.startswith('llmserve_start_')} == {
        'llmserve_start_phase_seconds{%s,phase="weights"}' % SERVICE: 48.817523,
        'llmserve_start_phase_seconds{%s,phase="compile"}' % SERVICE: 43.51,
        'llmserve_start_phase_seconds{%s,phase="graph_capture"}' % SERVICE: 4.0,
        'llmserve_start_phase_seconds{%s,phase="engine_init"}' % SERVICE: 97.94,
        'llmserve_start_phase_seconds{%s,phase="api_ready"}' % SERVICE: 181.2,
        'llmserve_start_weights_gib_per_second{%s}' % SERVICE: 1.458,
    }
    # A record without a ledger (an earlier release's) has none.
    assert not [series for series in samples(render(tmp_path, CASES['passed'])) if 'llmserve_start_' in series]


def test_a_failed_first_deploy_has_no_release_and_no_load_figures(tmp_path):
    found = samples(render(tmp_path, CASES['first deploy failed']))
    found.pop('llmserve_gate_last_run_timestamp_seconds{%s}' % SERVICE)
    assert found == {
        'llmserve_gate_success{%s}' % SERVICE: 0.0,
        'llmserve_gate_duration_seconds{%s}' % SERVICE: 3.2,
        'llmserve_rollbacks_total{%s}' % SERVICE: 0.0,
        'llmserve_rollback_last_timestamp_seconds{%s}' % SERVICE: 0.0,
    }
