#!/usr/bin/python
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

DOCUMENTATION = r"""
---
module: chat_check
short_description: Wait for a vLLM endpoint and judge one chat completion
version_added: 0.1.0
description:
  - Polls C(/health) until it answers 200, then C(/v1/models) until it lists a model, then POSTs one
    C(/v1/chat/completions) request at temperature 0 and succeeds only when the answer matches O(expect).
  - It is the coherence gate of a deployment. A server that loads but answers nonsense (a wrong
    checkpoint edit, a broken quantization, a bad chat template) fails here.
  - The answer is judged on the message content alone, as a client reads it. It passes only when the content
    matches O(expect), the generation finished (C(finish_reason) V(stop)) and no reasoning or tool-call
    markup (O(forbidden_markup)) is left in the content. So a reasoning model whose answer never leaves its
    thinking (content empty, C(finish_reason) V(length)) fails, and so does one served without its reasoning
    parser, whose thinking spills into the content. O(judge_reasoning) opts into judging the reasoning text
    when the content is empty.
  - With O(expect_reasoning), a server with a reasoning parser (vLLM C(--reasoning-parser)) must show
    reasoning (thinking on) or none (thinking off, for Kimi-K2.5 through O(extra_body)).
  - With O(tool_call), a second request offers one tool, and the check passes only when the model calls
    it, by name, with JSON arguments that match, and C(finish_reason) is V(tool_calls). It is the tool gate of
    a server with a tool-call parser (vLLM C(--tool-call-parser) and C(--enable-auto-tool-choice)). It is
    asked once the coherence answer passed.
  - With O(unit), every poll also reads the systemd unit's state, so a service that crashes or
    restart-loops fails the wait at once instead of at O(timeout). The failure message then quotes the
    journal lines that explain it (for example vLLM's V(estimated maximum model length is ...) or the last
    line of a Python traceback), and the loading progress found in the journal is returned.
  - With O(unit), a start that makes no progress (no new line in the unit's journal, no 200 from C(/health) or
    C(/v1/models)) for O(stall_timeout) seconds fails the wait early, quoting the unit's last journal lines; an
    engine hung at its first all-reduce leaves the unit active and silent.
  - The unit rule. The wait fails at once when the unit is not loaded, when its C(ActiveState) is
    V(failed) (it crashed, or systemd's start limit was hit) or V(inactive) (it was stopped or never
    started), or when its C(NRestarts) grew by more than O(max_restarts) since the wait began (systemd
    keeps restarting a crashing service). V(activating), V(deactivating) and V(active) keep the wait
    going, and so do up to O(max_restarts) automatic restarts, so a service that crashed (or was
    killed on purpose) once and came back still passes.
  - Reads only; it never changes the host.
author:
  - llmserve.vllm contributors (@llmserve)
extends_documentation_fragment:
  - llmserve.vllm.attributes
  - llmserve.vllm.attributes.READ_ONLY
  - llmserve.vllm.endpoint
options:
  url:
    description:
      - Base URL of the vLLM OpenAI-compatible server, without C(/v1).
      - It is checked before the first poll, so that a typo fails at once instead of at O(timeout). The module
        refuses a scheme other than C(http) or C(https), a space or a control character, a query or a fragment,
        a path that ends with C(/v1), a missing host name, a host name with an empty label (C(vllm..local)) or
        a label longer than 63 characters, and a port that is not a number from 1 to 65535.
      - A password in the URL (C(https://user:password@host)) is masked in all the module returns.
    type: str
    default: http://127.0.0.1:8000
  model:
    description:
      - The served model name to ask.
      - When not set, the first model that C(/v1/models) lists. When set and not listed, the module
        fails at once.
    type: str
  max_model_len:
    version_added: 0.2.0
    description:
      - The context the server must serve, as planned. Once C(/v1/models) lists the model, the C(max_model_len) it
        reports for it must be this, else the module fails at once naming both (a server started with other
        settings than the plan, or another server on the address).
      - A server that reports no C(max_model_len) fails too. vLLM reports it for every model it serves.
      - When not set, the reported context is returned (RV(max_model_len)) and not judged.
    type: int
  prompt:
    description:
      - The user message of the check request.
    type: str
    default: What is the capital of France?
  expect:
    description:
      - A Python regular expression that must match somewhere in the answer (C(re.search)).
      - The answer is the message content. An empty content fails (C(the answer never left the reasoning)
        when there is reasoning text), unless O(judge_reasoning) is set.
      - Only the last 32,768 characters of the answer are judged, where a long answer reaches its
        conclusion. Python's C(re) has no timeout; on that length a quadratic expression such as
        V(.*paris) takes well under a second, and a match that takes more than 5 seconds (nested
        repetition such as V((a+\)+$) backtracks without end) fails the check.
      - An expression that matches an empty answer (V(''), V(x*), V(paris|)) is refused, since it would accept
        any answer.
    type: str
    default: (?i)paris
  max_tokens:
    description:
      - The C(max_tokens) of the check request, and of the O(tool_call) request. Reasoning models need more
        than the default to reach their answer, or a O(extra_body) that turns thinking off.
    type: int
    default: 32
  extra_body:
    description:
      - Extra fields merged into the body of every request the check sends (the coherence request and the
        O(tool_call) request), for example C(chat_template_kwargs) with C(thinking) set to V(false) for
        Kimi-K2.5, or sampling fields such as C(top_k) or C(temperature).
      - Fields that the check sets or relies on are refused, with a message that names them, before any
        request; V(model), V(messages), V(stream), V(stream_options), V(n), V(max_tokens),
        V(max_completion_tokens), V(tools), V(tool_choice), V(functions), V(function_call),
        V(include_reasoning) (V(false) would hide the reasoning that O(expect_reasoning) judges) and V(echo)
        (it puts the prompt into the content). Use O(model), O(prompt), O(max_tokens) and O(tool_call) instead.
    type: dict
    default: {}
  judge_reasoning:
    description:
      - When the content is empty and there is reasoning text, judge the reasoning text with O(expect)
        instead, and accept C(finish_reason) V(length) as well as V(stop).
      - For a probe whose O(max_tokens) is meant to cut the thinking short. It cannot tell a healthy
        reasoning model from one whose answer never leaves the reasoning, so a deployment gate leaves it off.
    type: bool
    default: false
  expect_reasoning:
    description:
      - Whether the answer must come with reasoning (C(reasoning), or C(reasoning_content) of older vLLM),
        for a server with a reasoning parser.
      - V(true) (a thinking-on probe) fails when the reasoning is empty; the answer must still be in the
        content. V(false) (a thinking-off probe, for example C(chat_template_kwargs) C(thinking) V(false) in
        O(extra_body)) fails when there is any. Not set, the reasoning is not judged.
    type: bool
  forbidden_markup:
    description:
      - Text that must not appear in the content of the coherence answer or of the O(tool_call) answer, which
        a reasoning or a tool-call parser takes out. Found, the server runs without the parser, or a
        chat template or tokenizer change broke the split; the message names what was found.
      - The default is Kimi-K2.5's thinking tags and tool-call tokens. V([]) checks nothing. An empty string
        is refused.
    type: list
    elements: str
    default:
      - <think>
      - </think>
      - <|tool_calls_section_begin|>
      - <|tool_calls_section_end|>
      - <|tool_call_begin|>
      - <|tool_call_argument_begin|>
      - <|tool_call_end|>
  tool_call:
    description:
      - The tool gate. When set, after the coherence answer passed, the check POSTs O(tool_call.prompt)
        with O(tool_call.tool) as the only entry of C(tools) (C(tool_choice) left to vLLM's default, V(auto)),
        O(max_tokens), temperature 0 and O(extra_body).
      - It passes only when the answer has C(tool_calls) with a call of O(tool_call.name) whose C(arguments)
        are a JSON object that matches O(tool_call.arguments), no O(forbidden_markup) in its content, and
        C(finish_reason) V(tool_calls). The message quotes what came back instead, the content or the raw
        arguments.
      - A server without C(--enable-auto-tool-choice) answers 400, and the check fails with vLLM's message.
    type: dict
    suboptions:
      tool:
        description:
          - An OpenAI C(tools) entry, a dict with C(type) V(function) and C(function), which holds the C(name),
            C(description) and C(parameters) (a JSON schema) of the function.
        type: dict
        required: true
      prompt:
        description:
          - The user message that the tool answers.
        type: str
        required: true
      name:
        description:
          - The name of the function the model must call. Default, the name in O(tool_call.tool); another
            name is refused.
        type: str
      arguments:
        description:
          - The arguments the call must carry, as a JSON object. Values compare as JSON does (V(true) is not
            V(1)); objects and arrays compare whole.
          - With O(tool_call.arguments_match=pattern), each value is a Python regular expression instead.
        type: dict
        default: {}
      arguments_match:
        description:
          - V(subset) passes when every key of O(tool_call.arguments) is in the call's arguments with an equal
            value, other keys allowed (a model may add optional arguments). V(exact) also allows no other key.
          - V(pattern) passes when every key of O(tool_call.arguments) is in the call's arguments with a string,
            number or boolean whose JSON text its regular expression finds, ignoring case, other keys allowed. A
            healthy model may answer V(Paris, France) or V(paris) where the gate asks for Paris. A value that is
            not a regular expression is refused before the first request.
        type: str
        choices: [subset, exact, pattern]
        default: subset
  long_prompt:
    version_added: 0.2.0
    description:
      - Make the check's request long, to judge what only a long prompt runs, prefill in several chunks (past
        vLLM's C(--max-num-batched-tokens)), the KV cache of many blocks, positions far from the start.
      - The user message is O(long_prompt.fact) and a space, then O(long_prompt.filler) O(long_prompt.repeats)
        times, then O(prompt), the question whose answer must repeat the fact; O(expect) judges it. A server that
        loses the start of a long prompt answers without the fact.
      - With O(long_prompt.target_tokens) instead of O(long_prompt.repeats), the filler is repeated as often as fits
        that many prompt tokens, counted by the server's own C(/tokenize) (its chat template included, with the
        C(chat_template_kwargs) of O(extra_body)), so a needle question can be asked at a share of the served
        context whatever the tokenizer. C(/tokenize) also says the C(max_model_len) served, and a target that leaves no
        room for O(max_tokens) in it fails the check before the long request.
      - With O(long_prompt.greedy_prompt), the greedy-equivalence probe follows a passing answer, that short prompt
        alone then after the long prompt's fact and filler, each at temperature 0 and cut at
        O(long_prompt.greedy_tokens) tokens; the two must begin with the same tokens, or the check fails quoting both.
        A decode that misreads a long context (vllm#41623 reports Kimi drifting under decode context parallelism)
        answers the same question otherwise once the context is long.
      - Without O(long_prompt.fact), the answer to O(prompt) after the filler is judged, the prompt's end at far
        positions, not what its start holds.
      - Not with O(tool_call).
    type: dict
    suboptions:
      fact:
        description:
          - The sentence that opens the prompt, which the answer must repeat.
        type: str
      filler:
        description:
          - The text repeated between the fact and the question; it must not give the fact away.
        type: str
        required: true
      repeats:
        description:
          - How many times O(long_prompt.filler) is repeated; from 0 to 1,000,000.
          - Exactly one of O(long_prompt.repeats) and O(long_prompt.target_tokens) is required.
        type: int
      target_tokens:
        description:
          - The prompt tokens to fill to, at least 1; the filler is repeated as often as keeps the prompt at or below
            it, within one filler (a few requests to C(/tokenize), which counts without running the model).
          - The sum of it and O(max_tokens) must fit the C(max_model_len) the server reports; a prompt without
            filler over it, or a filler that adds no tokens, fails the check, naming the counts.
        type: int
      greedy_prompt:
        description:
          - The greedy-equivalence probe's short prompt, whose answer the long prefix must not change (the coherence
            question, not the fact's, since a question the fact answers begins otherwise without it). Not set, no probe.
        type: str
      greedy_tokens:
        description:
          - How many first tokens of the greedy-equivalence probe's two answers must be the same (their C(max_tokens)),
            at least 1.
        type: int
        default: 8
      min_tokens:
        description:
          - The fewest prompt tokens the server must count (its C(usage.prompt_tokens)) for the check to pass, so
            that the probe is as long as it is meant to be whatever the tokenizer; V(0) counts none.
          - Set it above the server's C(--max-num-batched-tokens) to prove that the prompt took several prefill
            chunks.
        type: int
        default: 0
  stream:
    description:
      - Ask for the answers as a stream (C(stream), with C(stream_options) C(include_usage)), as agents and chat
        front ends ask, and judge what the deltas add up to, joined as the OpenAI clients join them (the content
        and reasoning in order, each tool call by its index). vLLM's reasoning and tool parsers take a path of their
        own for a stream, which a non-streamed check never runs.
      - The same judgement follows as without it, the tool gate's included; a stream that breaks off before
        its C([DONE]) event, or that carries an error event, fails the check with what came.
    type: bool
    default: false
  api_key:
    description:
      - The server's API key (vLLM C(--api-key)), sent as a C(Bearer) token in the C(Authorization) header.
      - vLLM only guards C(/v1) paths, so C(/health) answers without it.
      - It must be printable ASCII, as a Bearer token is. A key with a control character (the final newline
        of a YAML C(|) block scalar) or a character outside ASCII is refused, with a message that names the
        position, never the key.
      - The key is masked, as it is and as JSON or Python escape it, in all text the module returns (an error
        body that echoes it, journal lines that quote it).
    type: str
  timeout:
    description:
      - Seconds the whole wait may take, from the first poll to the answer; at most 86400 (a day).
      - The default, 45 minutes, leaves room for loading a checkpoint of about 540 GB.
      - It holds whatever the server does (a body trickled a byte at a time, an endless event stream,
        an answer that never comes). It can be overrun by at most 1 second (the last request is given at
        least that), plus 5 seconds to judge the answer, plus 5 seconds per C(journalctl) call when O(unit)
        is set and its journal is read to explain a failure.
      - A time-out's message quotes what the server last showed; a request that the deadline cut short
        shows nothing of the server and does not replace it.
    type: int
    default: 2700
  interval:
    description:
      - Seconds between polls; more than 0 and at most 2, so a crash is noticed within 2 seconds.
    type: float
    default: 2.0
  request_timeout:
    description:
      - Seconds each C(/health) and C(/v1/models) request may take, from connecting to the last byte of
        the body; at most 86400.
      - The chat request may use all the time left before O(timeout), because the first request after
        a load can be slow.
    type: int
    default: 30
  unit:
    description:
      - The systemd unit that runs the server. When set, each poll reads its state with
        C(systemctl show) and failures quote C(journalctl --unit) lines.
      - C(systemctl show) may take what is left of O(timeout), at most 10 seconds; one that takes longer
        (a wedged systemd) fails the check. A C(journalctl) that runs longer than 5 seconds or prints more
        than 4 MiB is killed and not asked again; the messages then lack the journal lines.
    type: str
  max_restarts:
    description:
      - How many automatic restarts of O(unit) (growth of its C(NRestarts)) the wait tolerates.
        One more and the unit counts as restart-looping.
    type: int
    default: 1
  journal_lines:
    description:
      - How many explaining journal lines of O(unit) a failure message quotes at most.
    type: int
    default: 20
  stall_timeout:
    description:
      - With O(unit), seconds a start may go without progress before the wait fails, instead of waiting out
        O(timeout). Progress is a new line in the journal of the unit's current run (read every 10 seconds, by
        the run's C(InvocationID), so the previous run's last lines never count) or a 200 from C(/health) or
        C(/v1/models). The failure message quotes the run's last 5 journal lines.
      - vLLM logs each checkpoint shard it loads and each phase of its start, so a healthy load of hundreds of
        gigabytes keeps writing lines; the value must exceed its longest silent phase (compilation or kernel
        autotuning on a first start).
      - The check waits for the journal's first line before it counts, so a journal that C(journalctl) may not
        read (no root, not in C(systemd-journal)) turns it off rather than failing a healthy load.
      - V(0) turns it off. Once a coherent answer came, it does not apply (the tool request is not watched).
    type: int
    default: 900
notes:
  - A server certificate that does not chain to O(ca_path) fails each poll as a server that does not answer, so
    the wait fails at O(timeout), with Python's certificate error (C(CERTIFICATE_VERIFY_FAILED) ...) as the last
    state seen.
  - The check request runs at temperature 0, so a healthy model answers the same way every time, unless
    O(extra_body) sets another C(temperature).
  - The module reads at most 64 KiB of a C(/health) answer, 1 MiB of a C(/v1/models) answer and 4 MiB of a
    chat completion. A larger C(/health) or C(/v1/models) answer counts as no answer (the wait goes on); a
    larger chat completion fails the check at once. Text that is not UTF-8 is read with replacement
    characters.
  - The unit's journal is read with C(journalctl), which needs root or membership in C(systemd-journal)
    or C(adm); without it the messages only lack the journal lines.
seealso:
  - module: ansible.builtin.uri
  - module: ansible.builtin.wait_for
"""

