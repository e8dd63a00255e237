# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The pre-load smoke's decisions (driver for CUDA, torch's arch list, CPU worker groups, the all-reduce's sum and
its causes, Triton's compiler), its compiler and writable checks run for real, and what it reported on an H200."""

import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
SMOKE = os.path.join(HERE, '..', '..', '..', 'roles', 'vllm_kimi', 'files', 'llmserve-preload-smoke')
FIXTURES = os.path.join(HERE, '..', '..', 'fixtures', 'preload_smoke')


def _load():
    loader = importlib.machinery.SourceFileLoader('llmserve_preload_smoke', SMOKE)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


smoke = _load()


@pytest.mark.parametrize(
    'cuda, driver, problem',
    [
        pytest.param('13.0', '580.65.06', None, id='cuda13-driver580'),
        pytest.param('13.0', '575.57.08', 'driver 575.57.08 is older than CUDA 13.0 needs (>= 580)', id='cuda13-575'),
        pytest.param('12.8', '570.26', None, id='cuda12.8-driver570'),
        pytest.param('12.9', '565.57.01', 'driver 565.57.01 is older than CUDA 12.9 needs (>= 570)', id='cuda12.9-565'),
        pytest.param('12.4', '525.60.13', None, id='cuda12.4-driver525'),
        pytest.param('12.1', '520.61.05', 'driver 520.61.05 is older than CUDA 12.1 needs (>= 525)', id='cuda12.1-520'),
        pytest.param('11.8', '450.80.02', None, id='cuda11-not-in-table'),
        pytest.param('12.8', None, None, id='no-nvidia-smi'),
    ],
)
def test_driver_for_cuda(cuda, driver, problem):
    assert smoke.driver_problem(driver, cuda) == problem


@pytest.mark.parametrize(
    'cuda, needed',
    [
        pytest.param('13.0', 580, id='13.0'),
        pytest.param('13.2', 580, id='13.2'),
        pytest.param('12.8', 570, id='12.8'),
        pytest.param('12.6', 525, id='12.6'),
        pytest.param('11.8', None, id='11.8'),
        pytest.param('garbage', None, id='not-a-version'),
    ],
)
def test_min_driver_for_cuda(cuda, needed):
    assert smoke.min_driver_for_cuda(cuda) == needed


CU130 = ['sm_75', 'sm_80', 'sm_86', 'sm_90', 'sm_100', 'sm_120']


@pytest.mark.parametrize(
    'capability, arch_list, runs, how',
    [
        pytest.param((9, 0), CU130, True, 'sm_90 in torch arch list', id='h200-cu130'),
        pytest.param((12, 0), CU130, True, 'sm_120 in torch arch list', id='rtx-pro-6000-cu130'),
        pytest.param((9, 0), ['sm_80', 'sm_90a'], True, 'sm_90 in torch arch list', id='arch-specific-a'),
        pytest.param((8, 9), ['sm_80', 'sm_86', 'sm_90'], True, 'sm_89 runs sm_86 code (same major)', id='ada-sm86'),
        pytest.param(
            (12, 0),
            ['sm_80', 'sm_90', 'compute_90'],
            True,
            'sm_120 JIT-compiles from compute_90 PTX (slow first start)',
            id='blackwell-ptx',
        ),
        pytest.param(
            (12, 0),
            ['sm_80', 'sm_90', 'sm_100'],
            False,
            'sm_120 not in torch arch list sm_80 sm_90 sm_100 and no compute_XY PTX at or below it',
            id='blackwell-cu126',
        ),
        pytest.param(
            (9, 0),
            ['sm_100', 'compute_100'],
            False,
            'sm_90 not in torch arch list sm_100 compute_100 and no compute_XY PTX at or below it',
            id='ptx-newer-than-gpu',
        ),
    ],
)
def test_arch_match(capability, arch_list, runs, how):
    assert smoke.arch_match(capability, arch_list) == (runs, how)


@pytest.mark.parametrize(
    'text, cpus, formatted',
    [
        pytest.param('0', [0], '0', id='one'),
        pytest.param('0-3,8\n', [0, 1, 2, 3, 8], '0-3,8', id='sysfs'),
        pytest.param('5,2-4', [5, 2, 3, 4], '2-5', id='vllm-order'),
        pytest.param('', [], '', id='empty-node'),
    ],
)
def test_cpu_lists(text, cpus, formatted):
    assert smoke.parse_cpu_list(text) == cpus
    assert smoke.format_cpu_list(cpus) == formatted


TWO_NODES = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


@pytest.mark.parametrize(
    'bind, node_cpus, allowed, groups',
    [
        pytest.param(None, TWO_NODES, range(8), [[0, 1, 2, 3], [4, 5, 6, 7]], id='unset-two-nodes'),
        pytest.param('auto', TWO_NODES, [2, 3], [[2, 3]], id='auto-affinity-one-node'),
        pytest.param('auto', {0: [0, 1], 1: []}, [0, 1], [[0, 1]], id='memory-only-node'),
        pytest.param('0|1', {0: [0, 1]}, [0, 1], [[0], [1]], id='explicit'),
        pytest.param('0-3|4-7', TWO_NODES, range(8), [[0, 1, 2, 3], [4, 5, 6, 7]], id='explicit-ranges'),
        pytest.param('nobind', TWO_NODES, range(8), None, id='nobind'),
    ],
)
def test_cpu_worker_groups(bind, node_cpus, allowed, groups):
    assert smoke.cpu_worker_groups(bind, node_cpus, list(allowed)) == groups


