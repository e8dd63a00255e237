# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the deploy left on the sandbox host, checked from outside (testinfra over SSH)."""

import json
import os
import re

import pytest
import requests
import testinfra.utils.ansible_runner
import yaml

testinfra_hosts = testinfra.utils.ansible_runner.AnsibleRunner(os.environ['MOLECULE_INVENTORY_FILE']).get_hosts('vllm')

# The unit's sandboxing, as `systemctl show` reports it.
HARDENING = [
    ('User', 'vllm'),
    ('NoNewPrivileges', 'yes'),
    ('CapabilityBoundingSet', ''),
    ('AmbientCapabilities', ''),
    ('ProtectSystem', 'strict'),
    ('ProtectHome', 'yes'),
    ('PrivateTmp', 'yes'),
    ('ProtectKernelTunables', 'yes'),
    ('ProtectKernelModules', 'yes'),
    ('ProtectKernelLogs', 'yes'),
    ('ProtectControlGroups', 'yes'),
    ('ProtectClock', 'yes'),
    ('ProtectHostname', 'yes'),
    ('ProtectProc', 'invisible'),
    ('RestrictNamespaces', 'yes'),
    ('RestrictRealtime', 'yes'),
    ('RestrictSUIDSGID', 'yes'),
    ('LockPersonality', 'yes'),
    ('SystemCallArchitectures', 'native'),
    # vLLM's Unix socket must be writable by its group, the front door's workers.
    ('UMask', '0007'),
    ('PrivateNetwork', 'yes'),
    ('DevicePolicy', 'closed'),
    ('RestrictAddressFamilies', 'AF_INET AF_INET6 AF_NETLINK AF_UNIX'),
]


# vLLM serves on its Unix socket: this machine asks through the front door, with the sandbox CA (tools/sandbox).
CA = os.path.join(os.environ.get('MOLECULE_PROJECT_DIRECTORY', '.'), '.cache', 'sandbox', 'ca', 'ca.pem')
ROLE_DEFAULTS = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'roles', 'vllm_kimi', 'defaults', 'main.yml')


@pytest.fixture(scope='module')
def hostvars(host):
    """The role's settings for this host: its defaults under the inventory's values."""
    with open(ROLE_DEFAULTS) as f:
        settings = yaml.safe_load(f)
    settings.update(host.ansible.get_variables())
    return settings


@pytest.fixture(scope='module')
def unit(hostvars):
    return hostvars['vllm_kimi_service_name']


def show(host, unit, *props):
    out = host.check_output('systemctl show %s ' + ' '.join('-p ' + p for p in props), unit)
    return dict(line.split('=', 1) for line in out.splitlines())


def journal_on_failure(host, unit):
    return host.run('journalctl -u %s --no-pager -n 40', unit).stdout


def test_unit_is_active_and_enabled(host, unit):
    service = host.service(unit)
    assert service.is_enabled, journal_on_failure(host, unit)
    assert service.is_running, journal_on_failure(host, unit)


def test_every_process_of_the_unit_runs_as_the_service_user(host, unit):
    rows = [line.split() for line in host.check_output('ps -eo pid=,user=,unit=,comm=').splitlines()]
    members = [row for row in rows if len(row) >= 3 and row[2] == unit + '.service']
    # The API server, its engine core and the engine's worker.
    assert len(members) >= 3, rows
    assert {row[1] for row in members} == {'vllm'}, members
    main = show(host, unit, 'MainPID')['MainPID']
    assert host.process.get(pid=int(main)).user == 'vllm'


@pytest.mark.parametrize('prop, expected', HARDENING)
def test_unit_hardening_property(host, unit, prop, expected):
    assert show(host, unit, prop)[prop] == expected


def test_unit_exposure_is_rated_ok(host, unit):
    out = host.check_output('systemd-analyze security %s --no-pager', unit)
    score = float(re.search(r'Overall exposure level for \S+: ([0-9.]+) (\w+)', out).group(1))
    assert score <= 2.0, out.splitlines()[-1]


def test_api_listens_on_its_unix_socket_and_no_port(host, hostvars, unit):
    socket_path = '/run/%s-api/vllm.sock' % unit
    # Bound in the unit's own network namespace (PrivateNetwork=yes), where ss must look; its path is reached from any.
    main_pid = show(host, unit, 'MainPID')['MainPID']
    listening = host.check_output('nsenter --target %s --net ss -lxpH', main_pid)
    assert socket_path in listening, 'vLLM does not listen on %s' % socket_path
    assert host.check_output('ss -ltnpH sport = :%d' % int(hostvars['vllm_kimi_port'])) == ''
    directory = host.file(os.path.dirname(socket_path))
    assert (directory.user, directory.group, directory.mode) == ('vllm', unit + '-api', 0o2750)


