# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The front door of the deployed sandbox, as a client on another machine meets it, and what stays behind it.

1. The official `openai` client, trusting only the sandbox's CA (tools/sandbox), gets an answer over TLS; a client
   without the CA is refused, and so is one without the API key (401). A client's own key (vllm_kimi_front_client_keys)
   is answered, and revoked by a reload of the front door alone.
2. Paths vLLM serves to anyone who reaches its port (/invocations runs chat completions without the key) are
   answered 404 by the front door, however the path is spelled; added to vllm_kimi_front_paths, they need the key;
   /metrics only for the Prometheus sources, by the connection's own address.
3. vLLM's own port listens on loopback only; the unit's IP fences are set.
4. An image_url at a loopback canary is refused, and the canary is never reached.
5. The front door logs the client's address and the path, never a body or the key.
6. `--diff` of a change to vllm_kimi_environment never shows its value.
7. Through a restart: a stream in flight ends with its last token (the stop drains it), and a request that arrives
   while vLLM is down gets 503 with Retry-After at once, never a refused connection or a 502.
8. Per client address: the requests in progress (503 past them) and the rate (429 past the burst); per path, the
   methods vLLM serves there (405); request bodies buffered in a tmpfs of the door's unit only; wrong keys count
   against those limits (429); a completions request's prompts times n stays within the sequence bound. A keyless upload gets
   401 before its body is read; a body that stops after one byte is let go at the body timeout (sent as the file
   begins, judged at its end: the minute runs beside the other tests).
"""

import http.client
import json
import shlex
import ssl
import threading
import time

import anthropic
import httpx2
import openai
import pytest
from sandbox_helpers import CA, task_results

from ansible_collections.llmserve.vllm.tests.support import Canary

QUESTION = 'What is the capital of France?'
# Served by vLLM to whoever reaches its port, with no key: never through the front door.
BEHIND_THE_DOOR = [
    '/invocations',
    '/tokenize',
    '/detokenize',
    '/pooling',
    '/score',
    '/load',
    '/ping',
    '/version',
    '/collective_rpc',
    '/reset_prefix_cache',
    '/v1/load_lora_adapter',
    # Spellings that normalize to a refused path, or to an allowed one with something else around it.
    '/v1/models/../../invocations',
    '/v1/chat/completions/../../../invocations',
    '/%69nvocations',
    '/v1/chat/completions/',
]


@pytest.fixture(scope='module')
def front(sandbox):
    return 'https://127.0.0.1:%s' % sandbox.vars['vllm_kimi_front_port']


# A loopback address of its own: the door bounds connections and rate per client address, which the other tests fill.
STALLED_BODY_SOURCE = '127.0.0.9'
# The door is given this much longer than its body timeout before the test calls the body held.
STALLED_BODY_GRACE = 5


@pytest.fixture(scope='module', autouse=True)
def stalled_body(sandbox):
    """A request with the key whose body stops after its first byte, sent as the file's first test starts, so that
    the door's body timeout runs out while the other tests run; judged by the file's last test. (thread, outcome)"""
    timeout = int(sandbox.vars['vllm_kimi_front_body_timeout']) + STALLED_BODY_GRACE
    outcome = {}

    def send():
        connection = http.client.HTTPSConnection(
            '127.0.0.1',
            int(sandbox.vars['vllm_kimi_front_port']),
            context=ssl.create_default_context(cafile=CA),
            source_address=(STALLED_BODY_SOURCE, 0),
            timeout=timeout,
        )
        started = time.monotonic()
        try:
            connection.putrequest('POST', '/v1/chat/completions')
            connection.putheader('Content-Type', 'application/json')
            connection.putheader('Content-Length', '1000')
            connection.putheader('Authorization', 'Bearer ' + sandbox.vars['vllm_kimi_api_key'])
            connection.endheaders(b'{')
            outcome['status'] = connection.getresponse().status
        except http.client.RemoteDisconnected:
            outcome['status'] = 'closed'
        except OSError as exc:
            outcome['status'] = type(exc).__name__
        finally:
            outcome['seconds'] = round(time.monotonic() - started, 1)
            connection.close()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, outcome, timeout


def client(front, api_key, verify=True):
    context = ssl.create_default_context(cafile=CA) if verify else ssl.create_default_context()
    return openai.OpenAI(
        base_url=front + '/v1',
        api_key=api_key,
        http_client=httpx2.Client(verify=context, timeout=120),
        max_retries=0,
    )


def ask(openai_client, sandbox, content=QUESTION):
    return openai_client.chat.completions.create(
        model=sandbox.vars['vllm_kimi_served_model_name'],
        temperature=0,
        max_tokens=256,
        messages=[{'role': 'user', 'content': content}],
    )


def status(sandbox, path, method='GET', source='127.0.0.1', body=None):
    """The front door's status for a raw path, sent as written (no client-side normalization)."""
    connection = http.client.HTTPSConnection(
        '127.0.0.1',
        int(sandbox.vars['vllm_kimi_front_port']),
        context=ssl.create_default_context(cafile=CA),
        source_address=(source, 0),
        timeout=30,
    )
    try:
        connection.request(method, path, body=body, headers={'Content-Type': 'application/json'})
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_openai_client_gets_an_answer_over_tls(sandbox, front):
    reply = ask(client(front, sandbox.vars['vllm_kimi_api_key']), sandbox)
    assert reply.choices[0].message.content == 'The capital of France is Paris.'


