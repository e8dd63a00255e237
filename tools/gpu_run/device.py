# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The device side of the GPU run: run there from the carried .gpu-run folder, with python3 (the one with torch).

    python3 .gpu-run/device.py stage 1            # calls 1 and 2: keep the part in ~/stage (1 also records the device)
    python3 .gpu-run/device.py serve miniature-eager   # call 3: part 3, join, check, unpack; serve, gates, stop
    python3 .gpu-run/device.py serve miniature    # call 4: the miniature as the role serves it (CUDA graphs)
    python3 .gpu-run/device.py serve synthetic-eager [--generate]   # later calls: the large synthetic checkpoint

Everything it learns goes to $OUT (8 files at most come back): start logs, the gates' answers, the figures.
The serve argv and environment are the role's (plan/<name>/plan.json, plan/<name>/environment: tools/gpu_run/plan).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STAGE = Path.home() / 'stage'
ROOT = Path('/tmp/gpu-run')
SITE = ROOT / 'site'
ANSIBLE_SITE = ROOT / 'ansible'
SPARES_SITE = ROOT / 'spares'
OUT = Path(os.environ.get('OUT', '/tmp/gpu-run/out'))
# A call may run 600 s; the waits end before, so that what was learnt is written and the server stopped.
BEGAN = time.monotonic()
CALL_SECONDS = 560
# The device's GPUs are shared with other sessions: NVLink multicast stays off in everything started here.
DEVICE_ENV = {'NCCL_NVLS_ENABLE': '0', 'TORCH_SYMM_MEM_DISABLE_MULTICAST': '1', 'NVSHMEM_DISABLE_NVLS': '1'}


def time_left() -> float:
    """Seconds the call has left for a wait, keeping a minute for the stop and the records."""
    return max(30.0, CALL_SECONDS - 60 - (time.monotonic() - BEGAN))


def save(results: dict[str, Any]) -> None:
    """Write the results so far: a call killed at its limit still brings back what it learnt."""
    (OUT / f'{results["plan"]}-results.json').write_text(json.dumps(results, indent=2, default=str) + '\n')


def log(message: str) -> None:
    print(f'[{time.strftime("%H:%M:%S")}] {message}', flush=True)


