# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""playbooks/monitoring.yml (the vllm_monitoring role) on a local inventory: the file_sd target files and the scrape
jobs that read them exactly, four ways (check, check and diff, real, repeat), and its alert rules through promtool (check rules, test rules with
tests/unit/prometheus/llmserve_alerts_test.yml)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import fixture_path, free_port

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))
PLAYBOOK = os.path.join(ROOT, 'playbooks', 'monitoring.yml')
RULES_TEST = os.path.join(ROOT, 'tests', 'unit', 'prometheus', 'llmserve_alerts_test.yml')

# Two replicas (one without ansible_host and without a front door, on another port), a two-node model whose head is
# listed second in the vllm group (the cluster group's order decides, as in vllm_kimi) and whose front door has a
# URL of its own, and a host on IPv6 with its own service name. Behind a front door Prometheus scrapes HTTPS.
INVENTORY = {
    'prometheus': {'hosts': {'prom': {}}},
    'vllm': {
        'hosts': {
            'gpu-a': {'ansible_host': '10.0.0.1'},
            'gpu-b': {'vllm_kimi_port': 8001, 'vllm_kimi_front_door': False, 'vllm_kimi_accelerator': 'cpu'},
            'mn-worker': {
                'ansible_host': '10.0.1.2',
                'vllm_monitoring_node_exporter_port': 9101,
                'vllm_monitoring_gpu_exporter_port': 0,
            },
            'mn-head': {
                'ansible_host': '10.0.1.1',
                'vllm_kimi_front_url': 'https://kimi.example.org:9443',
                'vllm_monitoring_gpu_exporter_port': 9401,
            },
            'v6': {'ansible_host': 'fd00::5', 'vllm_kimi_service_name': 'vllm-other'},
        }
    },
    'kimi_mn': {'hosts': {'mn-head': {}, 'mn-worker': {}}, 'vars': {'vllm_kimi_cluster_group': 'kimi_mn'}},
}

EXPECTED_VLLM = [
    {
        'labels': {'__scheme__': 'https', 'env': 'test', 'replica': 'gpu-a', 'service': 'vllm-kimi'},
        'targets': ['10.0.0.1:8443'],
    },
    {'labels': {'env': 'test', 'replica': 'gpu-b', 'service': 'vllm-kimi'}, 'targets': ['gpu-b:8001']},
    {
        'labels': {
            '__scheme__': 'https',
            'cluster': 'kimi_mn',
            'env': 'test',
            'replica': 'mn-head',
            'service': 'vllm-kimi',
        },
        'targets': ['kimi.example.org:9443'],
    },
    {
        'labels': {'__scheme__': 'https', 'env': 'test', 'replica': 'v6', 'service': 'vllm-other'},
        'targets': ['[fd00::5]:8443'],
    },
]
# node_exporter targets carry no service label: the textfile metrics have their own.
EXPECTED_NODE = [
    {'labels': {'env': 'test', 'replica': 'gpu-a'}, 'targets': ['10.0.0.1:9100']},
    {'labels': {'env': 'test', 'replica': 'gpu-b'}, 'targets': ['gpu-b:9100']},
    {'labels': {'cluster': 'kimi_mn', 'env': 'test', 'replica': 'mn-worker'}, 'targets': ['10.0.1.2:9101']},
    {'labels': {'cluster': 'kimi_mn', 'env': 'test', 'replica': 'mn-head'}, 'targets': ['10.0.1.1:9100']},
    {'labels': {'env': 'test', 'replica': 'v6'}, 'targets': ['[fd00::5]:9100']},
]

# The DCGM exporter on every host with NVIDIA GPUs (vllm_kimi_accelerator's default), headless nodes included; gpu-b
# runs the CPU build and mn-worker's GPUs are watched otherwise (port 0).
EXPECTED_GPU = [
    {'labels': {'env': 'test', 'replica': 'gpu-a'}, 'targets': ['10.0.0.1:9400']},
    {'labels': {'cluster': 'kimi_mn', 'env': 'test', 'replica': 'mn-head'}, 'targets': ['10.0.1.1:9401']},
    {'labels': {'env': 'test', 'replica': 'v6'}, 'targets': ['[fd00::5]:9400']},
]