def anthropic_client(front, api_key):
    """Anthropic's official client as coding agents configure it for a Bearer-token gateway (auth_token): vLLM takes
    its key as a Bearer token on /v1/messages too."""
    return anthropic.Anthropic(
        base_url=front,
        auth_token=api_key,
        http_client=httpx2.Client(verify=ssl.create_default_context(cafile=CA), timeout=120),
        max_retries=0,
    )


def test_openais_responses_api_answers_through_the_front_door(sandbox, front):
    """/v1/responses, the default of OpenAI's agent SDK, with the same key as chat completions."""
    reply = client(front, sandbox.vars['vllm_kimi_api_key']).responses.create(
        model=sandbox.vars['vllm_kimi_served_model_name'], input=QUESTION, max_output_tokens=256, temperature=0
    )
    assert (reply.status, reply.output_text) == ('completed', 'The capital of France is Paris.')


def test_anthropics_messages_api_answers_through_the_front_door_with_its_thinking_apart(sandbox, front):
    message = anthropic_client(front, sandbox.vars['vllm_kimi_api_key']).messages.create(
        model=sandbox.vars['vllm_kimi_served_model_name'],
        max_tokens=256,
        messages=[{'role': 'user', 'content': QUESTION}],
        # The tiny model answers greedily; the Messages API's default samples.
        extra_body={'temperature': 0},
    )
    blocks = [
        (block.type, getattr(block, 'text', None) or getattr(block, 'thinking', None)) for block in message.content
    ]
    assert message.stop_reason == 'end_turn', blocks
    assert [text for kind, text in blocks if kind == 'text'] == ['The capital of France is Paris.'], blocks
    # Kimi's reasoning arrives as a thinking block, not in the answer.
    assert [kind for kind, text in blocks] == ['thinking', 'text'], blocks


def test_the_messages_api_with_a_wrong_key_gets_401(sandbox, front):
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic_client(front, 'not-the-key').messages.create(
            model=sandbox.vars['vllm_kimi_served_model_name'],
            max_tokens=16,
            messages=[{'role': 'user', 'content': QUESTION}],
        )
    assert refused.value.status_code == 401


def test_a_request_for_more_completions_than_the_bound_gets_400(sandbox, front):
    """vllm_kimi_max_n_sequences (8 by default, VLLM_MAX_N_SEQUENCES) bounds n: vLLM's own 16384 would let one request
    take a whole batch."""
    limit = sandbox.vars['vllm_kimi_max_n_sequences']
    with pytest.raises(openai.BadRequestError) as refused:
        client(front, sandbox.vars['vllm_kimi_api_key']).chat.completions.create(
            model=sandbox.vars['vllm_kimi_served_model_name'],
            n=limit + 1,
            max_tokens=1,
            messages=[{'role': 'user', 'content': QUESTION}],
        )
    assert refused.value.status_code == 400
    assert 'n must be at most %d, got %d' % (limit, limit + 1) in str(refused.value), refused.value


