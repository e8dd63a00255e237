# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""vLLM's OpenAI-compatible answers read and judged: /v1/models, a chat completion and its tool calls, an error
body; and the options that judge them (expect, forbidden_markup, extra_body, tool_call) checked before any request.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.

Pure: each function takes the text a server sent or the option a user gave (chat_check, load_probe).
"""

import json
import re
from typing import Any, Optional

from ansible.module_utils.common.text.converters import to_text

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import quote

# The most of an answer (its content or reasoning) that is judged and returned, in characters: the end,
# where a long answer reaches its conclusion. Python's re has no timeout and some expressions take time
# quadratic in the text (.*paris); on this length they take well under a second.
MAX_ANSWER_CHARS = 32768

# Markup that a reasoning or tool-call parser takes out of the content: Kimi-K2.5's thinking tags and
# tool-call tokens. Left in the content, the server serves the model without its parser (or a template
# or tokenizer change broke the split), and clients see the model's raw output.
DEFAULT_FORBIDDEN_MARKUP = (
    '<think>',
    '</think>',
    '<|tool_calls_section_begin|>',
    '<|tool_calls_section_end|>',
    '<|tool_call_begin|>',
    '<|tool_call_argument_begin|>',
    '<|tool_call_end|>',
)
# Request fields the checks set or rely on, which extra_body may not set: the model and the question,
# one non-streamed choice, the length the messages cite, the tools of the tool gate, the reasoning the
# thinking check reads, and echo (vLLM then puts the prompt into the content).
RESERVED_REQUEST_KEYS = (
    'model',
    'messages',
    'stream',
    'stream_options',
    'n',
    'max_tokens',
    'max_completion_tokens',
    'tools',
    'tool_choice',
    'functions',
    'function_call',
    'include_reasoning',
    'echo',
)
ARGUMENTS_MATCHES = ('subset', 'exact', 'pattern')


def expect_problem(expect: str) -> Optional[str]:
    """Why expect cannot judge an answer, or None."""
    try:
        pattern = re.compile(expect)
    except re.error as exc:
        return "expect '%s' is not a valid regular expression: %s" % (expect, exc)
    if pattern.search('') is not None:
        return (
            "expect '%s' matches an empty answer, so it cannot tell an answer from none; give text that the "
            'right answer must contain' % expect
        )
    return None


def extra_body_problem(extra_body: dict[str, Any]) -> Optional[str]:
    """Why extra_body cannot be merged into the check's requests, or None."""
    reserved = [key for key in RESERVED_REQUEST_KEYS if key in extra_body]
    if reserved:
        return (
            'extra_body sets %s, which the check sets or relies on itself; use the options model, prompt, '
            'max_tokens and tool_call instead' % ', '.join(reserved)
        )
    return None


def markup_problem(markup: list[str]) -> Optional[str]:
    """Why forbidden_markup cannot judge a content, or None."""
    for position, token in enumerate(markup, 1):
        if not isinstance(token, str) or not token:
            return 'forbidden_markup has an empty entry at position %d; every content contains it' % position
    return None


def tool_call_problem(tool_call: Optional[dict[str, Any]]) -> Optional[str]:
    """Why tool_call cannot be the tool gate, or None."""
    if tool_call is None:
        return None
    tool = tool_call.get('tool')
    function = tool.get('function') if isinstance(tool, dict) else None
    if (
        not isinstance(tool, dict)
        or tool.get('type') != 'function'
        or not isinstance(function, dict)
        or not isinstance(function.get('name'), str)
        or not function['name']
    ):
        return (
            'tool_call.tool must be an OpenAI tools entry, {"type": "function", "function": {"name": ..., '
            '"parameters": ...}}, got %s' % quote(_json(tool), 200)
        )
    name = tool_call.get('name')
    if name is not None and name != function['name']:
        return "tool_call.name '%s' is not the name of the function that tool_call.tool offers ('%s')" % (
            name,
            function['name'],
        )
    if not isinstance(tool_call.get('prompt'), str) or not tool_call['prompt'].strip():
        return 'tool_call.prompt must be a question that the tool answers'
    if not isinstance(tool_call.get('arguments') or {}, dict):
        return 'tool_call.arguments must be a JSON object, got %s' % quote(_json(tool_call['arguments']), 200)
    if tool_call.get('arguments_match', 'subset') not in ARGUMENTS_MATCHES:
        return 'tool_call.arguments_match must be one of %s, got %s' % (
            ', '.join(ARGUMENTS_MATCHES),
            tool_call['arguments_match'],
        )
    if tool_call.get('arguments_match') == 'pattern':
        for key, pattern in sorted((tool_call.get('arguments') or {}).items()):
            if not isinstance(pattern, str):
                return 'tool_call.arguments.%s must be a regular expression with arguments_match pattern, got %s' % (
                    key,
                    quote(_json(pattern), 200),
                )
            try:
                re.compile(pattern)
            except re.error as exc:
                return 'tool_call.arguments.%s is not a regular expression (%s): %s' % (key, exc, quote(pattern, 200))
    return None