def run_playbook(directory, promtool, *args, inventory=None):
    """ansible-playbook playbooks/monitoring.yml on the local inventory, writing under directory: (rc, output)."""
    inventory_file = directory / 'hosts.json'
    hosts = json.loads(json.dumps(inventory or INVENTORY))
    hosts['prometheus']['hosts']['prom'] = {
        'ansible_connection': 'local',
        'ansible_python_interpreter': sys.executable,
        'ansible_become': False,
        'vllm_monitoring_file_sd_dir': str(directory / 'file_sd'),
        'vllm_monitoring_rules_dir': str(directory / 'rules'),
        'vllm_monitoring_scrape_config_dir': str(directory / 'scrape_configs'),
        'vllm_monitoring_promtool': promtool,
        'vllm_monitoring_prometheus_service': '',
        'vllm_monitoring_extra_labels': {'env': 'test'},
    }
    inventory_file.write_text(json.dumps(hosts))
    env = dict(
        os.environ,
        ANSIBLE_COLLECTIONS_PATH=os.path.join(ROOT, '.build', 'collections'),
        ANSIBLE_NOCOLOR='1',
        ANSIBLE_CONFIG=os.path.join(ROOT, 'ansible.cfg'),
    )
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), 'ansible-playbook'), '-i', str(inventory_file), PLAYBOOK, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        text=True,
        timeout=300,
        check=False,
    )
    return proc.returncode, proc.stdout


def recap(output):
    """The play recap of the Prometheus host: {'ok': n, 'changed': n, ...}."""
    line = re.search(r'^prom\s+:(.*)$', output, re.M).group(1)
    return {key: int(value) for key, value in re.findall(r'(\w+)=(\d+)', line)}


def read_json(path):
    with open(str(path)) as handle:
        return json.load(handle)


@pytest.fixture(scope='module')
def rendered(tmp_path_factory, promtool):
    """The playbook's files with the role's defaults: the directory they are in."""
    directory = tmp_path_factory.mktemp('monitoring')
    rc, output = run_playbook(directory, promtool)
    assert rc == 0, output
    return directory


def test_file_sd_lists_every_endpoint_node_and_gpu_exporter_exactly(rendered):
    assert sorted(os.listdir(str(rendered / 'file_sd'))) == [
        'llmserve-vllm-gpu.json',
        'llmserve-vllm-node.json',
        'llmserve-vllm-vllm.json',
    ]
    assert read_json(rendered / 'file_sd' / 'llmserve-vllm-vllm.json') == EXPECTED_VLLM
    assert read_json(rendered / 'file_sd' / 'llmserve-vllm-node.json') == EXPECTED_NODE
    assert read_json(rendered / 'file_sd' / 'llmserve-vllm-gpu.json') == EXPECTED_GPU


def test_check_diff_real_and_repeat(tmp_path, promtool):
    rc, output = run_playbook(tmp_path, promtool, '--check')
    assert rc == 0, output
    # The directories, the three target files, the rules, the scrape jobs: a loop's task counts once.
    assert recap(output)['changed'] == 4, output
    assert not (tmp_path / 'file_sd').exists()

    rc, output = run_playbook(tmp_path, promtool, '--check', '--diff')
    assert rc == 0, output
    for line in (
        '+      "[fd00::5]:8443"',
        '+      "10.0.1.2:9101"',
        '+  - name: llmserve',
        '+      - alert: VllmTimeToFirstTokenHigh',
        '+  - job_name: "llmserve_vllm"',
        '+      - alert: GpuXidError',
        '+      "10.0.1.1:9401"',
    ):
        assert line in output.splitlines(), line
    assert not (tmp_path / 'file_sd').exists()

    rc, output = run_playbook(tmp_path, promtool)
    assert rc == 0, output
    assert recap(output)['changed'] == 4, output
    assert read_json(tmp_path / 'file_sd' / 'llmserve-vllm-vllm.json') == EXPECTED_VLLM

    rc, output = run_playbook(tmp_path, promtool, '--diff')
    assert rc == 0, output
    assert recap(output)['changed'] == 0, output


