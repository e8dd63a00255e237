# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""chat_check's long prompt: its text, the filler's repeats that fill it to a size, and the greedy-equivalence verdict.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.

Pure: the server's count of a prompt's tokens comes in as a function, so the unit tests size prompts against a
tokenizer of their own.
"""

from typing import Any, Callable, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import range_problem
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import quote

# The most times a long prompt's filler may be repeated: a filler of a few tokens makes millions of tokens, far past any
# context, so more is a typing error.
MAX_LONG_PROMPT_REPEATS = 1000000
# Counts asked after the first two while sizing: a tokenizer that adds the same tokens per filler needs one, the merges
# at the fillers' joins one or two more.
MAX_SIZING_ROUNDS = 6
# The first tokens the greedy-equivalence probe compares, unless greedy_tokens says otherwise.
DEFAULT_GREEDY_TOKENS = 8


class SizingFailed(Exception):
    """No number of repeats fills the prompt to its target; the message says why."""


def long_prompt_problem(long_prompt: Optional[dict[str, Any]], tool_call: Optional[dict[str, Any]]) -> Optional[str]:
    """Why long_prompt cannot be asked, or None."""
    if long_prompt is None:
        return None
    if tool_call is not None:
        return 'long_prompt and tool_call are asked by separate checks: set one of them'
    repeats, target = long_prompt.get('repeats'), long_prompt.get('target_tokens')
    if (repeats is None) == (target is None):
        return (
            "long_prompt needs one of repeats and target_tokens: repeats sets the filler's count, target_tokens the "
            "prompt's size in tokens, from which the count follows"
        )
    if target is not None and not long_prompt['filler']:
        return 'long_prompt.filler is empty, so no repeats of it fill the prompt to long_prompt.target_tokens'
    greedy_prompt = long_prompt.get('greedy_prompt')
    if greedy_prompt is not None and not greedy_prompt.strip():
        return 'long_prompt.greedy_prompt is empty: set the short question to ask with and without the long prefix'
    return (
        (range_problem('long_prompt.repeats', repeats, 0, MAX_LONG_PROMPT_REPEATS) if repeats is not None else None)
        or (range_problem('long_prompt.target_tokens', target, 1) if target is not None else None)
        or range_problem('long_prompt.min_tokens', long_prompt.get('min_tokens', 0), 0)
        or range_problem('long_prompt.greedy_tokens', long_prompt.get('greedy_tokens', DEFAULT_GREEDY_TOKENS), 1)
    )


def compose(long_prompt: dict[str, Any], repeats: int, question: str) -> str:
    """The user message: the fact and a space, the filler repeats times, then the question."""
    filled = long_prompt['filler'] * repeats + question
    if long_prompt.get('fact'):
        return '%s %s' % (long_prompt['fact'], filled)
    return filled


def fill_repeats(target: int, count: Callable[[int], int], filler: str) -> tuple[int, int]:
    """The most repeats of the filler whose prompt comes to at most target tokens, and its count.

    count(repeats) is the server's count of the whole prompt with the filler so often (the chat template's tokens
    included). The first guess takes a token per byte of the filler, which no tokenizer exceeds; each next one the
    tokens per filler seen so far, so a tokenizer whose count grows evenly is filled within a filler in two counts.
    Raises SizingFailed where the prompt without filler is over target already, the filler adds no tokens, or every
    count but the first was over target when the counts ran out.
    """
    base = count(0)
    if base > target:
        raise SizingFailed(
            'the prompt without filler (the fact, the question and the chat template) comes to %d tokens, more than '
            'long_prompt.target_tokens (%d)' % (base, target)
        )
    fitted = (0, base)
    # The fewest repeats tried that came to more than target, and their count.
    over: Optional[tuple[int, int]] = None
    guess = max(1, (target - base) // len(filler.encode('utf-8')))
    for _round in range(MAX_SIZING_ROUNDS):
        tokens = count(guess)
        if tokens <= target:
            fitted = max(fitted, (guess, tokens))
        else:
            over = (guess, tokens) if over is None else min(over, (guess, tokens))
        per_filler = (tokens - base) / guess
        if per_filler <= 0:
            raise SizingFailed(
                "long_prompt.filler '%s' adds no tokens: %d repeats came to %d, as none did"
                % (quote(filler, 100), guess, tokens)
            )
        guess = fitted[0] + int((target - fitted[1]) // per_filler)
        if over is not None:
            guess = min(guess, over[0] - 1)
        if guess <= fitted[0]:
            break
    else:
        if fitted[0] == 0 and over is not None:
            raise SizingFailed(
                'no repeats of long_prompt.filler kept the prompt within long_prompt.target_tokens (%d) in %d counts '
                'of /tokenize: the fewest tried, %d, came to %d' % (target, MAX_SIZING_ROUNDS + 1, over[0], over[1])
            )
    return fitted


def greedy_tokens(long_prompt: dict[str, Any]) -> int:
    """The first tokens the greedy-equivalence probe compares."""
    return long_prompt.get('greedy_tokens') or DEFAULT_GREEDY_TOKENS


def answer_start(reply: dict[str, Any]) -> str:
    """What a probe's answer began with, as a message quotes it: the content, after the reasoning where there is any."""
    content = quote(reply['content'] or '')
    if reply['reasoning']:
        return "reasoning '%s', content '%s'" % (quote(reply['reasoning']), content)
    return "'%s'" % content


def greedy_problem(
    source: str, prompt: str, tokens: int, alone: dict[str, Any], after: dict[str, Any], prefix_tokens: Optional[int]
) -> Optional[str]:
    """Why the short prompt's first tokens differ with the long prefix and without it, or None.

    alone and after are the two replies (content and reasoning), each cut at tokens tokens; at temperature 0 a
    server that reads a long context right reaches the same ones."""
    if (alone['content'] or '', alone['reasoning'] or '') == (after['content'] or '', after['reasoning'] or ''):
        return None
    counted = ' of %d tokens' % prefix_tokens if prefix_tokens is not None else ''
    return (
        "%s drifted after the long prompt: at temperature 0, '%s' began %s alone and %s after the long prompt%s; "
        'the first %d tokens must be the same (a decode that misreads a long context, as vllm#41623 reports of '
        'Kimi under decode context parallelism)'
        % (source, quote(prompt, 200), answer_start(alone), answer_start(after), counted, tokens)
    )