REMEDY = (
    'set VLLM_CPU_OMP_THREADS_BIND in vllm_kimi_environment, one core list per rank separated by |, '
    "e.g. '0|1' for two ranks (or '0-3|4-7')"
)


@pytest.mark.parametrize(
    'bind, node_cpus, allowed, ranks, problem',
    [
        pytest.param(None, {0: [0, 1]}, [0, 1], 1, None, id='one-node-one-rank'),
        pytest.param(
            None,
            {0: [0, 1]},
            [0, 1],
            2,
            (
                '1 NUMA node(s) with allowed CPUs (0-1) for 2 rank(s)',
                'Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers. Allowed NUMA nodes are [0]. '
                'Please try to bind threads manually or decrease DP/TP/PP.',
                REMEDY,
            ),
            id='one-node-two-ranks',
        ),
        pytest.param(
            'auto',
            TWO_NODES,
            [0, 1],
            2,
            (
                '1 NUMA node(s) with allowed CPUs (0-1) for 2 rank(s)',
                'Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers. Allowed NUMA nodes are [0]. '
                'Please try to bind threads manually or decrease DP/TP/PP.',
                REMEDY,
            ),
            id='affinity-hides-a-node',
        ),
        pytest.param('0|1', {0: [0, 1]}, [0, 1], 2, None, id='explicit-two'),
        pytest.param(
            '0-1',
            {0: [0, 1]},
            [0, 1],
            2,
            (
                'VLLM_CPU_OMP_THREADS_BIND=0-1 has 1 core list(s) for 2 rank(s)',
                "Given number of CPU id list ['0-1'] doesn't match local world size 2.",
                REMEDY,
            ),
            id='explicit-too-few',
        ),
        pytest.param(
            '0|7',
            TWO_NODES,
            [0, 1, 2, 3],
            2,
            (
                'VLLM_CPU_OMP_THREADS_BIND=0|7 names CPUs 7 outside the allowed 0-3',
                'the workers would bind to CPUs the unit (AllowedCPUs/CPUAffinity) does not give them',
                REMEDY + ', using only CPUs in 0-3',
            ),
            id='explicit-outside-affinity',
        ),
        pytest.param('nobind', {0: [0]}, [0], 4, None, id='nobind'),
    ],
)
def test_cpu_groups_problem(bind, node_cpus, allowed, ranks, problem):
    assert smoke.cpu_groups_problem(bind, node_cpus, allowed, ranks) == problem


@pytest.mark.parametrize('ranks, total', [(1, 1), (2, 3), (4, 10), (8, 36)], ids=['1', '2', '4', '8'])
def test_expected_sum(ranks, total):
    assert smoke.expected_sum(ranks) == total


@pytest.mark.parametrize(
    'backend, env, cause',
    [
        pytest.param(
            'gloo',
            {},
            'the gloo group did not form: GLOO_SOCKET_IFNAME is unset, so Gloo binds to the address the host name '
            "resolves to, which the unit's IP fence (IPAddressDeny) may drop",
            id='gloo-unset',
        ),
        pytest.param(
            'gloo',
            {'GLOO_SOCKET_IFNAME': 'eth1'},
            'the gloo group did not form: GLOO_SOCKET_IFNAME=eth1; the ranks connect over that interface, '
            "which must be up and allowed by the unit's IPAddressAllow/IPAddressDeny fence",
            id='gloo-set',
        ),
        pytest.param(
            'nccl',
            {},
            'the nccl group did not form or the all-reduce hung; NCCL_SOCKET_IFNAME is unset (NCCL picks an '
            'interface for its bootstrap itself); P2P over PCIe blocked by ACS or the IOMMU (NCCL_P2P_LEVEL=unset); '
            "the unit's IPAddressDeny fence dropping the ranks' sockets",
            id='nccl-defaults',
        ),
        pytest.param(
            'nccl',
            {'NCCL_SOCKET_IFNAME': 'lo', 'NCCL_P2P_DISABLE': '1'},
            'the nccl group did not form or the all-reduce hung; NCCL_SOCKET_IFNAME=lo (its bootstrap runs over '
            "that interface); P2P is already disabled (NCCL_P2P_DISABLE=1); the unit's IPAddressDeny fence dropping "
            "the ranks' sockets",
            id='nccl-p2p-off',
        ),
    ],
)
def test_allreduce_timeout_cause(backend, env, cause):
    assert smoke.allreduce_timeout_cause(backend, env) == cause


def _which(found):
    return found.get


@pytest.mark.parametrize(
    'env, found, cc',
    [
        pytest.param({}, {'gcc': '/usr/bin/gcc', 'clang': '/usr/bin/clang'}, '/usr/bin/gcc', id='gcc-before-clang'),
        pytest.param({}, {'clang': '/usr/bin/clang'}, '/usr/bin/clang', id='clang'),
        pytest.param({}, {'cc': '/usr/bin/cc'}, None, id='cc-is-not-tried'),
        pytest.param({'CC': 'clang'}, {'gcc': '/usr/bin/gcc', 'clang': '/opt/clang'}, '/opt/clang', id='CC-first'),
        pytest.param({'CC': 'nosuch-cc'}, {'gcc': '/usr/bin/gcc'}, None, id='CC-missing'),
    ],
)
def test_find_c_compiler(env, found, cc):
    assert smoke.find_c_compiler(env, _which(found)) == cc