def test_a_client_that_does_not_trust_the_sandbox_ca_is_refused(sandbox, front):
    with pytest.raises(openai.APIConnectionError) as refused:
        ask(client(front, sandbox.vars['vllm_kimi_api_key'], verify=False), sandbox)
    assert 'CERTIFICATE_VERIFY_FAILED' in repr(refused.value.__cause__) or 'certificate' in repr(
        refused.value.__cause__
    ), repr(refused.value.__cause__)


def test_a_client_with_a_wrong_key_gets_401(sandbox, front):
    with pytest.raises(openai.AuthenticationError) as refused:
        ask(client(front, 'not-the-key'), sandbox)
    assert refused.value.status_code == 401


def test_a_request_without_a_key_gets_401(sandbox):
    # The openai client refuses to send a request without a key; a plain HTTPS request is what an attacker sends.
    body = json.dumps(
        {'model': sandbox.vars['vllm_kimi_served_model_name'], 'messages': [{'role': 'user', 'content': QUESTION}]}
    )
    assert status(sandbox, '/v1/chat/completions', 'POST', body=body) == 401


def test_a_clients_own_key_is_answered_and_revoked_without_a_restart(sandbox, front):
    """vLLM knows one key; the door accepts each client's own and hands vLLM that one. Removing a client's key from
    the inventory revokes it at the front door's reload, while vLLM serves on."""
    client_key = sandbox.vars['vllm_kimi_front_client_keys'][0]
    served_by = sandbox.show('MainPID')['MainPID']
    assert ask(client(front, client_key), sandbox).choices[0].message.content == 'The capital of France is Paris.'
    try:
        rc, output, report = sandbox.deploy('--tags', 'vllm_kimi_front', '-e', '{"vllm_kimi_front_client_keys": []}')
        assert rc == 0, output[-3000:]
        with pytest.raises(openai.AuthenticationError):
            ask(client(front, client_key), sandbox)
        assert ask(client(front, sandbox.vars['vllm_kimi_api_key']), sandbox).choices[0].message.content
        assert sandbox.show('MainPID')['MainPID'] == served_by
    finally:
        restore_rc, restore_output, restore_report = sandbox.deploy('--tags', 'vllm_kimi_front')
    assert restore_rc == 0, restore_output[-3000:]
    for text in (output, restore_output):
        assert client_key not in text and sandbox.vars['vllm_kimi_api_key'] not in text
    assert ask(client(front, client_key), sandbox).choices[0].message.content == 'The capital of France is Paris.'


def test_a_keyless_upload_is_refused_before_its_body_is_read(sandbox):
    """The door checks the key before it reads a body: a client without it that announces 30 MB and sends a few
    bytes gets 401, not the 408 of a door that waited for the body (after vllm_kimi_front_body_timeout; the client
    gives up at half of it), and nothing of it is buffered (nginx would otherwise read and buffer the body for vLLM)."""
    connection = http.client.HTTPSConnection(
        '127.0.0.1',
        int(sandbox.vars['vllm_kimi_front_port']),
        context=ssl.create_default_context(cafile=CA),
        timeout=int(sandbox.vars['vllm_kimi_front_body_timeout']) / 2,
    )
    try:
        connection.putrequest('POST', '/v1/chat/completions')
        connection.putheader('Content-Type', 'application/json')
        connection.putheader('Content-Length', str(30 * 1000 * 1000))
        connection.putheader('Authorization', 'Bearer not-the-key')
        connection.endheaders(b'{"model": "')
        # Waiting for the body would end in 408 after client_body_timeout (vllm_kimi_front_body_timeout), not in 401.
        reply = connection.getresponse()
        assert reply.status == 401, reply.read()
    finally:
        connection.close()
    buffers = in_the_front_doors_mounts(sandbox, 'find /var/cache/%s-front -type f | wc -l' % sandbox.unit).strip()
    assert buffers == '0', buffers


def in_the_front_doors_mounts(sandbox, command):
    """command's output, run in the front door unit's mount namespace (its buffers are a tmpfs of its own)."""
    return sandbox.sh('nsenter --target "$(systemctl show -P MainPID %s-front)" --mount %s' % (sandbox.unit, command))


