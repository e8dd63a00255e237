# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The deployment as Prometheus sees it, on the molecule sandbox host.

Debian trixie's Prometheus and bookworm's node_exporter run on the sandbox (molecule/default/prepare.yml);
playbooks/monitoring.yml pointed Prometheus at the vLLM endpoint and node_exporter, through its scrape config
file, and installed the alert rules. The tests ask Prometheus's HTTP API, as a dashboard would: vLLM's own
series and ours, with the values of the deployment's record, and the rules.

What Prometheus shows of a failed performance gate and of the good change after it is asserted with
those changes, in test_changes.py: each change is one deploy, and a deploy here costs a vLLM start.
"""

import json
import os
import re

import pytest
import requests
import yaml
from sandbox_helpers import REPO, Prometheus, ours

DEPLOYMENTS = '/var/lib/llmserve-vllm/vllm-kimi/deployments'
DASHBOARD = os.path.join(REPO, 'roles', 'vllm_monitoring', 'files', 'llmserve-vllm-dashboard.json')
ALERTS = {
    'LlmserveGateFailed',
    'LlmservePerfGateFailed',
    'LlmserveRolledBack',
    'VllmServiceRestarting',
    'VllmKvCacheNearlyFull',
    'VllmTimeToFirstTokenHigh',
    'VllmEndpointDown',
    'VllmRequestsQueueing',
    'VllmPreempting',
    'LlmserveMetricsUnreadable',
    # NVIDIA's GPU exporter's (DCGM): loaded here too, with no GPU target to read.
    'GpuXidError',
    'GpuUncorrectableMemoryErrors',
    'GpuThermalThrottling',
    'GpuTemperatureHigh',
    'GpuExporterDown',
}


@pytest.fixture(scope='module')
def prometheus(sandbox):
    return Prometheus(int(sandbox.vars['sandbox_prometheus_port']))


def record(sandbox):
    return json.loads(sandbox.sh('cat %s/last-good/record.json' % DEPLOYMENTS))


def test_prometheus_scrapes_the_endpoint_and_its_node_exporter(prometheus):
    up = prometheus.wait('both targets up', 'up', lambda r: len(r) == 2 and all(v == 1 for v in r.values()))
    # The sandbox runs the CPU build: no GPU targets, so llmserve_gpu has none to be up.
    assert {dict(labels)['job'] for labels in up} == {'llmserve_vllm', 'llmserve_node'}
    running = prometheus.query('vllm:num_requests_running')
    assert running and all(dict(labels)['job'] == 'llmserve_vllm' for labels in running)
    assert prometheus.query('vllm:kv_cache_usage_perc')


def test_the_scrape_jobs_are_the_roles_scrape_config_file(sandbox, prometheus):
    """prometheus.yml names no job of its own (prepare.yml): the targets are there through the role's file alone."""
    assert 'scrape_configs' not in yaml.safe_load(sandbox.sh('cat /etc/prometheus/prometheus.yml'))
    reply = requests.get(prometheus.url + '/targets', params={'state': 'active'}, timeout=10)
    reply.raise_for_status()
    active = reply.json()['data']['activeTargets']
    assert sorted((target['scrapePool'], target['scrapeUrl'].split(':')[0]) for target in active) == [
        ('llmserve_node', 'http'),
        ('llmserve_vllm', 'https'),
    ]


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
        'llmserve_node',
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


# The series an alert's expression reads: vLLM's, the role's, node_exporter's and Prometheus's own; not a quoted
# label value such as the job "llmserve_vllm". The GPU exporter's DCGM series have no target here.
SERIES = re.compile(r'(?<!")\b(?:vllm:[a-z_:]+|llmserve_[a-z_]+|node_[a-z_]+|process_start_time_seconds|up)\b')


def test_every_series_an_alert_reads_is_scraped(prometheus):
    """A rule over a series no scrape gives never fires: each one the rules name has samples here."""
    reply = requests.get(prometheus.url + '/rules', timeout=10).json()
    read = {
        name for group in reply['data']['groups'] for rule in group['rules'] for name in SERIES.findall(rule['query'])
    }
    assert {'vllm:num_requests_waiting', 'vllm:num_preemptions_total', 'node_textfile_scrape_error', 'up'} <= read
    assert sorted(name for name in read if not prometheus.query(name)) == []


def dashboard_queries():
    with open(DASHBOARD) as f:
        panels = json.load(f)['panels']
    return [
        pytest.param(panel['title'], target['expr'], id='%s %s' % (panel['title'], target['refId']))
        for panel in panels
        for target in panel['targets']
    ]


def test_the_dashboard_is_where_grafana_would_provision_it(sandbox):
    installed = sandbox.sh(
        'cat %s/llmserve-vllm-dashboard.json' % sandbox.vars['vllm_monitoring_grafana_dashboards_dir']
    )
    with open(DASHBOARD) as f:
        assert json.loads(installed) == json.load(f)


@pytest.mark.parametrize(('title', 'expr'), dashboard_queries())
def test_every_dashboard_query_returns_series_for_the_deployed_service(sandbox, prometheus, title, expr):
    """As Grafana would ask it, with its service variable set to the sandbox's service."""
    query = expr.replace('$service', sandbox.vars['vllm_kimi_service_name'])
    assert prometheus.query(query), (title, query)
