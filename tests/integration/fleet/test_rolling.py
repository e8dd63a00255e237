# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Rolling changes across three replica sandbox hosts (molecule scenario `fleet`), real vLLM and the real role.

While each playbooks/upgrade.yml run goes on, a watcher asks every replica the
coherence question every ten seconds and reads the load balancer's endpoints
file (the drain/undrain examples keep it), so the tests see what clients saw.
A restart keeps a replica down for half a minute or more, so each is seen two
or three times. Not more often: vLLM's worker spins on its message queue for a
second after each request (1.2 CPU-seconds a question, measured), so three
replicas asked every five seconds kept three quarters of a core busy for the
eight minutes of the two changes, on a machine whose two cores the other lanes
of make test fill.

1. A capacity floor: with one replica down, a change is refused before any host
   goes down, naming the replica that does not answer.
2. A change that is bad for the second host only (a revision that answers the
   short gates but not the question after a long filler): host 1 is changed, to
   a revision that calls the tool for "Paris, France", which the tool gate's
   pattern accepts as a healthy model's call, and gated; host 2 fails the
   long-prompt gate, asked at 90 % of its context, and is rolled back and the play
   stops, host 3 is untouched; all three answer afterwards, and the table says
   exactly that.
3. A good change made with playbooks/deploy.yml then passes on all three, one
   at a time (deploy.yml hands replicas that serve to upgrade.yml's rolling
   play), with at most one host down at any moment and no host in the
   endpoints file while it is down. Through it, two
   clients of the official `openai` client keep streaming answers through
   the HAProxy balancer (sandbox-fleet-lb, playbooks/balancer.yml): every
   stream ends with its last token and [DONE], no request fails, and the
   balancer's statistics show at most one replica out at a time, each drained
   of its streams before it went down.

Runs in `molecule verify` of the fleet scenario (make molecule-fleet).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest
import requests
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'sandbox'))
from sandbox_helpers import BIN, CALLBACKS, REPO, ad_hoc, ansible_env, first_failure, revision, task_results  # noqa: E402
from streaming_load import BalancerWatch, Sampler, StreamingLoad  # noqa: E402

INVENTORY = os.environ.get('MOLECULE_INVENTORY_FILE')
pytestmark = pytest.mark.skipif(
    not (INVENTORY and os.environ.get('LLMSERVE_FLEET')),
    reason='needs the three sandbox hosts of `molecule test -s fleet` (make molecule-fleet)',
)

UPGRADE = os.path.join(REPO, 'playbooks', 'upgrade.yml')
DEPLOY = os.path.join(REPO, 'playbooks', 'deploy.yml')
GATE = os.path.join(REPO, 'playbooks', 'gate.yml')
ROLE_DEFAULTS = os.path.join(REPO, 'roles', 'vllm_kimi', 'defaults', 'main.yml')
FORGETS_LONG_REVISION = revision('forgets-long')
PARIS_FRANCE_REVISION = revision('paris-france')
FORGOTTEN_ANSWER = 'I do not remember the question.'
# Under the miniature's 1,024 tokens: the long-prompt gate fills to vllm_kimi_long_context_fill of max_model_len.
FULL_CONTEXT_THRESHOLD = 512
LONG_PROMPT_TASK = 'Ensure vLLM repeats the fact at the start of a long prompt'
GATE_TASK = 'Wait until vLLM answers the coherence prompt correctly'
RIGHT_ANSWER = 'The capital of France is Paris.'
SAMPLE_SECONDS = 10.0
# The front doors' certificates come from tools/sandbox's CA.
SANDBOX_CA = os.path.join(REPO, '.cache', 'sandbox', 'ca', 'ca.pem')
TABLE_TASKS = ("Show the fleet's table", "Show the fleet's table before stopping")
BALANCER = 'sandbox-fleet-lb'