def test_the_front_door_buffers_bodies_in_bounded_memory_only(sandbox):
    mount = in_the_front_doors_mounts(
        sandbox, 'findmnt --noheadings --output FSTYPE,OPTIONS /var/cache/%s-front' % (sandbox.unit)
    ).split()
    # vllm_kimi_front_buffer_space's default, 1g.
    assert mount[0] == 'tmpfs' and 'size=1048576k' in mount[1].split(','), mount
    # The host's own directory holds nothing the workers wrote.
    assert sandbox.sh('find /var/cache/%s-front -type f | wc -l' % sandbox.unit).strip() == '0'


# The start of the scripts below, run on the sandbox: HTTP over vLLM's Unix socket, whose path is the first argument.
UNIX_CONNECTION = r"""
import http.client, socket, subprocess, sys, time
class UnixConnection(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(120)
        self.sock.connect(sys.argv[1])
"""
# Run as a given user: POSTs the body to /invocations on the socket; prints the status, or the error.
ASK_THE_SOCKET = (
    UNIX_CONNECTION
    + r"""
body = sys.argv[2]
connection = UnixConnection('localhost')
try:
    connection.request('POST', '/invocations', body=body, headers={'Content-Type': 'application/json'})
    print(connection.getresponse().status)
except OSError as exc:
    print(type(exc).__name__)
"""
)
INVOCATION = json.dumps({'messages': [{'role': 'user', 'content': QUESTION}], 'max_tokens': 8, 'temperature': 0})


def ask_the_socket_as(sandbox, user):
    switch = '' if user == 'root' else 'setpriv --reuid=%s --regid=$(id -g %s) --init-groups ' % (user, user)
    return sandbox.sh(
        '%spython3 -I -c %s %s %s'
        % (switch, shlex.quote(ASK_THE_SOCKET), shlex.quote(sandbox.unix_socket), shlex.quote(INVOCATION))
    ).strip()


def test_only_root_and_the_front_doors_workers_reach_vllms_socket(sandbox):
    """What the front door keeps out, vLLM answers to whoever reaches it: /invocations runs a chat completion without
    the key. On its Unix socket only root (the gates) and the front door's workers get there; any other local user is
    refused by the socket's permissions."""
    assert sandbox.unix_socket, 'the sandbox inventory serves vLLM on its Unix socket (vllm_kimi_listen unix)'
    assert ask_the_socket_as(sandbox, 'root') == '200'
    # vllm_kimi_front_user, as the role's default names it.
    assert ask_the_socket_as(sandbox, sandbox.unit + '-front') == '200'
    sandbox.sh('id llmserve-stranger >/dev/null 2>&1 || useradd --system --no-create-home llmserve-stranger')
    assert ask_the_socket_as(sandbox, 'llmserve-stranger') == 'PermissionError'
    assert ask_the_socket_as(sandbox, 'nobody') == 'PermissionError'
    assert status(sandbox, '/invocations', 'POST', body=INVOCATION) == 404


@pytest.mark.parametrize('path', BEHIND_THE_DOOR)
def test_the_front_door_answers_404_for_what_vllm_serves_to_anyone(sandbox, path):
    assert status(sandbox, path) == 404
    assert status(sandbox, path, 'POST', body='{}') == 404


def test_health_passes_without_the_key_and_models_with_it(sandbox, front):
    assert status(sandbox, '/health') == 200
    models = client(front, sandbox.vars['vllm_kimi_api_key']).models.list()
    assert [model.id for model in models.data] == [sandbox.vars['vllm_kimi_served_model_name']]


def test_metrics_only_for_the_prometheus_sources(sandbox):
    assert sandbox.vars['vllm_kimi_front_metrics_sources'] == ['127.0.0.1']
    assert status(sandbox, '/metrics') == 200
    # Another loopback address is not a listed source.
    assert status(sandbox, '/metrics', source='127.0.0.2') == 403


