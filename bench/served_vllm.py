# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The sandbox's miniature served as the sandbox serves it, for the benchmarks (bench/*.py import it).

`vllm serve` of tiny-kimi (or a revision of it) through the role's version shim with the sandbox's flags, on
127.0.0.1, every process kept to the cores of `cpus` as the default scenario's unit keeps them.
"""

import os
import socket
import subprocess
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.path.join(REPO, '.venv-vllm', 'bin', 'python')
VLLM_CLI = os.path.join(REPO, 'roles', 'vllm_kimi', 'files', 'llmserve-vllm-cli')
# inventories/sandbox/group_vars/vllm.yml's flags: its parsers, text only, its extra_args and KV cache.
SANDBOX_FLAGS = [
    '--reasoning-parser',
    'kimi_k2',
    '--tool-call-parser',
    'kimi_k2',
    '--enable-auto-tool-choice',
    '--language-model-only',
    '--enforce-eager',
    '--compilation-config',
    '{"custom_ops": ["all", "-rotary_embedding"]}',
    '--max-model-len',
    '1024',
    '--kv-cache-memory-bytes',
    '14155776',
]
SERVED_NAME = 'tiny'


def tiny_models():
    """The directory of tiny-kimi/ and its revisions (tools/make_tiny_models.py trains them once)."""
    return (
        subprocess.run(
            [VLLM_PYTHON, os.path.join(REPO, 'tools', 'make_tiny_models.py')], check=True, stdout=subprocess.PIPE
        )
        .stdout.decode()
        .strip()
        .splitlines()[-1]
    )


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


class Vllm:
    """vLLM's OpenAI server on loopback, `vllm serve` through the role's version shim, kept to cpus."""

    def __init__(self, model, cpus, log, extra_flags=()):
        self.port = free_port()
        self.log_path = log
        self.log = open(log, 'w')  # noqa: SIM115 - open while the server runs, closed by stop()
        self.proc = subprocess.Popen(
            [
                'taskset',
                '-c',
                cpus,
                VLLM_PYTHON,
                VLLM_CLI,
                'serve',
                model,
                '--served-model-name',
                SERVED_NAME,
                '--port',
                str(self.port),
            ]
            + SANDBOX_FLAGS
            + list(extra_flags),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started = time.time()
        while True:
            try:
                urllib.request.urlopen('http://127.0.0.1:%d/v1/models' % self.port, timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.time() - started > 600:
                    self.stop()
                    raise SystemExit('vLLM did not come up; see %s' % log) from None
                time.sleep(1)
        self.ready_after = time.time() - started

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        self.log.close()
