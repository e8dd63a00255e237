#!/usr/bin/python
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

DOCUMENTATION = r"""
---
module: haproxy_server
short_description: Take one server of an HAProxy backend out of rotation and put it back
version_added: 0.2.0
description:
  - Sets the admin state of one server of an HAProxy backend through HAProxy's runtime API (its admin stats socket,
    C(set server <backend>/<server> state <state>)), then waits for what that state promises.
  - It is the load balancer's half of a rolling upgrade of vLLM replicas. O(state=drain) takes a replica out of load
    balancing while the streams in flight run to their end, and waits until it has no session left; after the
    replica was changed, O(state=ready) puts it back and waits until HAProxy's health check sees it C(UP).
  - The state is read from the runtime API, the admin state from C(show servers state <backend>) (the bits that
    C(set server) forces, maintenance before drain), the status, the sessions and the last check from
    C(show stat <backend> 4 -1).
  - Run it on the load balancer's host (C(delegate_to)), as a user who may use the socket, normally root.
author:
  - llmserve.vllm contributors (@llmserve)
extends_documentation_fragment:
  - llmserve.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - Reads the server's state and reports whether it would change; sends no C(set) command and does not wait.
  diff_mode:
    support: full
    details:
      - The server's admin state before and after.
  idempotent:
    support: full
    details:
      - A server already in O(state) is left alone (C(changed=false)); the wait still happens.
options:
  socket:
    description:
      - The runtime API socket of HAProxy, a Unix socket of a C(stats socket) line at C(level admin).
      - A path that is missing, that is no socket, or whose socket refuses the connection fails the module with a
        message that names the path and the cause.
      - A path with a control character (a NUL, a line break, an escape) is refused by the argument check, before
        Ansible logs the module's arguments.
    type: path
    default: /run/haproxy/admin.sock
  backend:
    description:
      - The backend the server belongs to.
      - A backend HAProxy does not have fails the module with a message that lists the backends it has.
      - An HAProxy name, letters, digits and C(._:-); any other character is refused by the argument check, before
        Ansible logs the module's arguments.
    type: str
    required: true
  server:
    description:
      - The server within O(backend).
      - A server the backend does not have fails the module with a message that lists the servers it has.
      - An HAProxy name, letters, digits and C(._:-); any other character is refused by the argument check, before
        Ansible logs the module's arguments.
    type: str
    required: true
  state:
    description:
      - The admin state to set.
      - V(drain) takes the server out of load balancing, new requests go to the other servers, while the sessions it
        has run to their end and its health check goes on.
      - V(maint) also stops its health check; the sessions it has still run to their end, unless the server's
        C(on-marked-down shutdown-sessions) ends them.
      - V(ready) puts it back into load balancing, from V(drain) or V(maint).
      - A state inherited from a tracked server (C(MAINT (via ...))) or from a failed DNS resolution is not this
        module's to set; it shows in the status (RV(previous.status)).
    type: str
    required: true
    choices: [ready, drain, maint]
  wait:
    description:
      - Wait until the server is where O(state) leads.
      - For V(drain) and V(maint), until it has no session left (C(scur) of C(show stat)) and no request queued for
        it (C(qcur)).
      - For V(ready), until its status is C(UP), its health check passed at full health, or C(no check) for a server
        without a check. A server that has just left maintenance is C(UP 1/3) until its first check, which is not yet
        C(UP).
    type: bool
    default: true
  timeout:
    description:
      - Seconds the module may take, its reads, its C(set) and its wait together. Once they passed, the module fails
        with what it waited for and the last figures it saw, the sessions still open or the status and the last
        check; or, where the runtime API had not answered by then, with the command it sent.
      - Each command to the runtime API may take at most 10 seconds from the connect to the reply's end, less where
        less of O(timeout) is left.
      - More than 0, at most 86400.
    type: float
    default: 600
  sleep:
    description:
      - Seconds between two reads of the server's state while waiting.
      - More than 0, at most 60.
    type: float
    default: 1
notes:
  - A reply of the runtime API that is an error (C(No such server.), C(Permission denied), an unknown command) fails
    the module, quoting the reply and the command that got it.
  - Only what HAProxy said counts. A C(show stat) row without its C(scur), C(qcur) or C(status), with them empty or
    cut short, and a C(show servers state) row without its C(srv_admin_state), fail the module quoting the row;
    sessions that were not read are unknown, never 0. A reply line over 64 KiB, or one that is no CSV, fails it too.
  - After a C(set server) the module reads the server again, and fails, naming the admin state it read, where the
    state did not follow (C(changed=false)).
  - Only the admin state that C(set server) forces is compared with O(state); a server that is in maintenance only
    because the server it tracks is, or that the configuration disabled and the runtime API made ready since, reads
    as V(ready).
seealso:
  - name: HAProxy management guide, the runtime API
    description: The commands C(show stat), C(show servers state) and C(set server) that this module sends.
    link: https://docs.haproxy.org/2.6/management.html#9.3
  - module: llmserve.vllm.chat_check
"""