@pytest.mark.parametrize(
    'argv, own, serve_argv, arguments',
    [
        pytest.param(
            ['--ranks', '2', '--', '/opt/vllm/abc/bin/vllm', 'serve', '/models/x', '--tensor-parallel-size', '2'],
            ['--ranks', '2'],
            ['/opt/vllm/abc/bin/vllm', 'serve', '/models/x', '--tensor-parallel-size', '2'],
            ['/models/x', '--tensor-parallel-size', '2'],
            id='bin-vllm',
        ),
        pytest.param(
            ['--ranks', '1', '--', '/opt/vllm/abc/bin/python', '/usr/local/libexec/llmserve-vllm-cli', 'serve', 'm'],
            ['--ranks', '1'],
            ['/opt/vllm/abc/bin/python', '/usr/local/libexec/llmserve-vllm-cli', 'serve', 'm'],
            ['m'],
            id='version-shim',
        ),
        pytest.param(
            ['--ranks', '1', '--', 'vllm', 'serve', 'm', '--', 'x'],
            ['--ranks', '1'],
            ['vllm', 'serve', 'm', '--', 'x'],
            ['m', '--', 'x'],
            id='later-double-dash-is-vllms',
        ),
    ],
)
def test_command_line_split(argv, own, serve_argv, arguments):
    assert smoke.split_command_line(argv) == (own, serve_argv)
    assert smoke.serve_arguments(serve_argv) == arguments


def test_serve_argv_without_serve_word():
    with pytest.raises(ValueError, match=r'^the service command line has no `serve` word: vllm run m$'):
        smoke.serve_arguments(['vllm', 'run', 'm'])


@pytest.mark.parametrize(
    'stderr, message',
    [
        pytest.param(
            'usage: vllm serve [model_tag] [options]\nvllm serve: error: unrecognized arguments: --no-such-flag 3\n',
            'vllm serve: error: unrecognized arguments: --no-such-flag 3',
            id='unrecognized',
        ),
        pytest.param(
            'usage: vllm serve [model_tag] [options]\n'
            'vllm serve: error: unrecognized arguments: --task generate\n\n'
            'Hint: --task is not a vllm serve option.\n',
            'vllm serve: error: unrecognized arguments: --task generate Hint: --task is not a vllm serve option.',
            id='with-hint',
        ),
        pytest.param('one\ntwo\nthree\nfour\n', 'two three four', id='no-error-line'),
    ],
)
def test_parser_error_text(stderr, message):
    assert smoke.parser_error_text(stderr) == message


@pytest.mark.parametrize(
    'text, checks',
    [
        pytest.param('compiler,writable', ['compiler', 'writable'], id='two'),
        pytest.param(' parser , devices ', ['parser', 'devices'], id='spaces'),
    ],
)
def test_selected_checks(text, checks):
    assert smoke.selected_checks(text) == checks


def test_unknown_check_is_refused():
    with pytest.raises(ValueError, match=r'^unknown check\(s\) gpu; choose from parser,paths,devices,'):
        smoke.selected_checks('devices,gpu')


def test_failed_entry_carries_cause_and_remedy_and_summary_fails():
    checks = [
        smoke.entry('devices', 'passed', 0.1234, 'ok'),
        smoke.entry('allreduce', 'failed', 2.0, 'seen', 'why', 'what'),
        smoke.entry('triton', 'skipped', 0.0, 'no GPU'),
    ]
    assert checks[1] == {
        'name': 'allreduce',
        'status': 'failed',
        'seconds': 2.0,
        'detail': 'seen',
        'cause': 'why',
        'remedy': 'what',
    }
    assert checks[0] == {'name': 'devices', 'status': 'passed', 'seconds': 0.123, 'detail': 'ok'}
    report = smoke.summary('gloo', 2, [], {}, checks)
    assert report['passed'] is False
    assert smoke.summary('gloo', 2, [], {}, [checks[0], checks[2]])['passed'] is True


# ---- the program run for real on this host: its compiler and writable checks ----