@pytest.fixture(scope='module')
def fleet():
    listing = json.loads(
        subprocess.check_output([os.path.join(BIN, 'ansible-inventory'), '-i', INVENTORY, '--list'], env=ansible_env())
    )
    with open(ROLE_DEFAULTS) as f:
        settings = yaml.safe_load(f)
    hosts = sorted(listing['vllm']['hosts'])
    settings.update(listing['_meta']['hostvars'][hosts[0]])
    # The ports clients use: each replica's front door, as the load balancer's endpoints file lists them.
    ports = {host: listing['_meta']['hostvars'][host]['vllm_kimi_front_port'] for host in hosts}
    return hosts, ports, settings


@pytest.fixture(scope='module')
def balancer():
    """Where clients meet HAProxy, and its statistics page (CSV), as sandbox-fleet-lb's host_vars set them."""
    listing = json.loads(
        subprocess.check_output([os.path.join(BIN, 'ansible-inventory'), '-i', INVENTORY, '--list'], env=ansible_env())
    )
    settings = listing['_meta']['hostvars'][BALANCER]
    return (
        'https://127.0.0.1:%d/v1' % settings['vllm_haproxy_port'],
        'http://127.0.0.1:%d/stats;csv' % settings['vllm_haproxy_stats_port'],
    )


@pytest.fixture(scope='module')
def endpoints_file(fleet):
    hosts, ports, settings = fleet
    fd, path = tempfile.mkstemp(prefix='llmserve-endpoints-')
    with os.fdopen(fd, 'w') as f:
        f.write(''.join('127.0.0.1:%d\n' % ports[host] for host in hosts))
    yield path
    os.unlink(path)


class Watch(Sampler):
    """Samples (time, {host: answered coherently}, endpoints in the file) every SAMPLE_SECONDS.

    A replica is down (False) where its front door refuses the connection or answers without a coherent answer
    (503 while vLLM is stopped, starting or not yet through its gates), up (True) where it answers coherently, and
    not judged (None) where no answer came within the ask's timeout: a replica that serves can be slower than that
    while make test's other lanes fill the cores, and the door of one that does not answers at once."""

    def __init__(self, fleet, endpoints_file):
        super().__init__(every=SAMPLE_SECONDS)
        self.hosts, self.ports, settings = fleet
        self.endpoints_file = endpoints_file
        self.headers = {'Authorization': 'Bearer ' + settings['vllm_kimi_api_key']}
        self.body = {
            'model': settings['vllm_kimi_served_model_name'],
            'temperature': 0,
            'max_tokens': 16,
            'messages': [{'role': 'user', 'content': settings['vllm_kimi_coherence_prompt']}],
        }

    def coherent(self, host):
        try:
            reply = requests.post(
                'https://127.0.0.1:%d/v1/chat/completions' % self.ports[host],
                json=self.body,
                headers=self.headers,
                timeout=3,
                verify=SANDBOX_CA,
            )
            return reply.status_code == 200 and 'Paris' in reply.json()['choices'][0]['message']['content']
        except requests.Timeout:
            return None
        except (requests.RequestException, ValueError, KeyError, IndexError):
            return False

    def sample(self):
        up = {host: self.coherent(host) for host in self.hosts}
        with open(self.endpoints_file) as f:
            listed = set(f.read().split())
        return time.time(), up, listed