EXAMPLES = r"""
- name: Ensure the replica takes no new request, and its streams in flight have ended
  llmserve.vllm.haproxy_server:
    backend: vllm
    server: "{{ inventory_hostname_short }}"
    state: drain
    timeout: 900
  delegate_to: "{{ groups['balancers'][0] }}"
  become: true

- name: Upgrade the replica
  ansible.builtin.include_role:
    name: llmserve.vllm.vllm_kimi

- name: Ensure the replica is back in rotation and HAProxy's health check sees it UP
  llmserve.vllm.haproxy_server:
    backend: vllm
    server: "{{ inventory_hostname_short }}"
    state: ready
    timeout: 120
  delegate_to: "{{ groups['balancers'][0] }}"
  become: true
"""

RETURN = r"""
msg:
  description: What was set (or would be, in check mode) and what the wait saw.
  returned: always
  type: str
  sample: vllm/a set from ready to drain; no session left after 2.8 s
previous:
  description: The server as the module found it, before any change.
  returned: when the server was read
  type: dict
  contains:
    admin_state:
      description: The admin state that C(set server) forces, V(ready), V(drain) or V(maint).
      type: str
      sample: ready
    status:
      description:
        - The status C(show stat) gives, for example V(UP), V(UP 1/3) (up, failing checks), V(DOWN), V(DOWN 1/2)
          (down, passing checks), V(DRAIN), V(MAINT), V(MAINT (via backend/server)), V(NOLB) or V(no check).
      type: str
      sample: UP
    sessions:
      description: The server's current sessions (C(scur)).
      type: int
      sample: 1
    queued:
      description: The requests queued for the server (C(qcur)).
      type: int
      sample: 0
    check_status:
      description: The status of the last health check (V(L7OK), V(L7STS), V(L4CON), V(INI), ...); null without one.
      type: str
      sample: L7OK
    check_running:
      description:
        - Whether a health check is under way. HAProxy still shows the last finished check's status and code then;
          a wait carries that check's RV(previous.check_detail) over from its earlier read.
      type: bool
      sample: false
    check_code:
      description: The HTTP status of the last layer-7 check; null where there is none.
      type: int
      sample: 200
    check_description:
      description: HAProxy's words for RV(previous.check_status); null without a check.
      type: str
      sample: Layer7 check passed
    check_detail:
      description: What the last check saw beyond its status (C(last_chk)); null where HAProxy gives nothing.
      type: str
      sample: Connection refused
  sample:
    admin_state: ready
    status: UP
    sessions: 1
    queued: 0
    check_status: L7OK
    check_running: false
    check_code: 200
    check_description: Layer7 check passed
    check_detail: null
server:
  description:
    - The server when the module ended, the same keys as RV(previous); on a wait that ran out, its last read.
    - In check mode, and with O(wait=false) when nothing changed, the server as the module found it.
  returned: when the server was read
  type: dict
  sample:
    admin_state: drain
    status: DRAIN
    sessions: 0
    queued: 0
    check_status: L7OK
    check_running: false
    check_code: 200
    check_description: Layer7 check passed
    check_detail: null
elapsed:
  description:
    - Seconds the wait took, up to the read that saw the server where O(state) leads (0 where the first read did);
      on a wait that ran out, until it ran out. 0 where there was no wait.
  returned: when the server was read
  type: float
  sample: 2.804
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import MAX_WAIT_SECONDS, range_problem
from ansible_collections.llmserve.vllm.plugins.module_utils.balancer._haproxy import (
    DEFAULT_SLEEP,
    DEFAULT_SOCKET,
    DEFAULT_TIMEOUT,
    MAX_SLEEP,
    STATES,
    HAProxyFailed,
    RuntimeApi,
    ServerControl,
    apply,
    haproxy_name,
    runtime_api_path,
    state_diff,
)

ARGUMENT_SPEC = dict(
    socket=dict(type=runtime_api_path, default=DEFAULT_SOCKET),
    backend=dict(type=haproxy_name, required=True),
    server=dict(type=haproxy_name, required=True),
    state=dict(type='str', required=True, choices=list(STATES)),
    wait=dict(type='bool', default=True),
    timeout=dict(type='float', default=DEFAULT_TIMEOUT),
    sleep=dict(type='float', default=DEFAULT_SLEEP),
)


def validate(params):
    """What argument_spec cannot express; the first problem or None."""
    return range_problem('timeout', params['timeout'], 0, MAX_WAIT_SECONDS, ' seconds', above=True) or range_problem(
        'sleep', params['sleep'], 0, MAX_SLEEP, ' seconds', above=True
    )


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    problem = validate(p)
    if problem:
        module.fail_json(msg=problem)
    control = ServerControl(RuntimeApi(p['socket']), p['backend'], p['server'])
    try:
        result = apply(control, p['state'], p['wait'], p['timeout'], p['sleep'], module.check_mode)
    except HAProxyFailed as exc:
        module.fail_json(msg=exc.msg, **dict({'changed': False}, **exc.details))
    if module._diff:
        result['diff'] = state_diff(control.name, result['previous']['admin_state'], p['state'])
    module.exit_json(**result)


if __name__ == '__main__':
    main()