def _run(tmp_path, env, *extra):
    proc = subprocess.run(
        [sys.executable, SMOKE, '--ranks', '1', '--checks', 'compiler,writable']
        + list(extra)
        + ['--', '/opt/vllm/x/bin/vllm', 'serve', '/models/x'],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    report = json.loads(proc.stdout)
    return proc.returncode, report, {check['name']: check for check in report['checks']}


@pytest.mark.skipif(shutil.which('gcc') is None, reason='needs gcc on PATH')
def test_compiler_and_writable_pass_with_gcc(tmp_path):
    env = dict(os.environ)
    env.pop('CC', None)
    cache, runtime = str(tmp_path / 'cache' / 'vllm'), str(tmp_path / 'run')
    rc, report, checks = _run(tmp_path, env, '--writable', cache, runtime)
    assert rc == 0, checks
    assert report['passed'] is True
    assert report['ranks'] == 1
    assert checks['compiler']['status'] == 'passed'
    assert checks['compiler']['detail'].startswith(
        '%s built and loaded a Python extension against ' % shutil.which('gcc')
    )
    assert checks['writable']['status'] == 'passed'
    assert checks['writable']['detail'].endswith(': %s, %s (created)' % (cache, runtime))
    assert [name for name in checks if checks[name]['status'] == 'skipped'] == [
        'parser',
        'paths',
        'devices',
        'allreduce',
        'inductor',
        'triton',
        'flashinfer',
    ]
    # The scratch module is gone; the directories stay as the service will need them.
    assert os.listdir(cache) == [] and os.listdir(runtime) == []


def test_compiler_fails_without_a_compiler_on_path(tmp_path):
    empty = tmp_path / 'bin'
    empty.mkdir()
    env = {'PATH': str(empty), 'HOME': str(tmp_path)}
    rc, report, checks = _run(tmp_path, env, '--writable', str(tmp_path / 'w'))
    assert rc == 1
    assert report['passed'] is False
    assert checks['compiler'] == {
        'name': 'compiler',
        'status': 'failed',
        'seconds': checks['compiler']['seconds'],
        'detail': 'no gcc or clang on PATH (%s)' % empty,
        'cause': 'Triton builds its launcher with the C compiler (CC, else gcc, else clang on PATH) at the first kernel '
        'and finds none (no gcc or clang on PATH (%s)): the model load would fail there' % empty,
        'remedy': 'install gcc on the host (the role installs it) or set CC to a compiler in vllm_kimi_environment',
    }
    assert checks['writable']['status'] == 'passed'


def test_writable_fails_on_a_read_only_directory(tmp_path):
    if os.geteuid() == 0:
        # root writes through file modes: a path under a regular file cannot be created, by anyone.
        blocked = tmp_path / 'file'
        blocked.write_text('')
        target = str(blocked / 'cache')
        error = 'NotADirectoryError: Not a directory'
    else:
        blocked = tmp_path / 'ro'
        blocked.mkdir(mode=0o555)
        target = str(blocked)
        error = 'PermissionError: Permission denied'
    rc, report, checks = _run(tmp_path, dict(os.environ), '--checks', 'writable', '--writable', target)
    assert rc == 1
    user = __import__('pwd').getpwuid(os.geteuid()).pw_name
    assert checks['writable']['detail'] == '%s is not writable by %s: %s' % (target, user, error)
    assert checks['writable']['remedy'].startswith('make %s owned by or writable for %s' % (target, user))


# /proc/self/mountinfo as a unit with ExecPaths= sees it on a stock host: /run noexec, the runtime directory bound
# over it without noexec; a mount point with a space, and two mounts on one point.
MOUNTINFO = """\
24 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 24 0:22 / /run rw,nosuid,nodev,noexec,relatime shared:5 - tmpfs tmpfs rw,size=1628412k,mode=755
301 25 0:22 /vllm-kimi /run/vllm-kimi rw,nosuid,nodev,relatime - tmpfs tmpfs rw,size=1628412k,mode=755
302 24 0:40 / /srv/my\\040models ro,nosuid,nodev,relatime - ext4 /dev/sdb1 rw
303 24 0:41 / /var/cache rw,relatime - tmpfs tmpfs rw
304 303 0:42 / /var/cache rw,noexec,relatime - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    'path, mount',
    [
        pytest.param(
            '/run/vllm-kimi/home/.cache', ('/run/vllm-kimi', 'rw,nosuid,nodev,relatime', 'tmpfs'), id='execpaths'
        ),
        pytest.param(
            '/run/vllm-kimi-smoke/home', ('/run', 'rw,nosuid,nodev,noexec,relatime', 'tmpfs'), id='not-a-prefix'
        ),
        pytest.param('/run', ('/run', 'rw,nosuid,nodev,noexec,relatime', 'tmpfs'), id='the-point-itself'),
        pytest.param('/srv/my models/x', ('/srv/my models', 'ro,nosuid,nodev,relatime', 'ext4'), id='escaped-space'),
        pytest.param('/var/cache/vllm', ('/var/cache', 'rw,noexec,relatime', 'tmpfs'), id='last-on-top'),
        pytest.param('/opt/vllm-kimi', ('/', 'rw,relatime', 'ext4'), id='root'),
    ],
)
def test_mount_holding(path, mount):
    assert smoke.mount_holding(path, MOUNTINFO) == mount


def test_a_directory_that_does_not_allow_mapping_code_names_its_mount_and_flags():
    detail, cause, remedy = smoke.exec_mapping_failure(
        '/run/vllm-kimi-smoke/home',
        'PermissionError: Operation not permitted',
        ('/run', 'rw,nosuid,nodev,noexec,relatime', 'tmpfs'),
    )
    assert detail == (
        '/run/vllm-kimi-smoke/home does not allow mapping code: mmap(PROT_EXEC) of a file there: PermissionError: '
        'Operation not permitted; it is on /run (tmpfs, rw,nosuid,nodev,noexec,relatime)'
    )
    assert cause == (
        'the shared objects that Triton, FlashInfer and torch build in /run/vllm-kimi-smoke/home would not load '
        '("failed to map segment from shared object"): the mount /run is noexec'
    )
    assert remedy == (
        "the role's unit lifts noexec on its runtime directory with ExecPaths=, which needs systemd 248 or later: "
        'upgrade systemd, or mount the file system that holds /run/vllm-kimi-smoke/home without noexec (on a stock '
        'host /run, which its initramfs mounts noexec)'
    )


@pytest.fixture
def tmpfs(tmp_path):
    """Mounts a small tmpfs with the options given (root only), and unmounts it after the test."""
    if os.geteuid() != 0:
        pytest.skip('mounting a tmpfs needs root')
    mounted = []

    def mount(name, options):
        point = tmp_path / name
        point.mkdir()
        proc = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m,' + options, 'tmpfs', str(point)],
                              capture_output=True, text=True, check=False)  # fmt: skip
        if proc.returncode != 0:
            pytest.skip('this machine allows no tmpfs mount: %s' % proc.stderr.strip())
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(['umount', str(point)], check=True)


def test_writable_refuses_a_noexec_mount_naming_it(tmp_path, tmpfs):
    point = tmpfs('noexec', 'nodev,noexec,nosuid')
    home = str(point / 'home')
    rc, report, checks = _run(tmp_path, dict(os.environ), '--checks', 'writable', '--writable', home)
    assert rc == 1 and report['passed'] is False
    check = checks['writable']
    assert check['status'] == 'failed'
    assert check['detail'].startswith(
        '%s does not allow mapping code: mmap(PROT_EXEC) of a file there: PermissionError: Operation not permitted; '
        'it is on %s (tmpfs, rw,' % (home, point)
    ), check['detail']
    assert 'noexec' in check['detail'].rsplit('(', 1)[1].split(',')
    assert check['cause'].endswith('the mount %s is noexec' % point)
    assert 'or mount the file system that holds %s without noexec' % home in check['remedy']
    # The probe is gone: nothing of the smoke is left in the service's directory.
    assert os.listdir(home) == []


def test_writable_passes_on_an_exec_mount(tmp_path, tmpfs):
    point = tmpfs('exec', 'nodev,nosuid')
    home = str(point / 'home')
    rc, report, checks = _run(tmp_path, dict(os.environ), '--checks', 'writable', '--writable', home)
    assert rc == 0, checks['writable']
    user = __import__('pwd').getpwuid(os.geteuid()).pw_name
    assert checks['writable']['detail'] == 'writable and mappable as code by %s: %s (created)' % (user, home)


@pytest.mark.parametrize(
    'argv, message',
    [
        pytest.param(
            ['--checks', 'devices', '--', 'x', 'serve'], 'the following arguments are required: --ranks', id='no-ranks'
        ),
        pytest.param(['--ranks', '0', '--checks', 'devices'], '--ranks must be 1 or more', id='zero-ranks'),
        pytest.param(['--ranks', '1', '--checks', 'gpu'], 'unknown check(s) gpu; choose from', id='unknown-check'),
        pytest.param(
            ['--ranks', '1', '--', 'vllm', 'run', 'm'],
            'the parser check needs -- SERVE_ARGV with a serve word',
            id='no-serve-word',
        ),
    ],
)
def test_bad_usage_exits_2(argv, message):
    proc = subprocess.run([sys.executable, SMOKE] + argv, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stdout == ''
    assert message in proc.stderr


# ---- what it reported on an H200 (tests/fixtures/preload_smoke, see tests/fixtures/README.md) ----


def _fixture(name):
    with open(os.path.join(FIXTURES, name)) as handle:
        return json.load(handle)


def test_h200_pass_fixture():
    report = _fixture('smoke-h200-pass.json')
    checks = {check['name']: check for check in report['checks']}
    assert report['passed'] is True
    assert report['backend'] == 'nccl'
    assert report['ranks'] == 1
    assert report['devices'] == [
        {'index': 0, 'name': 'NVIDIA H200', 'capability': '9.0', 'memory_total_bytes': 150109880320}
    ]
    assert report['versions']['driver'] == '580.159.04'
    assert report['versions']['cuda'] == '13.0'
    assert report['versions']['nccl'] == '2.28.9'
    assert smoke.driver_problem(report['versions']['driver'], report['versions']['cuda']) is None
    assert checks['parser']['status'] == 'skipped'
    # On a GPU inductor's kernels are Triton's, which the triton check runs.
    assert checks['inductor'] == {
        'name': 'inductor',
        'status': 'skipped',
        'seconds': 0.0,
        'detail': "GPU: torch.compile's kernels are Triton's (the triton check)",
    }
    # flashinfer is not installed there: the check says so and skips.
    assert checks['flashinfer']['status'] == 'skipped'
    assert checks['flashinfer']['detail'].startswith('flashinfer is not installed in ')
    for name in ('devices', 'allreduce', 'compiler', 'triton', 'writable'):
        assert checks[name]['status'] == 'passed', checks[name]
        assert isinstance(checks[name]['seconds'], float)
        assert 'cause' not in checks[name]
    assert checks['allreduce']['detail'].startswith(
        'nccl group of 1 rank(s) formed and all-reduced 1 on every rank in '
    )
    assert checks['devices']['detail'] == (
        '1 GPU(s) for 1 rank(s), driver 580.159.04, CUDA 13.0: 0 NVIDIA H200 (sm_90 in torch arch list)'
    )


def test_h200_ranks_mismatch_fixture():
    report = _fixture('smoke-h200-ranks-mismatch.json')
    checks = {check['name']: check for check in report['checks']}
    assert report['passed'] is False
    assert report['backend'] == 'nccl'
    assert report['ranks'] == 2
    assert checks['devices'] == {
        'name': 'devices',
        'status': 'failed',
        'seconds': checks['devices']['seconds'],
        'detail': '1 GPU(s) visible for 2 rank(s) (CUDA_VISIBLE_DEVICES=unset)',
        'cause': 'this node runs 2 rank(s), one GPU each, and sees only 1 GPU(s)',
        'remedy': 'give the unit 2 GPUs (CUDA_VISIBLE_DEVICES, DeviceAllow) or lower tensor/pipeline parallel size',
    }
    assert checks['allreduce']['status'] == 'failed'
    assert checks['allreduce']['detail'] == 'nccl needs one GPU per rank: 2 rank(s), 1 GPU(s)'
    assert [checks[name]['status'] for name in ('compiler', 'triton', 'writable')] == ['passed'] * 3


@pytest.mark.parametrize('name', ['smoke-h200-pass.json', 'smoke-h200-ranks-mismatch.json'])
def test_h200_fixtures_have_every_check_once_in_order(name):
    report = _fixture(name)
    # Recorded before the paths check (which needs vLLM, and the device has none): every other check, in order.
    assert [check['name'] for check in report['checks']] == [name for name in smoke.CHECKS if name != 'paths']
    assert set(report) == {'passed', 'backend', 'ranks', 'devices', 'versions', 'checks'}
    assert set(report['versions']) == {'torch', 'cuda', 'driver', 'nccl', 'vllm', 'triton', 'python'}


# ---- with vLLM's CPU build (.venv-vllm): its own serve parser, and a gloo group of two ----

REPO = os.path.abspath(os.path.join(HERE, '..', '..', '..'))
VLLM_PYTHON = os.path.join(REPO, '.venv-vllm', 'bin', 'python')
VLLM_CLI = os.path.join(REPO, 'roles', 'vllm_kimi', 'files', 'llmserve-vllm-cli')
needs_vllm = pytest.mark.skipif(
    not os.path.exists(VLLM_PYTHON), reason='needs the CPU build of vLLM in .venv-vllm (make vllm-venv)'
)


def _run_vllm(tmp_path, checks, serve, **env):
    environment = dict(os.environ, HOME=str(tmp_path), VLLM_NO_USAGE_STATS='1', **env)
    proc = subprocess.run(
        [VLLM_PYTHON, SMOKE, '--ranks', '2', '--checks', checks, '--', VLLM_PYTHON, VLLM_CLI, 'serve'] + serve,
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
        check=False,
    )
    report = json.loads(proc.stdout)
    return proc.returncode, {check['name']: check for check in report['checks']}


@pytest.mark.parametrize(
    'serve, status, detail',
    [
        pytest.param(
            ['/models/x', '--served-model-name', 'kimi', '--tensor-parallel-size', '2', '--max-model-len', '4096'],
            'passed',
            'vllm serve parses 7 argument(s); engine args: model=/models/x tensor_parallel_size=2 '
            'pipeline_parallel_size=1',
            id='accepted',
        ),
        pytest.param(
            ['/models/x', '--tensor-parallel-size', '2', '--no-such-flag', '3'],
            'failed',
            'vllm serve rejects the command line (exit 2): vllm: error: unrecognized arguments: --no-such-flag 3',
            id='unknown-flag',
        ),
        pytest.param(
            ['/models/x', '--enable-auto-tool-choice'],
            'failed',
            'vllm serve rejects the arguments: TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser',
            id='validate',
        ),
    ],
)
@pytest.mark.vllm
@needs_vllm
def test_parser_with_vllm(tmp_path, serve, status, detail):
    rc, checks = _run_vllm(tmp_path, 'parser', serve)
    assert (rc, checks['parser']['status'], checks['parser']['detail']) == (
        0 if status == 'passed' else 1,
        status,
        detail,
    )


@pytest.mark.vllm
@needs_vllm
def test_gloo_group_of_two_with_bound_cpu_groups(tmp_path):
    # Cores this test may use (make test pins its lane to one): the first and the last, the same one where one is all.
    cores = sorted(os.sched_getaffinity(0))
    bind = '%d|%d' % (cores[0], cores[-1])
    rc, checks = _run_vllm(tmp_path, 'devices,allreduce', ['/models/x'], VLLM_CPU_OMP_THREADS_BIND=bind)
    assert rc == 0, checks
    assert checks['devices']['detail'] == (
        'no GPU: 2 CPU worker group(s) for 2 rank(s) (VLLM_CPU_OMP_THREADS_BIND=%s): %d | %d'
        % (bind, cores[0], cores[-1])
    )
    assert checks['allreduce']['detail'].startswith(
        'gloo group of 2 rank(s) formed and all-reduced 3 on every rank in '
    )


# strace's line for one call: "<pid> sched_setaffinity(0, <size>, [<cpus>]) = 0".
SETAFFINITY = re.compile(r'^(\d+) +sched_setaffinity\(0, \d+, \[([\d ]+)\]\) += 0$', re.MULTILINE)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.skipif(shutil.which('strace') is None, reason='needs strace (tools/host-packages.txt)')
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason='a move across CPUs needs two of them')
def test_importing_torch_moves_no_process_across_cpus(tmp_path):
    # torch's import counts cores by moving the process onto each CPU in turn; beside a busy service a move can
    # starve (staying_on_this_cpu). The smoke and its two ranks each import torch, allowed every CPU here (make test
    # pins its lane to one): each may hold itself on one CPU, never move to a second.
    log = tmp_path / 'strace.log'
    proc = subprocess.run(
        ['strace', '-f', '-qq', '-e', 'trace=sched_setaffinity', '-o', str(log), VLLM_PYTHON, SMOKE]
        + ['--ranks', '2', '--checks', 'allreduce', '--', VLLM_PYTHON, VLLM_CLI, 'serve', '/models/x'],
        capture_output=True,
        text=True,
        env=dict(os.environ, HOME=str(tmp_path)),
        preexec_fn=lambda: os.sched_setaffinity(0, range(os.cpu_count())),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    held = {}
    for pid, cpus in SETAFFINITY.findall(log.read_text()):
        if len(cpus.split()) == 1:
            held.setdefault(pid, set()).add(cpus)
    assert len(held) == 3, log.read_text()
    assert {pid: cpus for pid, cpus in held.items() if len(cpus) > 1} == {}


# torch inductor's own words where CXX is unset and g++ is not on PATH.
NO_GXX = "InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: (None, 'g++')"


def _run_inductor(tmp_path, path):
    # torch (of .venv-vllm) finds its C++ compiler on PATH; the writable directory holds the scratch library.
    proc = subprocess.run(
        [VLLM_PYTHON, SMOKE, '--ranks', '1', '--checks', 'inductor', '--writable', str(tmp_path / 'cache')]
        + ['--', VLLM_PYTHON, VLLM_CLI, 'serve', '/models/x'],
        capture_output=True,
        text=True,
        env={'PATH': path, 'HOME': str(tmp_path)},
        timeout=300,
        check=False,
    )
    return proc.returncode, {check['name']: check for check in json.loads(proc.stdout)['checks']}


@pytest.mark.vllm
@needs_vllm
@pytest.mark.skipif(shutil.which('g++') is None, reason='needs g++ on PATH')
def test_inductor_builds_with_the_cxx_torch_finds(tmp_path):
    rc, checks = _run_inductor(tmp_path, os.environ['PATH'])
    assert rc == 0, checks['inductor']
    assert checks['inductor']['detail'].startswith(
        "%s (torch inductor's C++ compiler) built and loaded a C++ library in %s/" % (shutil.which('g++'), tmp_path)
    )
    assert os.listdir(tmp_path / 'cache') == []


@pytest.mark.vllm
@needs_vllm
@pytest.mark.skipif(shutil.which('gcc') is None, reason='needs gcc on PATH')
def test_inductor_fails_with_a_c_compiler_alone(tmp_path):
    """The sandbox's first TP 2 request failed so: gcc was there, g++ was not."""
    alone = tmp_path / 'bin'
    alone.mkdir()
    os.symlink(shutil.which('gcc'), str(alone / 'gcc'))
    rc, checks = _run_inductor(tmp_path, str(alone))
    assert rc == 1
    assert checks['inductor'] == {
        'name': 'inductor',
        'status': 'failed',
        'seconds': checks['inductor']['seconds'],
        'detail': NO_GXX,
        'cause': "vLLM's CPU build compiles parts of a request with torch.compile, whose inductor kernels are C++ "
        'built at the first request, and finds no C++ compiler (%s): the first request would fail after the load'
        % NO_GXX,
        'remedy': 'install g++ on the host (the role installs it with vllm_kimi_toolchain_packages) or set CXX to a '
        'C++ compiler in vllm_kimi_environment',
    }


# ---- the paths check: what the plan builds at the first start, and FlashInfer's JIT toolchain ----


@pytest.mark.parametrize(
    'capability, needed',
    [
        pytest.param((12, 0), (12, 8), id='sm120-rtx-pro-6000'),
        pytest.param((12, 1), (12, 9), id='sm121'),
        pytest.param((12, 3), (12, 9), id='sm12x-later-minor'),
        pytest.param((9, 0), None, id='sm90-no-bound'),
    ],
)
def test_min_nvcc_for_arch(capability, needed):
    assert smoke.min_nvcc_for_arch(capability) == needed


@pytest.mark.parametrize(
    'env, on_path, found',
    [
        pytest.param(
            {'CUDA_HOME': '/opt/cuda-12.9'}, {'/opt/cuda-12.9/bin/nvcc'}, '/opt/cuda-12.9/bin/nvcc', id='home'
        ),
        pytest.param({'CUDA_PATH': '/opt/cuda'}, {'/opt/cuda/bin/nvcc'}, '/opt/cuda/bin/nvcc', id='path-var'),
        pytest.param({'CUDA_HOME': '/opt/none'}, {'/usr/local/cuda/bin/nvcc'}, None, id='home-without-nvcc'),
        pytest.param({}, {'nvcc', '/usr/lib/cuda/bin/nvcc'}, '/usr/lib/cuda/bin/nvcc', id='on-path'),
        pytest.param({}, {'/usr/local/cuda/bin/nvcc'}, '/usr/local/cuda/bin/nvcc', id='default-home'),
        pytest.param({}, set(), None, id='none'),
    ],
)
def test_find_nvcc(env, on_path, found):
    def which(name):
        if name == 'nvcc':
            return '/usr/lib/cuda/bin/nvcc' if 'nvcc' in on_path else None
        return name if name in on_path else None

    assert smoke.find_nvcc(env, which) == found


def _paths(attention, sampler='pytorch', flashinfer=False, platform='cuda'):
    return {
        'platform': platform,
        'attention': attention,
        'attention_rejected': [],
        'sampler': sampler,
        'flashinfer_kernels': flashinfer,
    }


@pytest.mark.parametrize(
    'paths, needs',
    [
        pytest.param(_paths('TRITON_MLA'), ['triton'], id='sm120-toolkit-free'),
        pytest.param(_paths('TRITON_MLA', 'flashinfer', True), ['triton', 'flashinfer'], id='sm120-with-toolkit'),
        pytest.param(_paths('TRITON_MLA', 'flashinfer', False), ['triton', 'flashinfer'], id='0.33-sampler-alone'),
        pytest.param(_paths('FLASH_ATTN_MLA'), [], id='sm90-prebuilt'),
        pytest.param(_paths('CPU_MLA', 'cpu', platform='cpu'), [], id='cpu-build'),
    ],
)
def test_path_needs(paths, needs):
    assert smoke.path_needs(paths) == needs


TOOLKIT_REMEDY = (
    'install the CUDA toolkit 12.8 or newer (nvcc and its headers) on the host and set vllm_kimi_cuda_home to it, or '
    'turn the FlashInfer paths off (VLLM_USE_FLASHINFER_SAMPLER=0 and a non-FlashInfer --moe-backend)'
)


@pytest.mark.parametrize(
    'nvcc, release, ninja, problem',
    [
        pytest.param('/usr/local/cuda/bin/nvcc', (12, 8), '/opt/vllm/r/bin/ninja', None, id='12.8-ninja'),
        pytest.param('/usr/local/cuda/bin/nvcc', (13, 0), '/opt/vllm/r/bin/ninja', None, id='13.0-ninja'),
        pytest.param(
            None,
            None,
            '/opt/vllm/r/bin/ninja',
            (
                'no nvcc (CUDA_HOME, CUDA_PATH, PATH or /usr/local/cuda)',
                "the plan's FlashInfer paths JIT-compile their kernels with nvcc at the first start and find none: "
                'the engine would die in its profile run, after the load',
                TOOLKIT_REMEDY,
            ),
            id='no-nvcc',
        ),
        pytest.param(
            '/usr/local/cuda/bin/nvcc',
            (12, 6),
            '/opt/vllm/r/bin/ninja',
            (
                '/usr/local/cuda/bin/nvcc is CUDA 12.6; FlashInfer builds for sm_120 with CUDA 12.8 or newer',
                'FlashInfer cannot JIT-compile for sm_120 with CUDA 12.6 (flashinfer: "SM 120 requires CUDA >= 12.8")',
                TOOLKIT_REMEDY,
            ),
            id='nvcc-12.6-too-old',
        ),
        pytest.param(
            '/usr/local/cuda/bin/nvcc',
            (12, 8),
            None,
            (
                'no ninja on PATH',
                "FlashInfer's JIT runs `ninja` from PATH; the release brings it (vLLM requires the ninja wheel) in its "
                'bin/',
                "put the release's bin/ first on the unit's PATH (the role's unit does), or reinstall the release",
            ),
            id='no-ninja',
        ),
    ],
)
def test_flashinfer_jit_problem_on_sm120(nvcc, release, ninja, problem):
    assert smoke.flashinfer_jit_problem((12, 0), nvcc, release, ninja) == problem


GPU_SELECTION = os.path.join(HERE, 'smoke_gpu_selection.py')


@pytest.mark.parametrize(
    'capability, answer',
    [
        # vllm/platforms/cuda.py _get_backend_priorities: SM12x has TRITON_MLA first (and a sparse-only second).
        pytest.param((12, 0), {'attention': 'TRITON_MLA', 'rejected': [], 'needs': ['triton']}, id='sm120'),
        # SM90 prefers FlashAttention's MLA, then FlashMLA and FlashInfer's: the CPU wheel has none of their kernels,
        # so its selector says why and falls to TRITON_MLA; a CUDA wheel picks FLASH_ATTN_MLA (prebuilt).
        pytest.param(
            (9, 0),
            {
                'attention': 'TRITON_MLA',
                'rejected': ['FLASH_ATTN_MLA', 'FLASHMLA', 'FLASHINFER_MLA'],
                'needs': ['triton'],
            },
            id='sm90-cpu-wheel',
        ),
    ],
)
@pytest.mark.vllm
@needs_vllm
def test_attention_path_with_vllms_cuda_selector(capability, answer):
    proc = subprocess.run(
        [VLLM_PYTHON, GPU_SELECTION, SMOKE, str(capability[0]), str(capability[1])],
        capture_output=True,
        text=True,
        env=dict(os.environ, VLLM_NO_USAGE_STATS='1'),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == answer


@pytest.mark.vllm
@needs_vllm
def test_paths_on_the_cpu_build(tmp_path):
    model = tmp_path / 'model'
    model.mkdir()
    shutil.copy(os.path.join(HERE, '..', '..', 'fixtures', 'checkpoints', 'tiny-deepseek-v3', 'config.json'), model)
    proc = subprocess.run(
        [VLLM_PYTHON, SMOKE, '--ranks', '1', '--checks', 'parser,paths', '--', VLLM_PYTHON, VLLM_CLI, 'serve']
        + [str(model), '--max-model-len', '4096'],
        capture_output=True,
        text=True,
        env=dict(os.environ, HOME=str(tmp_path), VLLM_NO_USAGE_STATS='1'),
        timeout=600,
        check=False,
    )
    checks = {check['name']: check for check in json.loads(proc.stdout)['checks']}
    assert (proc.returncode, checks['paths']['status'], checks['paths']['detail']) == (
        0,
        'passed',
        'attention CPU_MLA, sampler cpu, FlashInfer kernels off; builds at the first start: nothing',
    )