def _json(value: Any) -> str:
    """value as compact JSON for a message, or its repr when it is no JSON."""
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def parse_json(text: str) -> tuple[Any, Optional[str]]:
    """Parse a JSON body; return (value, None) or (None, reason)."""
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, 'a body that is not JSON (%s): %s' % (to_text(exc), quote(text, 200))
    except RecursionError:
        return None, 'a body that is not JSON (nested too deeply): %s' % quote(text, 200)


def parse_models(text: str) -> list[str]:
    """Return the model ids that /v1/models lists, or raise ValueError with the reason."""
    doc, error = parse_json(text)
    if error:
        raise ValueError(error)
    data = doc.get('data') if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError('a body without a "data" list: %s' % quote(text, 200))
    return [
        entry['id'] for entry in data if isinstance(entry, dict) and isinstance(entry.get('id'), str) and entry['id']
    ]


def served_max_model_len(text: str, model: str) -> Optional[int]:
    """The max_model_len that /v1/models reports for model (vLLM's entries carry it), or None where it reports none."""
    doc, error = parse_json(text)
    data = doc.get('data') if not error and isinstance(doc, dict) else None
    for entry in data if isinstance(data, list) else []:
        if isinstance(entry, dict) and entry.get('id') == model:
            return _count(entry.get('max_model_len'))
    return None


def parse_tokenize(text: str) -> Optional[tuple[int, int]]:
    """vLLM's /tokenize answer: the prompt's count of tokens and the max_model_len it serves, or None without them."""
    doc, error = parse_json(text)
    if error or not isinstance(doc, dict):
        return None
    count, served_len = _count(doc.get('count')), _count(doc.get('max_model_len'))
    if count is None or served_len is None:
        return None
    return count, served_len


def error_message(text: str) -> str:
    """The message of an OpenAI-style error body, else the body itself (shortened)."""
    doc, error = parse_json(text)
    if not error and isinstance(doc, dict):
        err = doc.get('error', doc)
        if isinstance(err, dict) and err.get('message'):
            return quote(err['message'], 300)
        if isinstance(err, str):
            return quote(err, 300)
        if doc.get('detail'):
            return quote(to_text(doc['detail']), 300)
    return quote(text, 300)


def parse_chat(text: str) -> dict[str, Any]:
    """Read one chat completion.

    Returns a dict with answer (the content, '' when there is none), content,
    reasoning (vLLM's `reasoning`, formerly `reasoning_content`), tool_calls
    (each with id, name and arguments as the server sent them), finish_reason,
    completion_tokens and prompt_tokens. Content and reasoning keep their last
    MAX_ANSWER_CHARS characters.
    Raises ValueError when the body is not a chat completion.
    """
    doc, error = parse_json(text)
    if error:
        raise ValueError(error)
    choices = doc.get('choices') if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError('a body without choices: %s' % quote(text, 200))
    choice = choices[0]
    message = choice.get('message') or {}
    if not isinstance(message, dict):
        raise ValueError('a choice without a message: %s' % quote(text, 200))
    content = message.get('content')
    reasoning = message.get('reasoning')
    if reasoning is None:
        reasoning = message.get('reasoning_content')
    for name, value in (('content', content), ('reasoning', reasoning)):
        if value is not None and not isinstance(value, str):
            raise ValueError('a message whose %s is not text: %s' % (name, quote(text, 200)))
    content = _answer_end(content)
    reasoning = _answer_end(reasoning)
    usage = doc.get('usage') if isinstance(doc.get('usage'), dict) else {}
    finish_reason = choice.get('finish_reason')
    return {
        'answer': content or '',
        'content': content,
        'reasoning': reasoning,
        'tool_calls': parse_tool_calls(message.get('tool_calls'), text),
        'finish_reason': finish_reason if isinstance(finish_reason, str) else None,
        'completion_tokens': _count(usage.get('completion_tokens')),
        'prompt_tokens': _count(usage.get('prompt_tokens')),
    }


