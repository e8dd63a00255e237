#!/usr/bin/python
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

DOCUMENTATION = r"""
---
module: load_probe
short_description: Measure a vLLM endpoint under a bounded load and fail when it got slow
version_added: 0.1.0
description:
  - Sends streamed chat completions from O(concurrency) clients at once, one request after another, for
    O(duration) seconds (a request that began in time may finish), and measures what vLLM's own serving
    benchmark reports. Output tokens per second over the probe's wall time, time to first token and the
    gaps between tokens (inter-token latency), each as p50, p95 and max.
  - It is the performance gate of a change. A change can answer correctly and still be slow (a kernel that
    falls back to a slow path after an upgrade, a setting that limits batching). The probe fails when the
    throughput is below O(min_tokens_per_second), or more than O(max_regression_percent) below
    O(baseline_tokens_per_second), the figure the previous release measured on the same host.
  - Any request that fails (an HTTP error, a cut stream, a stream without its end marker, an error event, a
    usage that counts more completion tokens than the request allows) fails the probe, with the distinct
    errors listed.
  - The API key and the password in O(url) never come back, in any text the module returns. They are masked
    as they are, escaped or encoded (JSON, Python, URL, HTML, or two of these layered), and so is every run
    of 8 of their characters (what a cut or a server leaves of them), before any text is shortened.
  - Reads only; it never changes the host, and it runs in check mode too.
author:
  - llmserve.vllm contributors (@llmserve)
extends_documentation_fragment:
  - llmserve.vllm.attributes
  - llmserve.vllm.attributes.READ_ONLY
  - llmserve.vllm.endpoint
options:
  url:
    description:
      - Base URL of the vLLM OpenAI-compatible server, without C(/v1). It is checked as
        M(llmserve.vllm.chat_check) checks it.
      - Its password never shows. Messages and RV(url) show everything between the first C(:) after C(://) and
        the last C(@) as C(********), and a user name without a password (a token) too.
      - A URL with more than one C(@), or one after a C(/), C(?) or C(#), is refused. Percent-encode these
        characters in a user name or password (C(%40), C(%2F), C(%3F), C(%23)).
    type: str
    default: http://127.0.0.1:8000
  model:
    description:
      - The served model name to ask.
    type: str
    required: true
  api_key:
    description:
      - The server's API key, sent as a C(Bearer) token; printable ASCII. It never shows in any text the
        module returns (see the description).
    type: str
  prompt:
    description:
      - The user message of every request.
    type: str
    default: Write a long story about a lighthouse keeper and the sea.
  max_tokens:
    description:
      - The C(max_tokens) of every request.
    type: int
    default: 128
  ignore_eos:
    description:
      - vLLM's C(ignore_eos) sampling parameter. With V(true) every request generates exactly O(max_tokens)
        tokens, so the throughput of two releases compares like with like whatever they answer.
    type: bool
    default: true
  extra_body:
    description:
      - Extra fields merged into every request body; they override the module's own fields.
    type: dict
    default: {}
  concurrency:
    description:
      - How many clients send requests at the same time; from 1 to 1024.
    type: int
    default: 4
  duration:
    description:
      - Seconds during which clients start new requests; from 1 to 86400.
    type: int
    default: 30
  request_timeout:
    description:
      - Seconds each read of a request's stream may wait; from 1 to 86400.
      - The whole probe ends at the latest O(duration) + O(request_timeout) + 5 seconds after it began; a
        client still inside a request then is abandoned and counted as a failed request.
    type: int
    default: 120
  min_tokens_per_second:
    description:
      - The least output throughput (tokens per second, all clients together) that passes; V(0) sets no floor.
    type: float
    default: 0
  baseline_tokens_per_second:
    description:
      - The throughput the previous release measured with the same probe on the same host. When set (and more
        than 0), the probe fails when its throughput is more than O(max_regression_percent) below it.
    type: float
  max_regression_percent:
    description:
      - How many percent below O(baseline_tokens_per_second) the throughput may be; from 0 to 100.
    type: float
    default: 20
notes:
  - Every request asks for C(stream_options.include_usage), so the output tokens are those vLLM counted.
    Requests run at temperature 0.
  - The probe loads the server on purpose. Run it before a replica takes traffic, or size O(concurrency) and
    O(duration) for a server that already serves.
  - One event line may have at most 1 MiB and one stream at most 64 MiB; more fails that request.
seealso:
  - module: llmserve.vllm.chat_check
  - name: vLLM's serving benchmark
    description: The figures this probe reports, as vLLM defines them.
    link: https://docs.vllm.ai/en/latest/contributing/benchmarks.html
"""