def test_vllm_holds_no_tcp_listener_any_other_process_reaches(sandbox):
    """On a single node vLLM serves on its Unix socket, and its unit has a network namespace of its own: the TCP
    listeners its ranks make (Gloo's, torch's store) are on that namespace's loopback, which nothing else shares."""
    pids = {
        row.split()[0]
        for row in sandbox.sh('ps -eo pid=,unit=').splitlines()
        if row.split()[1:] == [sandbox.unit + '.service']
    }
    assert pids
    host_sockets = [
        line for line in sandbox.sh('ss -ltnpH').splitlines() if any('pid=%s,' % pid in line for pid in pids)
    ]
    assert host_sockets == []
    main_pid = sandbox.show('MainPID')['MainPID']
    links = sandbox.sh('nsenter --target %s --net ip -o link show' % main_pid)
    assert [line.split(':')[1].strip() for line in links.splitlines()] == ['lo'], links
    assert sandbox.show('PrivateNetwork')['PrivateNetwork'] == 'yes'
    # The socket is bound in that namespace (its path is reached from any: the front door's workers connect to it).
    assert sandbox.unix_socket in sandbox.sh('nsenter --target %s --net ss -lxpH' % main_pid)


def test_the_units_ip_fences_are_set(sandbox):
    fences = sandbox.show('IPAddressDeny', 'IPAddressAllow')
    # systemd lists an address set in no fixed order.
    assert set(fences['IPAddressDeny'].split()) == {'0.0.0.0/0', '::/0'}
    assert set(fences['IPAddressAllow'].split()) == {'127.0.0.0/8', '::1/128'}


# Run as root on the sandbox: listeners made outside the unit, then this process joins the unit's cgroup, where the
# unit's IP fence (BPF programs systemd attached to it) governs every socket it makes from then on.
FENCE_PROBE = r"""
import json, os, socket, sys
control_group, addresses = sys.argv[1], sys.argv[2:]
listeners = {}
for address in addresses:
    listeners[address] = socket.socket()
    listeners[address].bind((address, 0))
    listeners[address].listen()
with open('/sys/fs/cgroup%s/cgroup.procs' % control_group, 'w') as procs:
    procs.write(str(os.getpid()))
outcomes = {}
for address, listener in listeners.items():
    try:
        socket.create_connection((address, listener.getsockname()[1]), timeout=3).close()
        outcomes[address] = 'connected'
    except OSError as exc:
        outcomes[address] = type(exc).__name__
print(json.dumps(outcomes))
"""


def test_the_host_name_resolves_off_loopback_as_on_a_data_centre_image(sandbox):
    # What binds to "the host's address" (Gloo, NCCL's bootstrap) meets the fence, as on a real host.
    address = sandbox.sh('getent hosts "$(hostname)"').split()[0]
    assert not address.startswith('127.'), address


def test_a_connection_from_inside_the_unit_outside_its_allow_list_is_dropped(sandbox):
    site = sandbox.sh('getent hosts "$(hostname)"').split()[0]
    control_group = sandbox.show('ControlGroup')['ControlGroup']
    outcomes = json.loads(
        sandbox.sh('python3 -c %s %s 127.0.0.1 %s' % (shlex.quote(FENCE_PROBE), shlex.quote(control_group), site))
    )
    # Loopback is in IPAddressAllow (the control); the host's own LAN-like address is not.
    assert outcomes == {'127.0.0.1': 'connected', site: 'TimeoutError'}


def test_an_image_url_at_a_loopback_canary_is_refused_unreached(sandbox, front):
    # The sandbox shares this machine's loopback: the canary is where vLLM could reach it.
    canary = Canary()
    redirector = Canary(to=canary.url)
    try:
        for url in (canary.url, redirector.url):
            image_and_question = [{'type': 'image_url', 'image_url': {'url': url}}, {'type': 'text', 'text': QUESTION}]
            with pytest.raises(openai.BadRequestError):
                ask(client(front, sandbox.vars['vllm_kimi_api_key']), sandbox, image_and_question)
        assert canary.hits == [] and redirector.hits == []
    finally:
        canary.close()
        redirector.close()


def test_the_front_door_logs_client_and_path_but_no_body_or_key(sandbox, front):
    ask(client(front, sandbox.vars['vllm_kimi_api_key']), sandbox)
    log = sandbox.sh('journalctl -u %s-front -o cat --no-pager -n 200' % sandbox.unit)
    assert '127.0.0.1 "POST /v1/chat/completions" 200 ' in log, log[-2000:]
    assert QUESTION not in log and sandbox.vars['vllm_kimi_api_key'] not in log


CANARY_SECRET = 'llmserve-canary-secret-7d1f0c'
ENVIRONMENT_TASK = "Ensure the environment file holds the service's settings and secrets"