EXAMPLES = r"""
- name: Ensure vLLM answers the capital of France
  llmserve.vllm.chat_check:
    url: http://127.0.0.1:8000
    unit: vllm.service
  register: __vllm_chat_check

- name: Ensure Kimi-K2.5 answers with thinking off and shows no reasoning, through its API key
  llmserve.vllm.chat_check:
    url: https://llm.example.com
    model: kimi-k2.5
    api_key: "{{ vault_vllm_api_key }}"
    prompt: What is 2 + 2? Answer with the number only.
    expect: '\b4\b'
    max_tokens: 64
    extra_body:
      chat_template_kwargs:
        thinking: false
    expect_reasoning: false
    timeout: 3600

- name: Ensure the front door answers, its certificate signed by the deployment's own CA
  llmserve.vllm.chat_check:
    url: https://llm.example.com:8443
    api_key: "{{ vault_vllm_api_key }}"
    ca_path: /etc/ssl/certs/llmserve-ca.pem
    unit: vllm.service

- name: Ensure Kimi-K2.5 thinks, then answers in the content
  llmserve.vllm.chat_check:
    url: http://127.0.0.1:8000
    model: kimi-k2.5
    max_tokens: 1024
    expect_reasoning: true
    unit: vllm.service

- name: Ensure Kimi-K2.5 calls a tool it is offered
  llmserve.vllm.chat_check:
    url: http://127.0.0.1:8000
    model: kimi-k2.5
    max_tokens: 1024
    tool_call:
      tool:
        type: function
        function:
          name: get_weather
          description: Get the current weather in a city.
          parameters:
            type: object
            properties:
              city:
                type: string
            required: [city]
      prompt: What is the weather in Paris?
      arguments:
        city: Paris
"""