EXAMPLES = r"""
- name: Measure the endpoint with 8 clients for a minute, failing below 400 tokens/s
  llmserve.vllm.load_probe:
    url: http://127.0.0.1:8000
    model: kimi-k2.5
    api_key: "{{ vault_vllm_api_key }}"
    concurrency: 8
    duration: 60
    min_tokens_per_second: 400
  register: __vllm_load_probe

- name: Measure through the front door, its certificate signed by the deployment's own CA
  llmserve.vllm.load_probe:
    url: https://llm.example.com:8443
    model: kimi-k2.5
    api_key: "{{ vault_vllm_api_key }}"
    ca_path: /etc/ssl/certs/llmserve-ca.pem

- name: Fail when a change made the endpoint more than 20 % slower than the release before it
  llmserve.vllm.load_probe:
    model: kimi-k2.5
    baseline_tokens_per_second: "{{ previous_release.perf.output_tokens_per_second }}"
    max_regression_percent: 20
"""

RETURN = r"""
url:
  description: The base URL that was measured, a password in it (or a user name without one) as C(********).
  returned: always
  type: str
  sample: http://127.0.0.1:8000
requests:
  description: Requests that completed (their stream reached its end marker with tokens).
  returned: when the probe ran
  type: int
  sample: 96
failed_requests:
  description: Requests that failed, plus clients abandoned inside a request at the deadline.
  returned: when the probe ran
  type: int
  sample: 0
errors:
  description:
    - The distinct errors of the failed requests, at most 5.
    - Each is cut after 300 characters, the secrets masked before the cut.
  returned: when the probe ran
  type: list
  elements: str
  sample: ["answered 400: This model's maximum context length is 4096 tokens"]
output_tokens:
  description: Output tokens of the completed requests, as vLLM counted them.
  returned: when the probe ran
  type: int
  sample: 12288
seconds:
  description:
    - Wall time from the first completed request's start to the last one's end, ramp-up and drain included.
  returned: when the probe ran
  type: float
  sample: 31.9
output_tokens_per_second:
  description:
    - RV(output_tokens) divided by RV(seconds).
    - The figure C(vllm bench serve) prints as C(Output token throughput), the output tokens of its successful
      requests over its C(Benchmark duration), which runs from before its first request to the end of its last.
      C(make bench-load-probe) runs both alternately on the same endpoint, at the same concurrency, output length
      (C(--ignore-eos)) and input length, and prints their ratio.
  returned: when the probe ran
  type: float
  sample: 385.2
time_to_first_token:
  description:
    - Seconds from the start of a request (before its connection is opened) to the first streamed chunk that
      carries text, over the completed requests.
    - C(vllm bench serve) stops its clock at the first chunk with choices, the role chunk, which vLLM sends
      with the first token's chunk.
  returned: when the probe ran
  type: dict
  contains:
    p50:
      description: Median.
      type: float
    p95:
      description: 95th percentile (nearest rank).
      type: float
    max:
      description: Largest.
      type: float
  sample: {p50: 0.21, p95: 0.48, max: 0.52}
inter_token_latency:
  description: Seconds between consecutive streamed tokens of a request, over the completed requests.
  returned: when the probe ran
  type: dict
  contains:
    p50:
      description: Median.
      type: float
    p95:
      description: 95th percentile (nearest rank).
      type: float
    max:
      description: Largest.
      type: float
  sample: {p50: 0.009, p95: 0.014, max: 0.09}
time_per_output_token:
  description:
    - Per completed request, the seconds from its first token with text to its last token's chunk (with text
      or without, as C(vllm bench serve) counts it) divided by its output tokens less one.
    - Unlike RV(inter_token_latency) it does not depend on how the server groups events into writes (a server
      that sends several tokens' events at once shows gaps of 0 between them).
  returned: when the probe ran
  type: dict
  contains:
    p50:
      description: Median.
      type: float
    p95:
      description: 95th percentile (nearest rank).
      type: float
    max:
      description: Largest.
      type: float
  sample: {p50: 0.011, p95: 0.013, max: 0.02}
baseline_tokens_per_second:
  description: The baseline the throughput was compared with; null without one.
  returned: when the probe ran
  type: float
  sample: 402.7
regression_percent:
  description: How many percent the throughput is below the baseline (negative when above); null without one.
  returned: when the probe ran
  type: float
  sample: 4.3
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import MAX_WAIT_SECONDS, range_problem
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    DEFAULT_URL,
    api_key_problem,
    ca_path_problem,
    credentials_problem,
    endpoint_argument_spec,
    hide_url_password,
    mask,
    url_problem,
    without_credentials,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._load_probe import (
    DEFAULT_CONCURRENCY,
    DEFAULT_DURATION,
    DEFAULT_MAX_REGRESSION_PERCENT,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPT,
    DEFAULT_REQUEST_TIMEOUT,
    MAX_CONCURRENCY,
    LoadProbe,
    make_stream,
    probe_secrets,
    verdict,
)


def validate(p):
    """What argument_spec cannot express; returns the first problem or None."""
    problem = (
        credentials_problem(p['url'])
        or url_problem(p['url'])
        or api_key_problem(p['api_key'] or '')
        or ca_path_problem(p['ca_path'], p['validate_certs'])
    )
    if problem:
        return problem
    if not p['model'].strip():
        return 'model must name the served model, got an empty string'
    for name, low, high in (
        ('concurrency', 1, MAX_CONCURRENCY),
        ('duration', 1, MAX_WAIT_SECONDS),
        ('request_timeout', 1, MAX_WAIT_SECONDS),
        ('max_tokens', 1, None),
        ('min_tokens_per_second', 0, None),
        ('baseline_tokens_per_second', 0, None),
        ('max_regression_percent', 0, 100),
    ):
        problem = range_problem(name, p[name], low, high) if p[name] is not None else None
        if problem:
            return problem
    return None


def main():
    module = AnsibleModule(
        argument_spec=dict(
            url=dict(type='str', default=DEFAULT_URL),
            model=dict(type='str', required=True),
            api_key=dict(type='str', no_log=True),
            prompt=dict(type='str', default=DEFAULT_PROMPT),
            max_tokens=dict(type='int', default=DEFAULT_MAX_TOKENS, no_log=False),
            ignore_eos=dict(type='bool', default=True),
            extra_body=dict(type='dict', default={}),
            concurrency=dict(type='int', default=DEFAULT_CONCURRENCY),
            duration=dict(type='int', default=DEFAULT_DURATION),
            request_timeout=dict(type='int', default=DEFAULT_REQUEST_TIMEOUT),
            min_tokens_per_second=dict(type='float', default=0.0, no_log=False),
            baseline_tokens_per_second=dict(type='float', no_log=False),
            max_regression_percent=dict(type='float', default=DEFAULT_MAX_REGRESSION_PERCENT),
            **endpoint_argument_spec(),
        ),
        supports_check_mode=True,
    )
    p = module.params
    hide_url_password(module)
    problem = validate(p)
    if problem:
        module.fail_json(msg=problem)

    secrets = probe_secrets(p['url'], p['api_key'])
    extra_body = {'ignore_eos': p['ignore_eos']}
    extra_body.update(p['extra_body'])
    probe = LoadProbe(
        make_stream(
            p['url'],
            api_key=p['api_key'],
            validate_certs=p['validate_certs'],
            use_proxy=p['use_proxy'],
            ca_path=p['ca_path'],
            unix_socket=p['unix_socket'],
        ),
        model=p['model'],
        prompt=p['prompt'],
        max_tokens=p['max_tokens'],
        concurrency=p['concurrency'],
        duration=p['duration'],
        request_timeout=p['request_timeout'],
        extra_body=extra_body,
        secrets=secrets,
    )
    figures = probe.run()
    baseline = p['baseline_tokens_per_second'] or None
    failure, regression = verdict(figures, p['min_tokens_per_second'], baseline, p['max_regression_percent'])
    url = without_credentials(p['url'])
    figures.update(url=url, baseline_tokens_per_second=baseline, regression_percent=regression)
    if failure:
        # Masked again whole: joined, the ends of two errors could spell what neither does alone.
        msg = mask('The load probe of %s failed: %s' % (url, failure), *secrets)
        module.fail_json(msg=msg, changed=False, **figures)
    module.exit_json(changed=False, **figures)


if __name__ == '__main__':
    main()