def assemble_stream(text: str) -> str:
    """The chat completion a streamed answer (text/event-stream) adds up to, as the JSON body parse_chat reads.

    The deltas of the first choice are joined as the OpenAI clients join them: content and reasoning in order, each
    tool call by its index (its id from the first delta that has one, its name and arguments in pieces); the last
    finish_reason and the usage event count. Raises ValueError for an event that is no JSON chunk, an error event, or
    a stream that ends before `data: [DONE]`.
    """
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish_reason = None
    usage = None
    for line in text.splitlines():
        if not line.startswith('data:'):
            continue
        data = line[len('data:') :].strip()
        if data == '[DONE]':
            break
        chunk, error = parse_json(data)
        if error:
            raise ValueError('a stream with ' + error)
        if not isinstance(chunk, dict) or 'error' in chunk:
            raise ValueError('a stream that ended in an error: %s' % error_message(data))
        if isinstance(chunk.get('usage'), dict):
            usage = chunk['usage']
        choices = chunk.get('choices')
        if not isinstance(choices, list) or not choices:
            continue
        choice = choices[0]
        delta = choice.get('delta') if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            raise ValueError('a stream whose event has no delta: %s' % quote(data, 200))
        _add_text(content, delta.get('content'), data)
        _add_text(
            reasoning,
            delta.get('reasoning') if delta.get('reasoning') is not None else delta.get('reasoning_content'),
            data,
        )
        for piece in delta.get('tool_calls') or []:
            _add_call_piece(calls, piece, data)
        if isinstance(choice.get('finish_reason'), str):
            finish_reason = choice['finish_reason']
    else:
        raise ValueError('a stream that ended before data: [DONE]: %s' % quote(text[-200:], 200))
    message = {
        'content': ''.join(content) if content else None,
        'reasoning': ''.join(reasoning) if reasoning else None,
        'tool_calls': [calls[index] for index in sorted(calls)] or None,
    }
    return json.dumps({'choices': [{'message': message, 'finish_reason': finish_reason}], 'usage': usage})


def stream_events(text: str) -> int:
    """How many events a streamed answer came in before its `data: [DONE]`: the chunks assemble_stream joined."""
    events = 0
    for line in text.splitlines():
        if line.startswith('data:'):
            if line[len('data:') :].strip() == '[DONE]':
                break
            events += 1
    return events


def _add_text(pieces: list[str], piece: Any, data: str) -> None:
    if piece is None:
        return
    if not isinstance(piece, str):
        raise ValueError('a stream whose delta holds text that is not text: %s' % quote(data, 200))
    pieces.append(piece)


def _add_call_piece(calls: dict[int, dict[str, Any]], piece: Any, data: str) -> None:
    """Join one delta of a tool call into the call of its index."""
    function = piece.get('function') if isinstance(piece, dict) else None
    index = piece.get('index') if isinstance(piece, dict) else None
    if not isinstance(index, int) or isinstance(index, bool) or not isinstance(function or {}, dict):
        raise ValueError('a stream whose tool call delta has no index or function: %s' % quote(data, 200))
    call = calls.setdefault(index, {'id': None, 'type': 'function', 'function': {'name': '', 'arguments': ''}})
    if call['id'] is None and isinstance(piece.get('id'), str):
        call['id'] = piece['id']
    for key in ('name', 'arguments'):
        value = (function or {}).get(key)
        if value is not None:
            if not isinstance(value, str):
                raise ValueError('a stream whose tool call %s is not text: %s' % (key, quote(data, 200)))
            call['function'][key] += value