def run_text(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    return f'$ {" ".join(argv)}  (exit {proc.returncode})\n{proc.stdout}{proc.stderr}\n'


def record_device() -> None:
    """nvidia-smi, Python, torch and CUDA, Python.h: what the run depends on, as call 1 found it."""
    probe = (
        'import sys, sysconfig, os, torch, triton, transformers;'
        'print(sys.version); print(sys.executable);'
        'print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,'
        ' "transformers", transformers.__version__);'
        'print("Python.h", os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")));'
        'p = torch.cuda.get_device_properties(0); print(p.name, p.total_memory, p.multi_processor_count,'
        ' torch.cuda.get_device_capability(0))'
    )
    text = run_text(['nvidia-smi']) + run_text([sys.executable, '-c', probe])
    text += run_text(
        [
            'nvidia-smi',
            '--query-gpu=name,memory.total,memory.used,compute_cap,driver_version',
            '--format=csv,noheader,nounits',
        ]
    )
    text += run_text(['df', '-h', '/tmp', '/dev/shm', str(Path.home())]) + run_text(['free', '-g'])
    text += run_text([sys.executable, '-m', 'pip', 'list', '--format=freeze'])
    (OUT / 'device.txt').write_text(text)
    print(text)


def stage(part: int) -> None:
    STAGE.mkdir(exist_ok=True)
    shutil.copy2(HERE / f'part-{part}', STAGE / f'part-{part}')
    log(f'part {part} kept in {STAGE}: {sorted(p.name for p in STAGE.iterdir())}')
    if part == 1:
        record_device()


def unpack() -> None:
    """Join the three parts, check the whole against SHA256SUMS, unpack with tarfile (the device has no xz)."""
    if (SITE / 'vllm').is_dir():
        log(f'{SITE} already unpacked')
        return
    shutil.copy2(HERE / 'part-3', STAGE / 'part-3')
    expected = (HERE / 'SHA256SUMS').read_text().split()[0]
    digest = hashlib.sha256()
    for part in (1, 2, 3):
        digest.update((STAGE / f'part-{part}').read_bytes())
    if digest.hexdigest() != expected:
        sys.exit(f'the joined parts in {STAGE} have sha256 {digest.hexdigest()}, SHA256SUMS says {expected}')
    SITE.mkdir(parents=True, exist_ok=True)
    reader, writer = os.pipe()
    with os.fdopen(writer, 'wb') as sink:
        joiner = subprocess.Popen(['cat', *(str(STAGE / f'part-{part}') for part in (1, 2, 3))], stdout=sink)
    with os.fdopen(reader, 'rb') as source, tarfile.open(fileobj=source, mode='r|xz') as archive:
        archive.extractall(SITE, filter='fully_trusted')
    joiner.wait()
    log(f'unpacked into {SITE}')


def top_level(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = {name.split('/')[0] for name in archive.namelist()}
    return sorted(name.removesuffix('.py') for name in names if '.dist-info' not in name and '.data' not in name)


def install_wheels(wheels: list[Path], target: Path, upgrade: bool = False) -> None:
    if wheels:
        subprocess.run(
            [
                sys.executable,
                '-m',
                'pip',
                'install',
                '-q',
                '--no-index',
                '--no-deps',
                '--no-compile',
                *(['--upgrade'] if upgrade else []),
                '--target',
                str(target),
                *map(str, wheels),
            ],
            check=True,
        )


def install_helpers() -> None:
    """ansible-core for the gate code; of the spare wheels only those whose module the device's Python lacks."""
    if not ANSIBLE_SITE.is_dir():
        install_wheels(sorted((HERE / 'ansible').glob('*.whl')), ANSIBLE_SITE)
    # Wheels that replace the payload's own, for a fix found after the payload was packed (packing takes minutes).
    install_wheels(sorted((HERE / 'overrides').glob('*.whl')), SITE, upgrade=True)
    missing = [
        wheel
        for wheel in sorted((HERE / 'spares').glob('*.whl'))
        if any(importlib.util.find_spec(name) is None for name in top_level(wheel))
    ]
    log(f'spare wheels installed (their module missing on the device): {[w.name for w in missing]}')
    install_wheels(missing, SPARES_SITE)


IMPORTED = (
    'vllm.entrypoints.openai.api_server',
    'vllm.v1.engine.core',
    'vllm.model_executor.models.deepseek_v2',
    'vllm.model_executor.models.kimi_k25',
)


def import_probe(env: dict[str, str]) -> list[str]:
    """Import what serving imports; a module missing from the site and the device comes from the spare wheels."""
    seen: list[str] = []
    spares = {name: wheel for wheel in (HERE / 'spares').glob('*.whl') for name in top_level(wheel)}
    for _ in range(len(spares) + 1):
        code = f'import {", ".join(IMPORTED)}'
        proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            return seen + ['imports ok']
        missing = re.search(r"No module named '([^'.]+)", proc.stderr)
        seen.append(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f'exit {proc.returncode}')
        if missing is None or missing.group(1) not in spares:
            return seen
        install_wheels([spares[missing.group(1)]], SPARES_SITE)
    return seen


def serve_environment(plan_dir: Path) -> dict[str, str]:
    """The unit's environment file as the role rendered it, its directories made (systemd would), and the site."""
    env = dict(os.environ)
    for line in (plan_dir / 'environment').read_text().splitlines():
        if line and not line.startswith('#') and '=' in line:
            name, value = line.split('=', 1)
            env[name] = value.strip('"')
    for name in ('HOME', 'XDG_CACHE_HOME', 'HF_HOME', 'HF_MODULES_CACHE', 'VLLM_CACHE_ROOT', 'TRITON_CACHE_DIR'):
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    env.update(DEVICE_ENV)
    env['PYTHONPATH'] = f'{SITE}:{SPARES_SITE}'
    env['PYTHONUNBUFFERED'] = '1'
    return env


def start(plan: dict[str, Any], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    socket = plan['unix_socket']
    Path(socket).parent.mkdir(parents=True, exist_ok=True)
    Path(socket).unlink(missing_ok=True)
    argv = plan['plan']['serve_argv']
    log(f'starting: {" ".join(argv)}')
    with log_path.open('w') as sink:
        return subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


# Runs a module as Ansible does (its arguments file in argv), with its transport wrapped to keep every exchange:
# the recorded answers that tests/unit/test_gpu_run.py judges again.
RECORDING_RUNNER = """
import importlib, json, sys
module = importlib.import_module('ansible_collections.llmserve.vllm.plugins.modules.' + sys.argv[1])
record, exchanges = sys.argv[3], []
made = getattr(module, 'make_transport', None)
def recording(*args, **kwargs):
    http = made(*args, **kwargs)
    def call(method, path, payload, timeout, limit):
        entry = {'method': method, 'path': path, 'payload': payload}
        exchanges.append(entry)
        try:
            entry['status'], entry['text'] = http(method, path, payload, timeout, limit)
        except Exception as exc:
            entry['error'] = '%s: %s' % (type(exc).__name__, exc)
            raise
        finally:
            with open(record, 'w') as sink:
                json.dump(exchanges, sink, indent=1)
        return entry['status'], entry['text']
    return call
if made is not None:
    module.make_transport = recording
sys.argv = [sys.argv[0], sys.argv[2]]
module.main()
"""


def gate(module: str, args: dict[str, Any], name: str, plan: str) -> dict[str, Any]:
    """Run llmserve.vllm.MODULE as Ansible runs it (an arguments file), with the carried ansible-core; its exchanges
    with the server go to OUT/PLAN-NAME-exchanges.json."""
    args_file = ROOT / f'{name}-args.json'
    args_file.write_text(json.dumps({'ANSIBLE_MODULE_ARGS': {k: v for k, v in args.items() if v is not None}}))
    env = dict(os.environ, PYTHONPATH=f'{ANSIBLE_SITE}:{HERE / "collection"}')
    record = OUT / f'{plan}-{name}-exchanges.json'
    argv = [sys.executable, '-c', RECORDING_RUNNER, module, str(args_file), str(record)]
    began = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        result = {'failed': True, 'stdout': proc.stdout[-4000:], 'stderr': proc.stderr[-4000:]}
    result['gate_seconds'] = round(time.monotonic() - began, 2)
    log(f'{name}: {"FAILED " + str(result.get("msg", ""))[:300] if result.get("failed") else "passed"}')
    return result


def stop(server: subprocess.Popen, grace: float) -> dict[str, Any]:
    """SIGTERM, as systemd stops the unit; the seconds until the process group is gone."""
    began = time.monotonic()
    if server.poll() is not None:
        return {'signal': None, 'exit_code': server.returncode, 'stop_seconds': 0.0, 'killed_after_grace': False}
    os.killpg(server.pid, signal.SIGTERM)
    try:
        code: int | None = server.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        code = None
    return {
        'signal': 'SIGTERM',
        'exit_code': code,
        'stop_seconds': round(time.monotonic() - began, 2),
        'killed_after_grace': code is None,
    }


class UnixConnection(http.client.HTTPConnection):
    """HTTP over vLLM's --uds socket (the device may have no curl)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__('localhost', timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def request(path: str, url: str, body: dict[str, Any] | None = None, key: str = '') -> tuple[int, str]:
    connection = UnixConnection(path, 120)
    headers = {'Content-Type': 'application/json', **({'Authorization': f'Bearer {key}'} if key else {})}
    try:
        connection.request('POST' if body else 'GET', url, json.dumps(body) if body else None, headers)
        answer = connection.getresponse()
        return answer.status, answer.read().decode(errors='replace')
    except OSError as exc:
        return 0, str(exc)
    finally:
        connection.close()


def wait_healthy(plan: dict[str, Any], server: subprocess.Popen, deadline: float) -> float | None:
    """Seconds until /health answers 200 on the socket, or None when the server died or the deadline passed."""
    began = time.monotonic()
    while time.monotonic() - began < deadline and server.poll() is None:
        if request(plan['unix_socket'], '/health')[0] == 200:
            return round(time.monotonic() - began, 1)
        time.sleep(1)
    return None


# The role's gates in the order tasks/gate.yml and tasks/perf_gate.yml run them.
GATES = [
    ('coherence', 'chat_check'),
    ('thinking_off', 'chat_check'),
    ('long_prompt', 'chat_check'),
    ('load_probe', 'load_probe'),
]


def serve_miniature(plan_dir: Path, results: dict[str, Any]) -> None:
    """The GPU miniature (tools/gpu_run/miniature.py): start, the role's gates in their order, a graceful stop."""
    plan = json.loads((plan_dir / 'plan.json').read_text())
    gates = json.loads((plan_dir / 'gates.json').read_text())
    model_dir = Path(plan['plan']['model_dir'])
    if not model_dir.is_dir():
        shutil.copytree(HERE / 'model', model_dir)
    env = serve_environment(plan_dir)
    results['imports'] = import_probe(env)
    log(f'imports: {results["imports"]}')
    save(results)
    server = start(plan, env, OUT / f'{plan_dir.name}-start.log')
    try:
        results['healthy_after_seconds'] = wait_healthy(plan, server, time_left())
        if results['healthy_after_seconds'] is not None:
            for name, module in GATES:
                save(results)
                results[name] = gate(module, gates[name], name, plan_dir.name)
    finally:
        # vLLM runs in a session of its own, which would outlive the call and hold the GPU: always stopped here.
        results['stop'] = stop(server, 60)
        log(f'stop: {results["stop"]}')


def serve_synthetic(plan_dir: Path, results: dict[str, Any]) -> None:
    """The synthetic checkpoint: start, one request through the socket, stop; vLLM's log holds the figures."""
    plan = json.loads((plan_dir / 'plan.json').read_text())
    server = start(plan, serve_environment(plan_dir), OUT / f'{plan_dir.name}-start.log')
    try:
        results['healthy_after_seconds'] = wait_healthy(plan, server, time_left())
        if results['healthy_after_seconds'] is not None:
            body = {'model': plan['served_model_name'], 'prompt': 'The sky', 'max_tokens': 16}
            key = serve_environment(plan_dir).get('VLLM_API_KEY', '')
            results['completion'] = request(plan['unix_socket'], '/v1/completions', body, key)
    finally:
        results['stop'] = stop(server, 60)
        log(f'stop: {results["stop"]}')


def gpu_model() -> str:
    """h100 or h200: a call gets either, and the role planned for each (tools/gpu_run/plan)."""
    name = subprocess.run(
        ['nvidia-smi', '--query-gpu=name', '--format=csv,noheader'], capture_output=True, text=True, check=True
    ).stdout
    for model in ('h100', 'h200'):
        if model.upper() in name:
            return model
    sys.exit(f'no plan for the GPU {name.strip()!r}: the role planned for an H100 and an H200 (tools/gpu_run/plan)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest='action', required=True)
    sub.add_parser('stage').add_argument('part', type=int, choices=(1, 2))
    serve = sub.add_parser('serve')
    serve.add_argument(
        'plan', help='a folder under plan/: miniature-eager, miniature, synthetic-eager, synthetic-compiled'
    )
    serve.add_argument('--generate', action='store_true', help='generate the synthetic checkpoint first')
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.action == 'stage':
        stage(args.part)
        return
    results: dict[str, Any] = {'plan': args.plan, 'began': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}
    plan_dir = HERE / 'plan' / gpu_model() / args.plan
    results['gpu_model'] = plan_dir.parent.name
    try:
        unpack()
        install_helpers()
        results['unpacked_after_seconds'] = round(time.monotonic() - BEGAN, 1)
        if args.plan.startswith('miniature'):
            serve_miniature(plan_dir, results)
        else:
            if args.generate:
                generate_synthetic(plan_dir, results)
            serve_synthetic(plan_dir, results)
    finally:
        save(results)
        shutil.copy2(plan_dir / 'plan.json', OUT / f'{args.plan}-plan.json')


def generate_synthetic(plan_dir: Path, results: dict[str, Any]) -> None:
    """Generate the checkpoint where the plan says it is, on the disk or in /dev/shm, whichever has more room."""
    plan = json.loads((plan_dir / 'plan.json').read_text())
    target = Path(plan['plan']['model_dir'])
    room = {path: shutil.disk_usage(path).free for path in (Path('/tmp'), Path('/dev/shm'))}
    results['free_gib'] = {str(path): round(free / 2**30, 1) for path, free in room.items()}
    if max(room, key=lambda path: room[path]) == Path('/dev/shm') and not target.exists():
        (Path('/dev/shm') / 'gpu-run-synthetic').mkdir(exist_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(Path('/dev/shm') / 'gpu-run-synthetic')
    began = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            str(HERE / 'synthetic.py'),
            'generate',
            '--out',
            str(target),
            '--tokenizer-from',
            str(HERE / 'model'),
        ],
        check=True,
    )
    results['generate_seconds'] = round(time.monotonic() - began, 1)
    log(f'generated {target} in {results["generate_seconds"]} s ({results["free_gib"]} GiB free before)')


if __name__ == '__main__':
    main()