RETURN = r"""
url:
  description: The base URL that was checked.
  returned: always
  type: str
  sample: http://127.0.0.1:8000
elapsed:
  description: Seconds from the start of the wait to the verdict.
  returned: always
  type: float
  sample: 1312.504
healthy_after:
  description:
    - Seconds from the start of the wait until C(/health) last answered 200; null if it never did.
    - It counts from the wait, not from the unit's start (RV(startup.api_ready_seconds) does).
  returned: always
  type: float
  sample: 1298.12
model:
  description: The served model name that was asked.
  returned: success, or when the answer did not match
  type: str
  sample: nvidia/Kimi-K2.5-NVFP4
max_model_len:
  description: The C(max_model_len) that C(/v1/models) reported for the model; null where it reported none.
  returned: success, or when the answer did not match
  type: int
  sample: 131072
  version_added: 0.2.0
answer:
  description:
    - The answer that was judged, the content (the reasoning text when O(judge_reasoning) judged it).
    - At most its last 32,768 characters, as RV(content) and RV(reasoning) are.
  returned: success, or when the answer did not match
  type: str
  sample: The capital of France is Paris.
content:
  description: The message content as the server sent it; null when it sent none.
  returned: success, or when the answer did not match
  type: str
  sample: The capital of France is Paris.
reasoning:
  description: The reasoning text of a reasoning model (C(reasoning) or C(reasoning_content)); null otherwise.
  returned: success, or when the answer did not match
  type: str
  sample: null
finish_reason:
  description: Why generation stopped (V(stop), V(length), ...).
  returned: success, or when the answer did not match
  type: str
  sample: stop
completion_tokens:
  description: Completion tokens of the check request, from its C(usage); null when the server reported none.
  returned: success, or when the answer did not match
  type: int
  sample: 8
prompt_tokens:
  description: Prompt tokens of the check request, from its C(usage); null when the server reported none.
  returned: success, or when the answer did not match
  type: int
  sample: 14
tokens_per_second:
  description: Completion tokens divided by the wall time of the check request.
  returned: success, or when the answer did not match
  type: float
  sample: 41.7
request_seconds:
  description: Wall time of the check request in seconds.
  returned: success, or when the answer did not match
  type: float
  sample: 0.192
stream_events:
  description:
    - How many events the streamed answer came in before its end event (C([DONE])); null when O(stream) is off.
    - More than one shows the answer was joined from its deltas, as a streaming client joins them.
  returned: success, or when the answer did not match
  type: int
  sample: 12
tool_call:
  description:
    - The answer to the O(tool_call) request.
  returned: when O(tool_call) is set and its request was answered
  type: dict
  contains:
    name:
      description: The function name that was expected.
      type: str
      sample: get_weather
    arguments:
      description: The parsed arguments of the call that matched; null when none did.
      type: dict
      sample:
        city: Paris
    tool_calls:
      description:
        - The calls as the server sent them, with their raw C(arguments) text (at most its last 32,768
          characters); empty when it sent none.
      type: list
      elements: dict
      sample:
        - id: functions.get_weather:0
          name: get_weather
          arguments: '{"city": "Paris"}'
    content:
      description: The message content; null when the server sent none (as vLLM does beside a call).
      type: str
      sample: null
    reasoning:
      description: The reasoning text (C(reasoning) or C(reasoning_content)); null otherwise.
      type: str
      sample: The user wants the weather in Paris; I will call get_weather.
    finish_reason:
      description: Why generation stopped; V(tool_calls) when the model called a tool.
      type: str
      sample: tool_calls
    completion_tokens:
      description: Completion tokens of the request, from its C(usage); null when the server reported none.
      type: int
      sample: 21
    request_seconds:
      description: Wall time of the request in seconds.
      type: float
      sample: 0.412
    stream_events:
      description: How many events the streamed call came in; null when O(stream) is off.
      type: int
      sample: 9
long_prompt:
  description: How the O(long_prompt) request was made.
  returned: when O(long_prompt) is set and its answer was judged
  type: dict
  contains:
    repeats:
      description: How many times the filler was repeated, as given or as sized to O(long_prompt.target_tokens).
      type: int
      sample: 135
    target_tokens:
      description: O(long_prompt.target_tokens); null when O(long_prompt.repeats) was given.
      type: int
      sample: 921
    tokenized:
      description: The prompt's tokens as C(/tokenize) counted them when it was sized; null when it was not.
      type: int
      sample: 918
greedy:
  description: The greedy-equivalence probe's two answers (O(long_prompt.greedy_prompt)).
  returned: when O(long_prompt.greedy_prompt) is set and both its requests were answered
  type: dict
  contains:
    prompt:
      description: The short prompt asked.
      type: str
      sample: What is the capital of France?
    tokens:
      description: The first tokens compared (O(long_prompt.greedy_tokens), the requests' C(max_tokens)).
      type: int
      sample: 8
    alone:
      description: The answer to the short prompt alone, its C(content) and C(reasoning) (null where none came).
      type: dict
      sample:
        content: The capital of France is Paris.
        reasoning: null
    after:
      description: The answer to the short prompt after the long prompt's fact and filler, as RV(greedy.alone).
      type: dict
      sample:
        content: The capital of France is Paris.
        reasoning: null
    prompt_tokens:
      description: The prompt tokens of the long request, from its C(usage); null when the server reported none.
      type: int
      sample: 918
startup:
  description:
    - vLLM's own figures of the unit's current run, read from the same journal lines (M(llmserve.vllm.gpu_preflight)
      plans from them once the role recorded them). Each only where the log gives it; empty without O(unit).
    - Only vLLM's own logger lines (by their shape, its request logger's excepted) of the run's start count, from the
      last run's first line to uvicorn's C(Application startup complete.), so that a client's words logged later (a
      prompt, a query in an access line) never change them. A figure is read where vLLM's message of it begins so,
      and only within what a start logs (a value beyond it, or a weights rate beyond 10,000 GiB/s, is left out).
    - Where tensor-parallel ranks log their own, the bounding one - the largest weights and CUDA-graph memory, the
      smallest KV memory, tokens and concurrency, the slowest rank's seconds of each phase.
    - The C(*_seconds) figures are the start's ledger, where its time went; the role keeps them in the deployment
      record and exports them as C(llmserve_start_phase_seconds).
  returned: always
  type: dict
  contains:
    weights_gib:
      description: GiB of weights on the most loaded GPU (C(Model loading took ... GiB)).
      type: float
      returned: when logged
    available_kv_gib:
      description: GiB for the KV cache (C(Available KV cache memory)).
      type: float
      returned: when logged
    kv_tokens:
      description: Tokens the KV cache holds (C(GPU KV cache size), the CPU build's C(CPU KV cache size)).
      type: int
      returned: when logged
    max_concurrency:
      description: How many requests of the served C(--max-model-len) the KV cache holds at once.
      type: float
      returned: when logged
    cudagraph_gib:
      description: GiB of CUDA-graph memory (C(Graph capturing finished ... took)).
      type: float
      returned: when logged
    gpu_blocks:
      description: KV-cache blocks (vLLM V0's C(# GPU blocks), V1's C(num_gpu_blocks)).
      type: int
      returned: when logged
    weights_seconds:
      description: Seconds the model's load took, weights and model set-up (C(Model loading took ... and ... seconds)).
      type: float
      returned: when logged
    weights_read_seconds:
      description: Seconds the checkpoint's read alone took (C(Loading weights took)).
      type: float
      returned: when logged
    weights_gib_per_second:
      description:
        - RV(startup.weights_gib) over RV(startup.weights_read_seconds), or over RV(startup.weights_seconds) where vLLM
          logged no read of its own; one rank's rate, to set beside the disk's.
      type: float
      returned: when the weights and their seconds are logged
    memory_profiling_seconds:
      description: Seconds vLLM V0's memory profiling took (C(Memory profiling takes)).
      type: float
      returned: when logged
    compile_seconds:
      description: Seconds of torch.compile, the C(compilation) figure of the engine's start, else C(torch.compile took).
      type: float
      returned: when logged
    graph_capture_seconds:
      description: Seconds of CUDA-graph capture (C(Graph capturing finished in)).
      type: float
      returned: when logged
    engine_init_seconds:
      description:
        - Seconds of the engine's start after the weights - profiling, the KV cache, warm-up, compilation and graph
          capture included (C(init engine (profile, create kv cache, warmup model) took)).
      type: float
      returned: when logged
    kv_cache_device:
      description: V(GPU), or V(CPU) for the CPU build.
      type: str
      returned: when logged
    api_ready_seconds:
      description:
        - Seconds from the start of the unit's current run (systemd's C(ExecMainStartTimestampMonotonic), else the
          run's first journal line) until its API answered, never from the wait's start.
        - Where the wait saw the start, when C(/health) first answered 200; where the API answered the wait's first
          question (a gate asked after the start), the journal's time of uvicorn's C(Application startup complete.)
          line (C(journalctl --output short-monotonic)).
      type: float
      returned: when O(unit) is set, C(/health) answered and the start or the journal dates it
    gate_began_seconds:
      description: Seconds from the start of the unit's current run until the wait began.
      type: float
      returned: when O(unit) is set, systemd told the run's start, and the run began before the wait
    backends:
      description:
        - The backends vLLM said it chose at this start, in the order it first named each (every rank names its
          own), from its C(Using ... backend) lines, at most 16; what lies between those words, quotes removed.
      type: list
      elements: str
      returned: when logged
      sample: [TRITON_MLA attention, FLASHINFER_CUTLASS NvFp4 MoE]
  sample:
    weights_gib: 67.2
    available_kv_gib: 12.28
    kv_tokens: 178912
    max_concurrency: 1.36
    kv_cache_device: GPU
    backends: [TRITON_MLA attention, FLASHINFER_CUTLASS NvFp4 MoE]
    api_ready_seconds: 1312.204
    gate_began_seconds: 0.31
progress:
  description:
    - Loading-progress lines from the unit's journal for its current run (safetensors shards, model
      loading, KV cache size, maximum concurrency, startup complete). Consecutive shard-progress lines
      are folded into the latest one. Empty without O(unit).
    - A line of more than 1024 characters keeps its first 1024, followed by C(... (N more characters)).
  returned: always
  type: list
  elements: str
  sample:
    - "Loading safetensors checkpoint shards: 100% Completed | 119/119 [19:02<00:00,  9.60s/it]"
    - Model loading took 67.2 GiB memory and 1151.2 seconds
    - "GPU KV cache size: 178,912 tokens, Maximum concurrency for 131,072 tokens per request: 1.36x"
    - "Application startup complete."
restarts:
  description: How many times systemd restarted O(unit) during the wait (growth of C(NRestarts)).
  returned: when O(unit) is set
  type: int
  sample: 0
unit_state:
  description: The unit's properties at the last poll.
  returned: when O(unit) is set
  type: dict
  sample:
    LoadState: loaded
    ActiveState: active
    SubState: running
    Result: success
    NRestarts: "0"
    ExecMainStatus: "0"
    ExecMainStartTimestampMonotonic: "1234567890"
last_state:
  description:
    - What the last poll saw, on failure (for example V(/health answered 503), V(connection refused (/health)),
      V(no complete answer within 30 s (/health)) or V(an answer of more than 65536 bytes (/health))).
  returned: failure
  type: str
  sample: connection refused (/health)
journal:
  description:
    - The journal lines of O(unit) that the failure message quotes, the explaining lines; for a start that made no
      progress for O(stall_timeout), the unit's last lines.
    - Only lines that hold no client's words are quoted - vLLM's own logger lines (its request logger's excepted),
      systemd's about the unit, and other output only before the run's API was up - never uvicorn's access lines,
      whose query a client writes (on C(--uds) without an address before it).
    - A line of more than 1024 characters keeps its first 1024 (a last line of a stalled start, its first 300),
      followed by C(... (N more characters)).
  returned: failure, when O(unit) is set
  type: list
  elements: str
  sample:
    - "ValueError: To serve at least one request with the model's max seq len (262144), ..."
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import MAX_WAIT_SECONDS, range_problem
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._chat_check import (
    DEFAULT_EXPECT,
    DEFAULT_INTERVAL,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPT,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_STALL_TIMEOUT,
    DEFAULT_TIMEOUT,
    MAX_INTERVAL,
    ChatCheck,
    CheckFailed,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    DEFAULT_URL,
    api_key_problem,
    ca_path_problem,
    endpoint_argument_spec,
    hide_url_password,
    make_transport,
    url_problem,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._journal import DEFAULT_JOURNAL_LINES
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._long_prompt import (
    DEFAULT_GREEDY_TOKENS,
    long_prompt_problem,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._openai import (
    ARGUMENTS_MATCHES,
    DEFAULT_FORBIDDEN_MARKUP,
    extra_body_problem,
    markup_problem,
    tool_call_problem,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._systemd import journal_reader, unit_probe


def validate(module):
    """What argument_spec cannot express; returns the first problem or None."""
    p = module.params
    problem = (
        url_problem(p['url'])
        or api_key_problem(p['api_key'] or '')
        or extra_body_problem(p['extra_body'])
        or markup_problem(p['forbidden_markup'])
        or tool_call_problem(p['tool_call'])
        or long_prompt_problem(p['long_prompt'], p['tool_call'])
        or ca_path_problem(p['ca_path'], p['validate_certs'])
    )
    if problem:
        return problem
    ranges = (
        ('interval', 0, MAX_INTERVAL, ' seconds', True),
        ('timeout', 1, MAX_WAIT_SECONDS, '', False),
        ('request_timeout', 1, MAX_WAIT_SECONDS, '', False),
        ('max_tokens', 1, None, '', False),
        ('max_model_len', 1, None, '', False),
        ('max_restarts', 0, None, '', False),
        ('journal_lines', 0, None, '', False),
        ('stall_timeout', 0, MAX_WAIT_SECONDS, '', False),
    )
    for name, low, high, unit, above in ranges:
        problem = None if p[name] is None else range_problem(name, p[name], low, high, unit, above)
        if problem:
            return problem
    return None


ARGUMENT_SPEC = dict(
    url=dict(type='str', default=DEFAULT_URL),
    model=dict(type='str'),
    max_model_len=dict(type='int', no_log=False),
    prompt=dict(type='str', default=DEFAULT_PROMPT),
    expect=dict(type='str', default=DEFAULT_EXPECT),
    max_tokens=dict(type='int', default=DEFAULT_MAX_TOKENS, no_log=False),
    extra_body=dict(type='dict', default={}),
    judge_reasoning=dict(type='bool', default=False),
    expect_reasoning=dict(type='bool'),
    forbidden_markup=dict(type='list', elements='str', default=list(DEFAULT_FORBIDDEN_MARKUP)),
    tool_call=dict(
        type='dict',
        options=dict(
            tool=dict(type='dict', required=True),
            prompt=dict(type='str', required=True),
            name=dict(type='str'),
            arguments=dict(type='dict', default={}),
            arguments_match=dict(type='str', choices=list(ARGUMENTS_MATCHES), default='subset'),
        ),
    ),
    long_prompt=dict(
        type='dict',
        options=dict(
            fact=dict(type='str'),
            filler=dict(type='str', required=True),
            repeats=dict(type='int'),
            target_tokens=dict(type='int', no_log=False),
            greedy_prompt=dict(type='str'),
            greedy_tokens=dict(type='int', default=DEFAULT_GREEDY_TOKENS, no_log=False),
            min_tokens=dict(type='int', default=0, no_log=False),
        ),
    ),
    stream=dict(type='bool', default=False),
    api_key=dict(type='str', no_log=True),
    timeout=dict(type='int', default=DEFAULT_TIMEOUT),
    interval=dict(type='float', default=DEFAULT_INTERVAL),
    request_timeout=dict(type='int', default=DEFAULT_REQUEST_TIMEOUT),
    **endpoint_argument_spec(),
    unit=dict(type='str'),
    max_restarts=dict(type='int', default=DEFAULT_MAX_RESTARTS),
    journal_lines=dict(type='int', default=DEFAULT_JOURNAL_LINES),
    stall_timeout=dict(type='int', default=DEFAULT_STALL_TIMEOUT),
)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    hide_url_password(module)
    problem = validate(module)
    if problem:
        module.fail_json(msg=problem)

    unit = p['unit']
    api_key = p['api_key']
    check = ChatCheck(
        http=make_transport(
            p['url'],
            api_key=api_key,
            validate_certs=p['validate_certs'],
            use_proxy=p['use_proxy'],
            ca_path=p['ca_path'],
            unix_socket=p['unix_socket'],
        ),
        url=p['url'],
        model=p['model'],
        max_model_len=p['max_model_len'],
        prompt=p['prompt'],
        expect=p['expect'],
        max_tokens=p['max_tokens'],
        timeout=p['timeout'],
        interval=p['interval'],
        request_timeout=p['request_timeout'],
        api_key_set=bool(api_key),
        extra_body=p['extra_body'],
        judge_reasoning=p['judge_reasoning'],
        expect_reasoning=p['expect_reasoning'],
        forbidden_markup=p['forbidden_markup'],
        tool_call=p['tool_call'],
        long_prompt=p['long_prompt'],
        stream=p['stream'],
        unit=unit,
        probe_unit=unit_probe(module, unit, api_key) if unit else None,
        read_journal=journal_reader(module, unit, api_key) if unit else None,
        max_restarts=p['max_restarts'],
        journal_lines=p['journal_lines'],
        stall_timeout=p['stall_timeout'],
    )
    try:
        result = check.run()
    except CheckFailed as exc:
        module.fail_json(msg=exc.msg, changed=False, **exc.details)
    module.exit_json(changed=False, **result)


if __name__ == '__main__':
    main()