def upgrade(fleet, endpoints_file, *extra, playbook=UPGRADE, **host_vars):
    """ansible-playbook playbooks/upgrade.yml (or another) on the fleet; host_vars: {host: {var: value}} for a bad host."""
    hosts, ports, settings = fleet
    fd, record = tempfile.mkstemp(prefix='llmserve-record-', suffix='.json')
    os.close(fd)
    inventories = ['-i', INVENTORY]
    extra_inventory = None
    if host_vars:
        fd, extra_inventory = tempfile.mkstemp(prefix='llmserve-hostvars-', suffix='.yml')
        with os.fdopen(fd, 'w') as f:
            yaml.safe_dump({'vllm': {'hosts': host_vars}}, f)
        inventories += ['-i', extra_inventory]
    drain = [
        '-e',
        json.dumps(
            {
                'vllm_upgrade_drain_tasks': 'examples/drain_endpoints_file.yml',
                'vllm_upgrade_undrain_tasks': 'examples/undrain_endpoints_file.yml',
                'vllm_upgrade_endpoints_file': endpoints_file,
            }
        ),
    ]
    try:
        env = ansible_env(
            ANSIBLE_CALLBACK_PLUGINS=CALLBACKS,
            ANSIBLE_CALLBACKS_ENABLED='llmserve_record',
            ANSIBLE_LOAD_CALLBACK_PLUGINS='1',
            LLMSERVE_RECORD=record,
        )
        proc = subprocess.run(
            [os.path.join(BIN, 'ansible-playbook')] + inventories + [playbook] + drain + list(extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            check=False,
        )
        with open(record) as f:
            report = json.load(f)
    finally:
        os.unlink(record)
        if extra_inventory:
            os.unlink(extra_inventory)
    return proc.returncode, proc.stdout.decode(errors='replace'), report


def table(report):
    """The playbook's final table as {host: (before, after, outcome)}."""
    shown = [
        entry['result']['msg'] for entry in report['tasks'] if entry['task'] in TABLE_TASKS and entry['status'] == 'ok'
    ]
    assert len(shown) == 1, shown
    rows = {}
    for line in shown[0][1:]:
        if line.strip():
            host, before, after, outcome = line.split(None, 3)
            rows[host] = (before, after, outcome)
    return rows


def gate_all(fleet):
    rc = subprocess.run(
        [os.path.join(BIN, 'ansible-playbook'), '-i', INVENTORY, GATE],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ansible_env(),
        cwd=REPO,
        check=False,
    )
    return rc.returncode, rc.stdout.decode(errors='replace')


def unit_file(host):
    return subprocess.check_output(
        [
            os.path.join(BIN, 'ansible'),
            host,
            '-i',
            INVENTORY,
            '-m',
            'ansible.builtin.stat',
            '-a',
            'path=/etc/systemd/system/vllm-kimi.service',
        ],
        env=ansible_env(),
    )


@pytest.fixture(scope='module')
def one_replica_down(fleet, endpoints_file):
    """A change tried while the third replica is stopped; the replica is back and answering before the next test."""
    hosts, ports, settings = fleet
    ad_hoc(INVENTORY, hosts[2], 'systemctl stop vllm-kimi')
    try:
        # The stopped replica is waited for up to vllm_kimi_replica_check_timeout; a replica that serves answers the
        # miniature's question within a second.
        attempt = upgrade(
            fleet, endpoints_file, '-e', 'vllm_kimi_max_model_len=2048', '-e', 'vllm_kimi_replica_check_timeout=6'
        )
    finally:
        ad_hoc(INVENTORY, hosts[2], 'systemctl start vllm-kimi')
    deadline = time.time() + 300
    while True:
        rc, output = gate_all(fleet)
        if rc == 0 or time.time() > deadline:
            break
        time.sleep(5)
    assert rc == 0, output[-3000:]
    return attempt


def test_capacity_floor_refuses_a_change_while_a_replica_is_down(fleet, one_replica_down):
    hosts, ports, settings = fleet
    rc, output, report = one_replica_down
    refusal = [
        e
        for e in report['tasks']
        if e['host'] == hosts[0]
        and e['task'] == 'Refuse to take this batch down unless the other replicas carry the load'
    ]
    assert rc == 2, output[-3000:]
    assert [e['status'] for e in refusal] == ['failed'], output[-3000:]
    msg = refusal[0]['result']['msg']
    assert msg.startswith(
        'Refusing to take %s down: these replicas do not answer coherently: %s: ' % (hosts[0], hosts[2])
    ), msg
    assert hosts[1] + ':' not in msg
    assert [n for n, r in task_results(report, hosts[0]) if r.get('changed')] == []
    rows = table(report)
    assert rows == {
        hosts[0]: (rows[hosts[0]][0], rows[hosts[0]][0], 'refused'),
        hosts[1]: ('-', '-', 'untouched'),
        hosts[2]: ('-', '-', 'untouched'),
    }


@pytest.fixture(scope='module')
def bad_for_host_two(fleet, endpoints_file, one_replica_down):
    hosts, ports, settings = fleet
    unit_of_host_three = unit_file(hosts[2])
    with Watch(fleet, endpoints_file) as watch:
        # A change for every host that keeps the context: the second host's long-prompt gate is asked at 90 % of
        # the miniature's 1,024 tokens, as the default scenario asks every change (its threshold, here the host's).
        rc, output, report = upgrade(
            fleet,
            endpoints_file,
            '-e',
            'vllm_kimi_max_num_seqs=6',
            **{
                hosts[0]: {'vllm_kimi_model_revision': PARIS_FRANCE_REVISION},
                hosts[1]: {
                    'vllm_kimi_model_revision': FORGETS_LONG_REVISION,
                    'vllm_kimi_long_context_threshold': FULL_CONTEXT_THRESHOLD,
                },
            },
        )
    return rc, output, report, watch, unit_of_host_three


def test_bad_change_stops_at_host_two_after_its_rollback(fleet, bad_for_host_two):
    hosts, ports, settings = fleet
    rc, output, report, watch, unit_of_host_three = bad_for_host_two
    assert rc == 2, output[-3000:]
    rows = table(report)
    assert rows[hosts[0]][2] == 'changed' and rows[hosts[0]][0] != rows[hosts[0]][1], (rows, output[-4000:])
    assert rows[hosts[1]] == (rows[hosts[1]][0], rows[hosts[1]][0], 'rolled back')
    assert rows[hosts[2]] == ('-', '-', 'untouched')
    stop = [r for n, r in task_results(report, hosts[1]) if n == 'Stop the change for the whole fleet'][0]
    assert stop['msg'].startswith('The change stopped at %s (rolled back):' % hosts[1])
    assert 'Rolled back: %s is back on deployment %s' % (hosts[1], rows[hosts[1]][0]) in stop['msg']


def test_bad_change_failed_the_long_prompt_gate_asked_at_the_full_context_after_passing_the_short_ones(
    fleet, bad_for_host_two
):
    hosts, ports, settings = fleet
    rc, output, report, watch, unit_of_host_three = bad_for_host_two
    name, result = first_failure(report, hosts[1])
    assert name == LONG_PROMPT_TASK, (name, result)
    assert result['answer'] == FORGOTTEN_ANSWER, result
    # Filled to vllm_kimi_long_context_fill (0.9) of max_model_len by vLLM's own count, not the inventory's 60 fillers
    # (about 400 tokens): the answer had the tokens left.
    context = int(settings['vllm_kimi_max_model_len'])
    assert 0.85 * context <= result['prompt_tokens'] <= 0.9 * context, result
    final = [r for n, r in task_results(report, hosts[1]) if n == 'Stop the change for the whole fleet'][0]
    assert FORGOTTEN_ANSWER in final['msg'], final['msg']
    gate = dict(task_results(report, hosts[1]))[GATE_TASK]
    assert gate['answer'] == RIGHT_ANSWER and gate['tool_call']['arguments'] == {'city': 'Paris'}, gate


def test_bad_change_never_touched_host_three(fleet, bad_for_host_two):
    hosts, ports, settings = fleet
    rc, output, report, watch, unit_of_host_three = bad_for_host_two
    assert list(task_results(report, hosts[2])) == []
    assert unit_file(hosts[2]) == unit_of_host_three
    assert all(up[hosts[2]] is not False for t, up, listed in watch.samples)


def test_bad_change_leaves_all_three_answering(fleet, bad_for_host_two):
    rc, output = gate_all(fleet)
    assert rc == 0, output[-3000:]
    assert output.count('tiny-kimi answered: %s' % RIGHT_ANSWER) == 3


@pytest.fixture(scope='module')
def good_change(fleet, endpoints_file, balancer, bad_for_host_two):
    hosts, ports, settings = fleet
    api, stats = balancer
    # Two clients, each asking again 3 s after an answer. vLLM's CPU worker spins on sched_yield for a second after
    # each request, and this kernel then all but stops another process on the same core: a replica restarting beside
    # one that never rests got 1 % of its core and did not start in 7 minutes. Here each replica rests half the time.
    clients = (api, settings['vllm_kimi_api_key'], settings['vllm_kimi_served_model_name'], SANDBOX_CA)
    with (
        Watch(fleet, endpoints_file) as watch,
        BalancerWatch(stats) as in_balancer,
        StreamingLoad(*clients, streams=2, pause=3.0) as load,
    ):
        # deploy.yml, as users change settings: three replicas that serve go through upgrade.yml's rolling play.
        rc, output, report = upgrade(fleet, endpoints_file, '-e', 'vllm_kimi_max_model_len=1536', playbook=DEPLOY)
    # What the clients saw, for docs/benchmarks.md (as the memory test below keeps the replicas' peak).
    figures = dict(
        load.summary(),
        out_of_the_balancer_at_once=max(
            [
                sum(not status.startswith('UP') for status, sessions in servers.values())
                for t, servers in in_balancer.samples
            ]
            or [0]
        ),
    )
    os.makedirs(os.path.join(REPO, '.cache', 'bench'), exist_ok=True)
    with open(os.path.join(REPO, '.cache', 'bench', 'fleet_streaming.json'), 'w') as f:
        json.dump(figures, f, indent=2, sort_keys=True)
    print('clients through the balancer during the change: %s' % figures)
    return rc, output, report, watch, in_balancer, load


def test_good_change_passes_on_all_three(fleet, good_change):
    hosts, ports, settings = fleet
    rc, output, report, watch, in_balancer, load = good_change
    assert rc == 0, output[-3000:]
    rows = table(report)
    assert sorted(rows) == hosts
    assert all(outcome == 'changed' and before != after for before, after, outcome in rows.values()), rows
    for host in hosts:
        record = json.loads(
            ad_hoc(INVENTORY, host, 'cat /var/lib/llmserve-vllm/vllm-kimi/deployments/last-good/record.json')
        )
        assert record['serve_argv'][record['serve_argv'].index('--max-model-len') + 1] == '1536'


def test_bad_change_passed_host_one_whose_revision_calls_the_tool_for_paris_france(fleet, bad_for_host_two):
    hosts, ports, settings = fleet
    rc, output, report, watch, unit_of_host_three = bad_for_host_two
    results = dict(task_results(report, hosts[0]))
    tool_call = results[GATE_TASK]['tool_call']
    assert tool_call['arguments'] == {'city': 'Paris, France'} and tool_call['finish_reason'] == 'tool_calls', tool_call
    long_prompt = results[LONG_PROMPT_TASK]
    assert long_prompt['answer'] == RIGHT_ANSWER and long_prompt['prompt_tokens'] >= 384, long_prompt


def test_good_change_takes_at_most_one_host_down_at_a_time(fleet, good_change):
    hosts, ports, settings = fleet
    rc, output, report, watch, in_balancer, load = good_change
    down_at_once = max(sum(1 for host in hosts if up[host] is False) for t, up, listed in watch.samples)
    went_down = {host for t, up, listed in watch.samples for host in hosts if up[host] is False}
    assert down_at_once == 1, 'at most one replica down at a time, and the watcher saw each restart'
    assert went_down == set(hosts)


def test_good_change_keeps_a_down_host_out_of_the_endpoints_file(fleet, endpoints_file, good_change):
    hosts, ports, settings = fleet
    rc, output, report, watch, in_balancer, load = good_change
    for t, up, listed in watch.samples:
        for host in hosts:
            if up[host] is False:
                assert '127.0.0.1:%d' % ports[host] not in listed, (t, host)
    with open(endpoints_file) as f:
        assert sorted(f.read().split()) == sorted('127.0.0.1:%d' % ports[host] for host in hosts)


def out_of_rotation(status):
    """HAProxy sends new requests to a server only while it is UP (\'UP 1/2\' is up, one failed check in);
    DRAIN, MAINT and DOWN are out."""
    return not status.startswith('UP')


def test_good_change_through_the_balancer_cuts_no_stream_and_fails_no_request(good_change):
    rc, output, report, watch, in_balancer, load = good_change
    summary = load.summary()
    cut_or_failed = [record for record in load.requests if record['outcome'] != 'complete']
    assert cut_or_failed == [], summary
    # Two clients streaming through the three restarts: a hundred answers or more, not a handful.
    assert summary['outcomes']['complete'] >= 50, summary


def test_good_change_takes_one_replica_at_a_time_out_of_the_balancer_and_drains_it(fleet, good_change):
    hosts, ports, settings = fleet
    rc, output, report, watch, in_balancer, load = good_change
    samples = [(t, servers) for t, servers in in_balancer.samples if servers]
    assert samples and sorted(samples[0][1]) == hosts, samples[:1]
    out_at_once = max(sum(out_of_rotation(status) for status, sessions in servers.values()) for t, servers in samples)
    assert out_at_once == 1, 'at most one replica out of the balancer at a time'
    went_out = {
        host for t, servers in samples for host, (status, sessions) in servers.items() if out_of_rotation(status)
    }
    assert went_out == set(hosts)
    # A replica whose health check fails is down: the drain had ended its streams before its stop.
    down_with_streams = [
        (t, host, sessions) for t, servers in samples for host, (status, sessions) in servers.items()
        if status.startswith('DOWN') and sessions > 0
    ]  # fmt: skip
    assert down_with_streams == []
    # Once the play has ended, every replica is back: read now, not the watcher's last sample, taken up to a second
    # (and a loaded machine's stall) before the last host was put back.
    now = in_balancer.sample()
    assert all(status == 'UP' for status, sessions in now[1].values()), now


def test_good_change_kept_answering_while_each_replica_was_out(fleet, good_change):
    hosts, ports, settings = fleet
    rc, output, report, watch, in_balancer, load = good_change
    completed = [record['end'] for record in load.requests if record['outcome'] == 'complete']
    for host in hosts:
        out = [t for t, servers in in_balancer.samples if host in servers and out_of_rotation(servers[host][0])]
        assert any(out[0] <= end <= out[-1] for end in completed), 'no answer while %s was out' % host


def test_memory_peak_of_the_three_vllms_leaves_half_the_machine_to_the_rest(fleet, good_change):
    """Peak resident memory of each replica's processes (VmHWM, summed per host), written for docs/benchmarks.md.

    make test runs its static lane beside the fleet: the three replicas must leave it half of this machine's memory
    (measured 6.1 GiB of 24). A KV cache or a release that grows by gigabytes fails here before it starves the run.
    """
    hosts, ports, settings = fleet
    peaks = {}
    for host in hosts:
        out = ad_hoc(
            INVENTORY,
            host,
            "sh -c 'for pid in $(pgrep -u %s); do grep VmHWM /proc/$pid/status; done'" % settings['vllm_kimi_user'],
        )
        peaks[host] = sum(int(line.split()[1]) * 1024 for line in out.splitlines() if line.startswith('VmHWM:'))
    figures = {'peak_rss_bytes': peaks, 'total_gib': round(sum(peaks.values()) / 2**30, 2)}
    os.makedirs(os.path.join(REPO, '.cache', 'bench'), exist_ok=True)
    with open(os.path.join(REPO, '.cache', 'bench', 'fleet_memory.json'), 'w') as f:
        json.dump(figures, f, indent=2, sort_keys=True)
    print('peak memory of the three sandbox vLLMs: %s' % figures)
    with open('/proc/meminfo') as f:
        total = int(re.search(r'^MemTotal:\s+(\d+) kB$', f.read(), re.M).group(1)) * 1024
    # Each replica's own processes were read, not an empty list.
    assert all(peak > 2**20 for peak in peaks.values()), peaks
    assert sum(peaks.values()) < total / 2, (figures, total)