def parse_tool_calls(calls: Any, text: str) -> list[dict[str, Any]]:
    """The tool calls of a message as [{'id', 'name', 'arguments'}]; the arguments stay the server's text.

    vLLM leaves tool_calls out when there are none. Raises ValueError for calls of the wrong shape.
    """
    if calls is None:
        return []
    parsed = []
    if isinstance(calls, list):
        for call in calls:
            function = call.get('function') if isinstance(call, dict) else None
            if not isinstance(function, dict):
                break
            name, arguments, call_id = function.get('name'), function.get('arguments'), call.get('id')
            if (
                not isinstance(name, str)
                or not isinstance(arguments, str)
                or not isinstance(call_id, (str, type(None)))
            ):
                break
            parsed.append({'id': call_id, 'name': name, 'arguments': arguments[-MAX_ANSWER_CHARS:]})
        else:
            return parsed
    raise ValueError(
        'a message whose tool_calls are not calls of a function by name with text arguments: %s' % quote(text, 200)
    )


def _count(value: Any) -> Optional[int]:
    """value when it is a count, else None: an int (a bool is one to Python) that is not negative."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _answer_end(text: Optional[str]) -> Optional[str]:
    """The last MAX_ANSWER_CHARS characters of text, which the check judges and returns."""
    if text is None:
        return None
    return text[-MAX_ANSWER_CHARS:]


def answer_matches(expect: str, answer: Optional[str]) -> bool:
    """True when the regular expression finds a match anywhere in the answer."""
    return re.search(expect, answer or '') is not None


def judge_tool_calls(
    calls: list[dict[str, Any]], name: str, expected: dict[str, Any], match: str
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(the arguments of the first call of name that match, None) or (None, what is wrong, after 'The answer ...').

    match is one of ARGUMENTS_MATCHES (arguments_match says how each compares)."""
    if not calls:
        return None, 'has no tool call, where it should call %s' % name
    named = [call for call in calls if call['name'] == name]
    if not named:
        return None, 'called %s, not %s' % (', '.join(call['name'] for call in calls), name)
    problems = []
    for call in named:
        try:
            arguments = json.loads(call['arguments'])
        except ValueError as exc:
            problems.append("with arguments that are not JSON (%s): '%s'" % (to_text(exc), quote(call['arguments'])))
            continue
        except RecursionError:
            problems.append("with arguments that are not JSON (nested too deeply): '%s'" % quote(call['arguments']))
            continue
        if not isinstance(arguments, dict):
            problems.append("with arguments that are not a JSON object: '%s'" % quote(call['arguments']))
        elif not arguments_match(arguments, expected, match):
            problems.append(
                "with arguments '%s', which %s %s"
                % (quote(call['arguments']), _MATCH_WORDS[match], quote(_json(expected)))
            )
        else:
            return arguments, None
    return None, 'called %s %s' % (name, problems[0])


_MATCH_WORDS = {
    'subset': 'do not contain',
    'exact': 'are not exactly',
    'pattern': 'do not match, per argument and ignoring case,',
}


def arguments_match(arguments: dict[str, Any], expected: dict[str, Any], match: str) -> bool:
    """Whether the call's arguments hold every expected key: with an equal value (subset; exact also allows no other
    key), or with a string, number or boolean whose JSON text the expected regular expression finds, ignoring case
    (pattern: a model may answer "Paris, France" or "paris" for Paris)."""
    if match == 'exact' and set(arguments) != set(expected):
        return False
    if match == 'pattern':
        return all(key in arguments and _pattern_finds(pattern, arguments[key]) for key, pattern in expected.items())
    return all(key in arguments and same_json(arguments[key], value) for key, value in expected.items())


def _pattern_finds(pattern: str, value: Any) -> bool:
    if isinstance(value, (dict, list)) or value is None:
        return False
    text = value if isinstance(value, str) else json.dumps(value)
    return re.search(pattern, text, re.IGNORECASE) is not None


def same_json(a: Any, b: Any) -> bool:
    """Equality of JSON values as JSON means it: true is not 1, 1 is 1.0, objects and arrays compare whole."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same_json(a[key], b[key]) for key in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