def promtool_run(promtool, *args, cwd=None):
    return subprocess.run(
        [promtool, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
    )


def scrape_jobs(directory):
    with open(str(directory / 'scrape_configs' / 'llmserve.yml')) as handle:
        return yaml.safe_load(handle)


def test_the_scrape_jobs_read_every_groups_target_files(rendered, promtool):
    file_sd = str(rendered / 'file_sd')
    assert scrape_jobs(rendered) == {
        'scrape_configs': [
            {'job_name': 'llmserve_vllm', 'file_sd_configs': [{'files': [file_sd + '/llmserve-*-vllm.json']}]},
            {'job_name': 'llmserve_node', 'file_sd_configs': [{'files': [file_sd + '/llmserve-*-node.json']}]},
            {'job_name': 'llmserve_gpu', 'file_sd_configs': [{'files': [file_sd + '/llmserve-*-gpu.json']}]},
        ]
    }
    proc = promtool_run(promtool, 'check', 'config', str(rendered / 'scrape_configs' / 'llmserve.yml'))
    assert proc.returncode == 0, proc.stdout


def test_the_vllm_job_trusts_the_ca_file_and_an_empty_directory_writes_no_jobs(tmp_path, promtool):
    rc, output = run_playbook(
        tmp_path, promtool, '-e', json.dumps({'vllm_monitoring_ca_file': '/etc/ssl/llmserve-ca.pem'})
    )
    assert rc == 0, output
    assert scrape_jobs(tmp_path)['scrape_configs'][0]['tls_config'] == {'ca_file': '/etc/ssl/llmserve-ca.pem'}
    assert ['tls_config' in job for job in scrape_jobs(tmp_path)['scrape_configs']] == [True, False, False]

    other = tmp_path / 'other'
    other.mkdir()
    rc, output = run_playbook(other, promtool, '-e', json.dumps({'vllm_monitoring_scrape_config_dir': ''}))
    assert rc == 0, output
    assert sorted(os.listdir(str(other))) == ['file_sd', 'hosts.json', 'rules']


def test_a_missing_cluster_group_is_named(tmp_path, promtool):
    inventory = json.loads(json.dumps(INVENTORY))
    inventory['vllm']['hosts']['gpu-a']['vllm_kimi_cluster_group'] = 'nowhere'
    rc, output = run_playbook(tmp_path, promtool, inventory=inventory)
    assert rc == 2, output
    assert 'vllm_kimi_cluster_group names groups the inventory lacks: nowhere.' in output
    assert not (tmp_path / 'file_sd').exists()


def test_promtool_checks_the_rules(rendered, promtool):
    proc = promtool_run(promtool, 'check', 'rules', str(rendered / 'rules' / 'llmserve_alerts.yml'))
    assert proc.returncode == 0, proc.stdout
    assert 'SUCCESS: 15 rules found' in proc.stdout


def test_each_alert_fires_on_its_condition_and_not_otherwise(rendered, promtool):
    shutil.copy(RULES_TEST, str(rendered / 'rules'))
    proc = promtool_run(promtool, 'test', 'rules', 'llmserve_alerts_test.yml', cwd=str(rendered / 'rules'))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.split() == ['Unit', 'Testing:', 'llmserve_alerts_test.yml', 'SUCCESS']


def test_every_alert_is_unit_tested(rendered):
    with open(str(rendered / 'rules' / 'llmserve_alerts.yml')) as handle:
        alerts = {rule['alert'] for group in yaml.safe_load(handle)['groups'] for rule in group['rules']}
    with open(RULES_TEST) as handle:
        tests = yaml.safe_load(handle)['tests']
    firing = {case['alertname'] for test in tests for case in test['alert_rule_test'] if case['exp_alerts']}
    quiet = {case['alertname'] for test in tests for case in test['alert_rule_test'] if not case['exp_alerts']}
    assert (
        alerts
        == firing
        == quiet
        == {
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
            'GpuXidError',
            'GpuUncorrectableMemoryErrors',
            'GpuThermalThrottling',
            'GpuTemperatureHigh',
            'GpuExporterDown',
        }
    )


def test_thresholds_are_the_variables(tmp_path, promtool):
    rc, output = run_playbook(
        tmp_path,
        promtool,
        '-e',
        json.dumps(
            {
                'vllm_monitoring_kv_cache_usage_threshold': 0.9,
                'vllm_monitoring_kv_cache_for': '10m',
                'vllm_monitoring_ttft_p99_threshold_seconds': 2.5,
                'vllm_monitoring_ttft_window': '10m',
                'vllm_monitoring_ttft_for': '15m',
                'vllm_monitoring_restart_window': '1h',
                'vllm_monitoring_restart_count': 3,
                'vllm_monitoring_rollback_alert_seconds': 600,
                'vllm_monitoring_vllm_job': 'inference',
                'vllm_monitoring_node_job': 'hosts',
                'vllm_monitoring_endpoint_down_for': '45m',
                'vllm_monitoring_waiting_requests_threshold': 64,
                'vllm_monitoring_waiting_requests_for': '2m',
                'vllm_monitoring_preemption_window': '3m',
                'vllm_monitoring_preemption_for': '20m',
                'vllm_monitoring_textfile_error_for': '1h',
                'vllm_monitoring_runbook_url': 'https://runbooks.example/llm',
                'vllm_monitoring_gpu_job': 'gpus',
                'vllm_monitoring_gpu_temperature_threshold_celsius': 80,
                'vllm_monitoring_gpu_throttle_ratio': 0.25,
                'vllm_monitoring_gpu_for': '3m',
            }
        ),
    )
    assert rc == 0, output
    with open(str(tmp_path / 'rules' / 'llmserve_alerts.yml')) as handle:
        rules = {rule['alert']: rule for group in yaml.safe_load(handle)['groups'] for rule in group['rules']}
    assert {name: (rule['expr'], rule.get('for')) for name, rule in rules.items()} == {
        'LlmserveGateFailed': ('llmserve_gate_success == 0 unless on (instance, service) llmserve_release_info', None),
        'LlmservePerfGateFailed': ('llmserve_perf_gate_success == 0', None),
        'LlmserveRolledBack': (
            'increase(llmserve_rollbacks_total[600s]) > 0 or (time() - llmserve_rollback_last_timestamp_seconds) < 600',
            None,
        ),
        'VllmServiceRestarting': ('changes(process_start_time_seconds{job="inference"}[1h]) >= 3', None),
        'VllmKvCacheNearlyFull': ('vllm:kv_cache_usage_perc > 0.9', '10m'),
        'VllmTimeToFirstTokenHigh': (
            'histogram_quantile(0.99, sum without (engine) (rate(vllm:time_to_first_token_seconds_bucket[10m]))) > 2.5',
            '15m',
        ),
        'VllmEndpointDown': ('up{job="inference"} == 0', '45m'),
        'VllmRequestsQueueing': ('sum without (engine) (vllm:num_requests_waiting) > 64', '2m'),
        'VllmPreempting': ('sum without (engine) (rate(vllm:num_preemptions_total[3m])) > 0', '20m'),
        'LlmserveMetricsUnreadable': ('node_textfile_scrape_error{job="hosts"} > 0', '1h'),
        'GpuXidError': ('DCGM_FI_DEV_XID_ERRORS{job="gpus"} > 0', None),
        'GpuUncorrectableMemoryErrors': (
            'increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{job="gpus"}[3m]) > 0'
            ' or increase(DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{job="gpus"}[3m]) > 0'
            ' or DCGM_FI_DEV_ROW_REMAP_FAILURE{job="gpus"} > 0',
            None,
        ),
        'GpuThermalThrottling': ('rate(DCGM_FI_DEV_THERMAL_VIOLATION{job="gpus"}[5m]) / 1e6 > 0.25', '3m'),
        'GpuTemperatureHigh': ('DCGM_FI_DEV_GPU_TEMP{job="gpus"} > 80', '3m'),
        'GpuExporterDown': ('up{job="gpus"} == 0', '3m'),
    }
    assert {rule['annotations']['runbook_url'] for rule in rules.values()} == {
        'https://runbooks.example/llm#' + name.lower() for name in rules
    }


# prometheus.prometheus's own prometheus.yml with its defaults, which already has the jobs `prometheus` and `node`.
PROMETHEUS_PROMETHEUS = fixture_path('prometheus_prometheus', 'prometheus.yml')
DUPLICATE_NODE_JOB = 'found multiple scrape configs with job name "node"'


def estate_config(path, rendered, rename=None):
    """prometheus.prometheus's prometheus.yml with this role's jobs and rules, as that Prometheus loads them: its
    `scrape_config_files: [scrape_configs/*]` appends the jobs of the role's file to its own, written out here because
    Debian bookworm's promtool and Prometheus (2.42, `make promtool`) predate that key. rename: {job: new name}."""
    with open(PROMETHEUS_PROMETHEUS) as handle:
        config = yaml.safe_load(handle)
    assert config.pop('scrape_config_files') == ['scrape_configs/*']
    jobs = scrape_jobs(rendered)['scrape_configs']
    config['scrape_configs'] += [
        dict(job, job_name=(rename or {}).get(job['job_name'], job['job_name'])) for job in jobs
    ]
    config['rule_files'] = [str(rendered / 'rules' / 'llmserve_alerts.yml')]
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize(
    'rename, error',
    [({}, None), ({'llmserve_node': 'node'}, DUPLICATE_NODE_JOB)],
    ids=['role-defaults', 'the-old-default-node'],
)
def test_the_jobs_load_beside_prometheus_prometheus_defaults(rendered, promtool, tmp_path, rename, error):
    proc = promtool_run(promtool, 'check', 'config', estate_config(tmp_path / 'prometheus.yml', rendered, rename))
    assert (proc.returncode == 0) == (error is None), proc.stdout
    assert error is None or error in proc.stdout, proc.stdout


def prometheus_api(port, path, method='GET'):
    """(status, body) of Prometheus's HTTP API."""
    request = urllib.request.Request('http://127.0.0.1:%d%s' % (port, path), method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()
    except (urllib.error.URLError, ConnectionError) as unreachable:  # not listening yet
        return 0, str(unreachable)


@pytest.fixture
def prometheus(promtool, tmp_path):
    """A Prometheus (the one beside promtool) serving prometheus.prometheus's defaults alone, reloadable over HTTP."""
    binary = os.path.join(os.path.dirname(promtool), 'prometheus')
    assert os.access(binary, os.X_OK), 'no prometheus beside %s: run `make promtool`' % promtool
    config, port = tmp_path / 'prometheus.yml', free_port()
    with open(PROMETHEUS_PROMETHEUS) as handle:
        alone = yaml.safe_load(handle)
    alone.pop('scrape_config_files')
    config.write_text(yaml.safe_dump(alone))
    argv = [binary, '--config.file=%s' % config, '--storage.tsdb.path=%s' % (tmp_path / 'data')]
    argv += ['--web.listen-address=127.0.0.1:%d' % port, '--web.enable-lifecycle']
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while server.poll() is None and prometheus_api(port, '/-/ready')[0] != 200:
            assert time.monotonic() < deadline, 'Prometheus did not get ready in 60 s'
            time.sleep(0.2)
        assert server.poll() is None, 'Prometheus ended at its start'
        yield config, port
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_prometheus_reloads_onto_the_roles_jobs_beside_prometheus_prometheus_defaults(rendered, prometheus):
    """A real reload, as the role's handler asks one of a running Prometheus: the role's jobs and rules join
    prometheus.prometheus's; the old default job name `node` is refused and the running configuration kept."""
    config, port = prometheus
    estate_config(config, rendered, {'llmserve_node': 'node'})
    status, body = prometheus_api(port, '/-/reload', 'POST')
    assert (status, DUPLICATE_NODE_JOB in body) == (500, True), body
    estate_config(config, rendered)
    assert prometheus_api(port, '/-/reload', 'POST')[0] == 200
    loaded = yaml.safe_load(json.loads(prometheus_api(port, '/api/v1/status/config')[1])['data']['yaml'])
    jobs = [job['job_name'] for job in loaded['scrape_configs']]
    assert jobs == ['prometheus', 'node', 'llmserve_vllm', 'llmserve_node', 'llmserve_gpu']
    groups = json.loads(prometheus_api(port, '/api/v1/rules')[1])['data']['groups']
    assert [group['name'] for group in groups] == ['llmserve', 'llmserve_gpu']