def test_diff_of_a_secret_in_the_environment_never_shows_it(sandbox):
    rc, output, report = sandbox.deploy(
        '--check', '--diff', '--tags', 'vllm_kimi_service', '-e',
        json.dumps({'vllm_kimi_environment': {'LLMSERVE_CANARY_TOKEN': CANARY_SECRET}}),
    )  # fmt: skip
    assert rc == 0, output[-3000:]
    environment = dict(task_results(report, sandbox.name))[ENVIRONMENT_TASK]
    # The file would change: a diff was there to show, and was not shown.
    assert environment.get('changed'), environment
    assert CANARY_SECRET not in output
    assert CANARY_SECRET not in json.dumps(report)


# Within the miniature's context (max_model_len 1024 in inventories/sandbox): some seconds of generation here.
DRAINED_TOKENS = 900
# Restarts the service once vLLM's engine runs a request (its own gauge), from inside the sandbox: a restart sent
# after the client's first chunk arrives seconds later through Ansible, when the miniature may have finished.
RESTART_WHEN_RUNNING = (
    UNIX_CONNECTION
    + """
unit = sys.argv[2]
def running():
    connection = UnixConnection('localhost')
    connection.request('GET', '/metrics')
    metrics = connection.getresponse().read().decode()
    connection.close()
    return any(line.startswith('vllm:num_requests_running') and float(line.split()[-1]) > 0
               for line in metrics.splitlines())
while not running():
    time.sleep(0.05)
# A deliberate restart, as the role's: the earlier tests' restarts must not have used up the start limit.
subprocess.run(['systemctl', 'reset-failed', unit], check=True)
subprocess.run(['systemctl', 'restart', '--no-block', unit], check=True)
"""
)


def test_a_restart_drains_the_stream_in_flight_and_answers_503_while_down(sandbox, front):
    """The stop's SIGTERM reaches the API server alone (KillMode=mixed), which drains the engine for up to
    --shutdown-timeout while it keeps generating: the stream ends with its last token. With vLLM's default (0) the
    engine is aborted and the stream ends without its tokens; with KillMode=control-group every process is killed at
    once. Until the new start listens, the front door answers 503 with Retry-After (without it, 502)."""
    users = client(front, sandbox.vars['vllm_kimi_api_key'])
    before = sandbox.show('MainPID')['MainPID']
    cursor = sandbox.sh('journalctl --quiet --lines=0 --show-cursor').strip().split('cursor: ', 1)[1]
    sandbox.sh(
        'systemd-run --quiet --collect --unit=llmserve-test-restart -p RuntimeMaxSec=300 python3 -c %s %s %s',
        RESTART_WHEN_RUNNING,
        sandbox.unix_socket,
        sandbox.unit,
    )
    stream = users.chat.completions.create(
        model=sandbox.vars['vllm_kimi_served_model_name'],
        temperature=0,
        messages=[{'role': 'user', 'content': QUESTION}],
        max_tokens=DRAINED_TOKENS,
        stream=True,
        stream_options={'include_usage': True},
        extra_body={'ignore_eos': True, 'min_tokens': DRAINED_TOKENS},
    )
    finish, usage, last_chunk_at = None, None, None
    for chunk in stream:
        last_chunk_at = time.time()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            usage = chunk.usage
    assert finish == 'length' and usage is not None and usage.completion_tokens == DRAINED_TOKENS, (finish, usage)
    # The old API server has stopped listening and the new one loads for tens of seconds: vLLM is down.
    with pytest.raises(openai.APIStatusError) as down:
        ask(users, sandbox)
    assert down.value.status_code == 503, down.value
    assert down.value.response.headers.get('retry-after') == str(sandbox.vars['vllm_kimi_front_retry_after'])
    # The stop drained, and began while the stream was still coming: vLLM logged it before the stream's last chunk.
    stopping = sandbox.host.run(
        "journalctl --after-cursor %s -u %s -o short-unix --no-pager | grep -m1 'stopping engine client mode='",
        cursor,
        sandbox.unit,
    ).stdout
    assert 'mode=drain' in stopping, 'the stop did not drain the requests in flight: %r' % stopping
    assert float(stopping.split()[0]) < last_chunk_at, (stopping, last_chunk_at)
    sandbox.wait_for('the restart', lambda: sandbox.show('MainPID', 'ActiveState')['MainPID'] not in ('0', before), 300)
    gate = sandbox.gate()
    assert not gate.get('failed'), gate.get('msg')
    assert ask(users, sandbox).choices[0].message.content == 'The capital of France is Paris.'


