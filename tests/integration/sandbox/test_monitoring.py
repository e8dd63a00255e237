# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The deployment as Prometheus sees it, and the performance gate, on the molecule sandbox host.

Debian's Prometheus and node_exporter run on the sandbox (molecule/default/prepare.yml);
playbooks/monitoring.yml pointed Prometheus at the vLLM endpoint and node_exporter and
installed the alert rules. The tests ask Prometheus's HTTP API, as a dashboard would.

1. After the deploy: vLLM's own series and ours, with the values of the deployment's record.
2. A change to a model revision that answers exactly as the served one but does several times the
   work (tools/make_tiny_models.py's tiny-kimi-heavy): the coherence gate passes, the performance
   gate finds it far below the last good deployment's figure, the host is rolled back, and
   Prometheus shows the failed gates and one more rollback.
3. A change that costs no speed passes the performance gate against the last good figure.

The last change stays on the host (a lower scheduling priority, nothing else).
"""

import json
import time

import pytest
import requests
from sandbox_helpers import first_failure, revision, task_results

PERF_TASK = 'Measure the deployment under load and judge its throughput'
FINAL_TASK = 'Stop with the cause and where the host stands now'
DEPLOYMENTS = '/var/lib/llmserve-vllm/vllm-kimi/deployments'
ALERTS = {
    'LlmserveGateFailed',
    'LlmservePerfGateFailed',
    'LlmserveRolledBack',
    'VllmServiceRestarting',
    'VllmKvCacheNearlyFull',
    'VllmTimeToFirstTokenHigh',
}
# The heavy revision of the staged repository (inventories/sandbox): same answers, several times the work.
HEAVY_REVISION = revision('heavy')
HARMLESS = json.dumps({'vllm_kimi_service_settings': {'Nice': '1'}})


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


@pytest.fixture(scope='module')
def prometheus(sandbox):
    return Prometheus(int(sandbox.vars['sandbox_prometheus_port']))


def record(sandbox):
    return json.loads(sandbox.sh('cat %s/last-good/record.json' % DEPLOYMENTS))


def ours(name, sandbox):
    return '%s{service="%s"}' % (name, sandbox.unit)


def test_prometheus_scrapes_the_endpoint_and_its_node_exporter(prometheus):
    up = prometheus.wait('both targets up', 'up', lambda r: len(r) == 2 and all(v == 1 for v in r.values()))
    assert {dict(labels)['job'] for labels in up} == {'vllm', 'node'}
    running = prometheus.query('vllm:num_requests_running')
    assert running and all(dict(labels)['job'] == 'vllm' for labels in running)
    assert prometheus.query('vllm:kv_cache_usage_perc')


def test_prometheus_has_the_deployments_gate_release_and_load_figures(sandbox, prometheus):
    now = record(sandbox)
    release = prometheus.wait(
        'the release that serves',
        ours('llmserve_release_info', sandbox),
        lambda r: any(dict(labels)['release'] == now['release'] for labels in r),
    )
    assert len(release) == 1
    labels = dict(next(iter(release)))
    assert (labels['vllm_version'], labels['model_revision'], labels['job']) == (
        now['vllm_version'],
        now['model_revision'],
        'node',
    )
    assert prometheus.value(ours('llmserve_gate_success', sandbox)) == 1
    assert prometheus.value(ours('llmserve_gate_output_tokens_per_second', sandbox)) == pytest.approx(
        float(now['gate']['tokens_per_second'])
    )
    assert (
        0
        < prometheus.value(ours('llmserve_gate_time_to_healthy_seconds', sandbox))
        < prometheus.value(ours('llmserve_gate_duration_seconds', sandbox))
    )
    assert prometheus.value(ours('llmserve_perf_gate_success', sandbox)) == 1
    assert prometheus.value(ours('llmserve_perf_gate_output_tokens_per_second', sandbox)) == pytest.approx(
        now['perf']['output_tokens_per_second']
    )


def test_prometheus_loaded_the_alert_rules(prometheus):
    reply = requests.get(prometheus.url + '/rules', timeout=10).json()
    names = {rule['name'] for group in reply['data']['groups'] for rule in group['rules']}
    assert names == ALERTS


@pytest.fixture(scope='module')
def heavy_revision(sandbox, prometheus):
    before = {'record': record(sandbox), 'rollbacks': prometheus.value(ours('llmserve_rollbacks_total', sandbox)) or 0}
    rc, output, report = sandbox.deploy('-e', 'vllm_kimi_model_revision=' + HEAVY_REVISION)
    return before, rc, output, report


def test_heavy_revision_answers_correctly_but_fails_the_performance_gate(sandbox, heavy_revision):
    before, rc, output, report = heavy_revision
    results = dict(task_results(report, sandbox.name))
    assert rc != 0, output[-3000:]
    # The coherence gate passed: only the load showed the change was bad.
    assert 'Paris' in results['Wait until vLLM answers the coherence prompt correctly']['answer']
    perf = results[PERF_TASK]
    assert "below the previous release's" in perf['msg']
    assert perf['failed_requests'] == 0 and perf['requests'] > 0
    assert perf['baseline_tokens_per_second'] == pytest.approx(before['record']['perf']['output_tokens_per_second'])
    assert perf['regression_percent'] > 50
    task, result = first_failure(report, sandbox.name)
    assert task == PERF_TASK


def test_heavy_revision_is_rolled_back(sandbox, heavy_revision):
    before, rc, output, report = heavy_revision
    message = dict(task_results(report, sandbox.name))[FINAL_TASK]['msg']
    assert 'Rolled back: %s is back on deployment %s' % (sandbox.name, before['record']['deployment']) in message
    assert record(sandbox)['deployment'] == before['record']['deployment']
    assert HEAVY_REVISION not in sandbox.sh('systemctl cat %s' % sandbox.unit)
    assert record(sandbox)['model_revision'] == before['record']['model_revision']


def test_prometheus_shows_the_failed_gate_and_one_more_rollback(sandbox, prometheus, heavy_revision):
    before, rc, output, report = heavy_revision
    prometheus.wait(
        'the rollback counted',
        ours('llmserve_rollbacks_total', sandbox),
        lambda r: list(r.values()) == [before['rollbacks'] + 1],
    )
    assert prometheus.value(ours('llmserve_gate_success', sandbox)) == 0
    assert prometheus.value(ours('llmserve_perf_gate_success', sandbox)) == 0
    assert prometheus.value('time() - ' + ours('llmserve_rollback_last_timestamp_seconds', sandbox)) < 600
    # What serves is the release rolled back to.
    release = prometheus.query(ours('llmserve_release_info', sandbox))
    assert [dict(labels)['release'] for labels in release] == [before['record']['release']]


@pytest.fixture(scope='module')
def harmless_change(sandbox, heavy_revision):
    before = record(sandbox)
    rc, output, report = sandbox.deploy('-e', HARMLESS)
    return before, rc, output, report


def test_change_that_costs_no_speed_passes_against_the_last_good_figure(sandbox, prometheus, harmless_change):
    before, rc, output, report = harmless_change
    assert rc == 0, output[-3000:]
    perf = dict(task_results(report, sandbox.name))[PERF_TASK]
    assert perf['baseline_tokens_per_second'] == pytest.approx(before['perf']['output_tokens_per_second'])
    assert perf['regression_percent'] <= 50
    now = record(sandbox)
    assert now['deployment'] != before['deployment']
    assert now['perf']['output_tokens_per_second'] == pytest.approx(perf['output_tokens_per_second'])
    prometheus.wait('the gate passed again', ours('llmserve_gate_success', sandbox), lambda r: list(r.values()) == [1])