def ask(hostvars, question, api_key):
    headers = {'Authorization': 'Bearer ' + api_key} if api_key else {}
    return requests.post(
        'https://127.0.0.1:%s/v1/chat/completions' % hostvars['vllm_kimi_front_port'],
        json={
            'model': hostvars['vllm_kimi_served_model_name'],
            'temperature': 0,
            'max_tokens': 32,
            'messages': [{'role': 'user', 'content': question}],
        },
        headers=headers,
        timeout=30,
        verify=CA,
    )


def test_answer_is_coherent(hostvars):
    # The sandbox shares this machine's network, so the test asks like a client would: at the front door.
    reply = ask(hostvars, hostvars['vllm_kimi_coherence_prompt'], hostvars['vllm_kimi_api_key'])
    assert reply.status_code == 200, reply.text
    answer = reply.json()['choices'][0]['message']['content']
    assert re.search(hostvars['vllm_kimi_coherence_expect'], answer), answer
    assert answer == 'The capital of France is Paris.'


def test_api_refuses_a_request_without_the_key(hostvars):
    reply = ask(hostvars, hostvars['vllm_kimi_coherence_prompt'], None)
    assert reply.status_code == 401, reply.text


def test_api_key_is_not_in_any_command_line(host, hostvars):
    key = hostvars['vllm_kimi_api_key']
    assert key, 'the sandbox inventory must set a test key'
    out = host.check_output('ps -eww -o user,pid,args')
    # vllm serve, directly or through the CPU build's version shim.
    assert 'vllm serve' in out or 'llmserve-vllm-cli serve' in out, out
    assert key not in out
    # /proc is what ps reads; check every cmdline directly as well.
    cmdlines = host.check_output("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' || true")
    assert key not in cmdlines


def test_api_key_is_not_in_the_unit(host, hostvars, unit):
    key = hostvars['vllm_kimi_api_key']
    unit_text = host.check_output('systemctl cat %s', unit)
    assert 'ExecStart=' in unit_text
    assert key not in unit_text
    assert key not in host.check_output('systemctl show %s', unit)
    env_file = host.file('/etc/%s/environment' % unit)
    assert (env_file.user, env_file.group, env_file.mode) == ('root', 'root', 0o600)


def test_unit_file_verifies(host, unit):
    result = host.run('systemd-analyze verify /etc/systemd/system/%s.service', unit)
    assert result.rc == 0, result.stderr


def test_health_and_models_answer(hostvars):
    base = 'https://127.0.0.1:%s' % hostvars['vllm_kimi_front_port']
    assert requests.get(base + '/health', timeout=10, verify=CA).status_code == 200
    models = requests.get(
        base + '/v1/models',
        timeout=10,
        headers={'Authorization': 'Bearer ' + hostvars['vllm_kimi_api_key']},
        verify=CA,
    ).json()
    assert [m['id'] for m in models['data']] == [hostvars['vllm_kimi_served_model_name']], json.dumps(models)


def test_unit_runs_the_checked_release(host, hostvars, unit):
    main_pid = show(host, unit, 'MainPID')['MainPID']
    program = host.check_output('readlink /proc/%s/exe', main_pid)
    exec_start = host.check_output('systemctl show -p ExecStart --value %s', unit)
    release = re.search(r'path=(%s/[0-9a-f]{12})/bin/' % re.escape(hostvars['vllm_kimi_venv_root']), exec_start)
    assert release, exec_start
    marker = json.loads(host.file(release.group(1) + '/.llmserve-release.json').content_string)
    assert marker['package'] == hostvars['vllm_kimi_package_spec']
    assert marker['vllm_version'] == hostvars['vllm_kimi_package_spec'].split('==')[1]
    # The venv's python is a link to the system interpreter the release was built with.
    assert program.startswith('/usr/bin/python3')


def records_dir(hostvars):
    return hostvars['vllm_kimi_records_dir'].replace('{{ vllm_kimi_service_name }}', hostvars['vllm_kimi_service_name'])