def front_connection(sandbox, source='127.0.0.1'):
    return http.client.HTTPSConnection(
        '127.0.0.1',
        int(sandbox.vars['vllm_kimi_front_port']),
        context=ssl.create_default_context(cafile=CA),
        timeout=10,
        source_address=(source, 0),
    )


# vllm_kimi_front_connections_per_client, vllm_kimi_front_requests_per_second and vllm_kimi_front_request_burst:
# the role's defaults.
REQUESTS_IN_PROGRESS = 32
REQUESTS_PER_SECOND = 10
REQUEST_BURST = 64


# Loopback addresses of their own: the door's bucket and count of connections of each are untouched when its test
# begins, and what the test takes from them no later test misses.
BURST_SOURCE = '127.0.0.10'
HELD_SOURCE = '127.0.0.11'


# Requests sent, at most, until the door refuses some: faster than REQUESTS_PER_SECOND even on a loaded machine.
BURST_ATTEMPTS = 400


def test_a_burst_past_the_rate_of_one_address_gets_429_until_it_refills(sandbox):
    """One address's requests on one connection: the burst passes at once, then only what the rate refilled while
    they were sent (nginx's limit_req with nodelay), judged against the time they took, however loaded the machine."""
    connection = front_connection(sandbox, BURST_SOURCE)
    statuses, until_refused = [], 0.0
    try:
        started = time.monotonic()
        while len(statuses) < BURST_ATTEMPTS and statuses.count(429) < 10:
            connection.request('GET', '/health')
            reply = connection.getresponse()
            reply.read()
            statuses.append(reply.status)
            if reply.status == 429 and statuses.count(429) == 1:
                until_refused = time.monotonic() - started
    finally:
        connection.close()
    assert set(statuses) == {200, 429}, statuses
    passed_first = statuses.index(429)
    # The whole burst, and the request the bucket holds, passed before the first refusal; beyond that only what the
    # rate refilled meanwhile (one more for a refill that came between two requests).
    assert REQUEST_BURST + 1 <= passed_first <= REQUEST_BURST + 2 + REQUESTS_PER_SECOND * until_refused, (
        passed_first,
        until_refused,
    )
    # The limit is this address's: another is still let through.
    assert status(sandbox, '/health', 'GET') == 200


def test_the_33rd_request_in_progress_from_one_address_is_refused(sandbox):
    """Each request, with the key, announces a body it does not send: nginx holds it in progress while it waits for
    the body. The 33rd from the same address gets 503 at once; the 32 before it get nothing yet."""
    held = []
    try:
        for dummy in range(REQUESTS_IN_PROGRESS + 1):
            connection = front_connection(sandbox, HELD_SOURCE)
            connection.putrequest('POST', '/v1/chat/completions')
            connection.putheader('Content-Type', 'application/json')
            connection.putheader('Content-Length', '1000')
            connection.putheader('Authorization', 'Bearer ' + sandbox.vars['vllm_kimi_api_key'])
            connection.endheaders(b'{"model": "')
            held.append(connection)
        reply = held[-1].getresponse()
        assert reply.status == 503, reply.read()
        held[0].sock.settimeout(1)
        with pytest.raises(TimeoutError):
            held[0].getresponse()
    finally:
        for connection in held:
            connection.close()


WRONG_KEY_SOURCE = '127.0.0.12'
WRONG_KEYS = 300


def test_wrong_keys_count_against_the_clients_limits(sandbox):
    """The key is checked in nginx's access phase, after limit_req: 300 wrong keys from one address, as fast as one
    connection sends them, meet 429 past the burst, where a check before the limits answered each 401. Another
    address is still answered."""
    connection = front_connection(sandbox, WRONG_KEY_SOURCE)
    statuses = []
    try:
        for attempt in range(WRONG_KEYS):
            connection.request('GET', '/v1/models', headers={'Authorization': 'Bearer wrong-%064d' % attempt})
            reply = connection.getresponse()
            reply.read()
            statuses.append(reply.status)
    finally:
        connection.close()
    assert set(statuses) == {401, 429}, statuses
    assert statuses.index(429) >= REQUEST_BURST + 1 and statuses.count(429) >= WRONG_KEYS // 2, statuses
    assert status(sandbox, '/v1/models') == 401