def test_roots_records_are_out_of_the_service_users_reach(host, hostvars):
    records = host.file(records_dir(hostvars))
    assert (records.user, records.group, records.mode) == ('root', 'root', 0o700)
    assert not host.file('%s/deployments' % hostvars['vllm_kimi_state_dir']).exists
    user = hostvars['vllm_kimi_user']
    # The owner of a parent could rename them (and plant a unit for the next rollback): the service user is refused.
    for path in (records.path, records.path + '/deployments', records.path + '/deployments/last-good'):
        moved = host.run('runuser -u %s -- mv %s %s/moved-by-the-service-user', user, path, '/tmp')
        assert moved.rc != 0, (path, moved.stdout)
        assert host.file(path).exists
    planted = host.run('runuser -u %s -- ln -s /tmp %s/deployments/planted', user, records.path)
    assert planted.rc != 0 and not host.file(records.path + '/deployments/planted').exists


def test_last_good_deployment_is_recorded_root_only_without_the_key(host, hostvars):
    deployments = host.file('%s/deployments' % records_dir(hostvars))
    assert (deployments.user, deployments.group, deployments.mode) == ('root', 'root', 0o700)
    last_good = host.file(deployments.path + '/last-good')
    assert last_good.is_symlink
    record_file = host.file(last_good.path + '/record.json')
    assert (record_file.user, record_file.mode) == ('root', 0o600)
    record = json.loads(record_file.content_string)
    assert record['gate']['answer'] == 'The capital of France is Paris.'
    assert record['model_path'] == '%s/%s' % (hostvars['vllm_kimi_model_path'], hostvars['vllm_kimi_model_revision'])
    assert record['model_revision'] == hostvars['vllm_kimi_model_revision']
    assert len(record['model_fingerprint']) == 64
    assert hostvars['vllm_kimi_api_key'] not in record_file.content_string
    for name in ('unit', 'environment'):
        snapshot = host.file(last_good.path + '/' + name)
        assert (snapshot.user, snapshot.mode) == ('root', 0o600)


def model_dir(hostvars):
    return '%s/%s' % (hostvars['vllm_kimi_model_path'], hostvars['vllm_kimi_model_revision'])


def test_the_checkpoint_is_roots_and_read_only_to_the_service(host, hostvars):
    """The fetch wrote it as a user of its own; sealed before its check, nothing in it is the service's to change."""
    checkpoint = model_dir(hostvars)
    owners = host.check_output("find %s ! -type l -printf '%%u:%%g %%m\\n' | sort | uniq -c", checkpoint)
    assert {line.split()[1] for line in owners.splitlines()} == {'root:%s' % hostvars['vllm_kimi_group']}, owners
    assert host.check_output('find %s ! -type l -perm /022', checkpoint) == ''
    user = hostvars['vllm_kimi_user']
    for attempt in (
        'touch %s/planted' % checkpoint,
        'sh -c "echo >> %s/config.json"' % checkpoint,
        'mv %s %s.moved' % (checkpoint, checkpoint),
    ):
        refused = host.run('runuser -u %s -- %s', user, attempt)
        assert refused.rc != 0, (attempt, refused.stdout)
    assert not host.file(checkpoint + '/planted').exists and host.file(checkpoint + '/config.json').exists


def test_the_release_is_not_writable_by_the_service(host, hostvars, unit):
    exec_start = host.check_output('systemctl show -p ExecStart --value %s', unit)
    release = re.search(r'path=(%s/[0-9a-f]{12})/bin/' % re.escape(hostvars['vllm_kimi_venv_root']), exec_start).group(
        1
    )
    user = hostvars['vllm_kimi_user']
    for attempt in ('touch %s/planted' % release, 'touch %s/bin/planted' % release):
        assert host.run('runuser -u %s -- %s', user, attempt).rc != 0, attempt
    site = host.check_output('ls -d %s/lib/python3*/site-packages', release)
    assert host.run('runuser -u %s -- touch %s/llmserve-planted.pth', user, site).rc != 0


def test_the_fetch_ran_as_a_user_of_its_own(host, hostvars):
    fetch_user = host.user(
        hostvars['vllm_kimi_fetch_user'].replace('{{ vllm_kimi_service_name }}', hostvars['vllm_kimi_service_name'])
    )
    assert fetch_user.exists and fetch_user.shell == '/usr/sbin/nologin'
    assert hostvars['vllm_kimi_group'] not in fetch_user.groups
    # The Hub token's file is root's; the fetch's unit read it, the fetch user never can.
    hub_env = host.file('/etc/%s/hub.environment' % hostvars['vllm_kimi_service_name'])
    assert (hub_env.user, hub_env.mode) == ('root', 0o600)