def test_a_completions_prompt_list_cannot_multiply_the_sequence_bound(sandbox, front):
    """64 prompts of n 8 would be 512 sequences from one request; vLLM bounds the prompts apart from n, and the role
    sets VLLM_MAX_COMPLETION_PROMPTS so that prompts times n stays within vllm_kimi_max_n_sequences."""
    prompts = sandbox.vars.get('vllm_kimi_max_completion_prompts', 1)
    with pytest.raises(openai.BadRequestError) as refused:
        client(front, sandbox.vars['vllm_kimi_api_key']).completions.create(
            model=sandbox.vars['vllm_kimi_served_model_name'], prompt=[QUESTION] * 64, n=8, max_tokens=1
        )
    assert refused.value.status_code == 400
    assert 'prompt list length 64 exceeds the maximum allowed count of %d' % prompts in str(refused.value)


BALANCER = '127.0.0.13'


def test_an_added_path_needs_the_key_and_metrics_never_believes_a_forwarded_address(sandbox, front):
    """vllm_kimi_front_paths with /invocations (which vLLM serves without its key) and a trusted balancer, taken up
    by the front door's reload alone: /invocations answers 401 without the key and answers with it; a client behind
    the balancer that names a metrics source in X-Forwarded-For is refused /metrics."""
    paths = sandbox.vars['vllm_kimi_front_paths'] + ['/invocations']
    settings = {'vllm_kimi_front_paths': paths, 'vllm_kimi_front_trusted_proxies': [BALANCER]}
    body = json.dumps({'messages': [{'role': 'user', 'content': QUESTION}], 'max_tokens': 64, 'temperature': 0})
    try:
        rc, output, report = sandbox.deploy('--tags', 'vllm_kimi_front', '-e', json.dumps(settings))
        assert rc == 0, output[-3000:]
        assert status(sandbox, '/invocations', 'POST', body=body) == 401
        connection = front_connection(sandbox)
        try:
            connection.request(
                'POST',
                '/invocations',
                body=body,
                headers={
                    'Content-Type': 'application/json',
                    'Authorization': 'Bearer ' + sandbox.vars['vllm_kimi_api_key'],
                },
            )
            reply = connection.getresponse()
            answered = reply.status, reply.read()
        finally:
            connection.close()
        assert answered[0] == 200 and b'Paris' in answered[1], answered
        connection = front_connection(sandbox, BALANCER)
        try:
            connection.request('GET', '/metrics', headers={'X-Forwarded-For': '127.0.0.1'})
            reply = connection.getresponse()
            reply.read()
            assert reply.status == 403
        finally:
            connection.close()
        assert status(sandbox, '/metrics') == 200
    finally:
        restore_rc, restore_output, restore_report = sandbox.deploy('--tags', 'vllm_kimi_front')
    assert restore_rc == 0, restore_output[-3000:]
    assert status(sandbox, '/invocations', 'POST', body=body) == 404


@pytest.mark.parametrize(
    'path, method', [('/health', 'POST'), ('/v1/models', 'DELETE'), ('/v1/chat/completions', 'GET')]
)
def test_each_path_takes_only_the_methods_vllm_serves_there(sandbox, path, method):
    assert status(sandbox, path, method) == 405


def test_a_body_that_stops_after_one_byte_is_let_go_at_the_body_timeout(sandbox, stalled_body):
    """Last in the file: the request stalled_body began as the first test started. The door gave up on the rest of
    its body after vllm_kimi_front_body_timeout (408, or the connection closed), not after the long read timeout
    that streams need, and not before (a close for another reason would come early)."""
    thread, outcome, timeout = stalled_body
    thread.join(timeout + STALLED_BODY_GRACE)
    assert outcome.get('status') in (408, 'closed'), outcome
    body_timeout = int(sandbox.vars['vllm_kimi_front_body_timeout'])
    assert body_timeout - STALLED_BODY_GRACE <= outcome['seconds'] <= timeout, outcome
