# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

import math

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._long_prompt import (
    SizingFailed,
    compose,
    fill_repeats,
    greedy_problem,
    long_prompt_problem,
)

FILLER = 'The sky is blue. '
LONG = {'fact': 'Remember this: the secret city is Lima.', 'filler': FILLER, 'repeats': 2}


class Tokenizer:
    """A server's count: base tokens, then per_filler a repeat, less merged tokens at each join of two fillers."""

    def __init__(self, base=20, per_filler=5, merged_per_join=0.0):
        self.base, self.per_filler, self.merged_per_join = base, per_filler, merged_per_join
        self.asked = []

    def __call__(self, repeats):
        self.asked.append(repeats)
        return self.base + self.per_filler * repeats - int(self.merged_per_join * max(0, repeats - 1))


@pytest.mark.parametrize(
    'tokenizer, target, filled, asked',
    [
        # (1000 - 20) // 17 bytes = 57 first; then the 5 tokens a filler seen fill it within one filler.
        (Tokenizer(), 1000, (196, 1000), [0, 57, 196]),
        (Tokenizer(), 921, (180, 920), [0, 53, 180]),
        # Joins merge a token in every fourth: 207 repeats come to 1004.
        (Tokenizer(merged_per_join=0.25), 1000, (206, 999), [0, 57, 206]),
        # The prompt without filler is the target already.
        (Tokenizer(base=40), 40, (0, 40), [0, 1]),
        # A tokenizer that makes more tokens of the filler than it has bytes: the first guess is over, then under.
        (Tokenizer(per_filler=40), 1000, (24, 980), [0, 57, 24]),
    ],
    ids=['even', 'ninety-percent-of-1024', 'merging-joins', 'base-is-target', 'more-tokens-than-bytes'],
)
def test_the_filler_fills_the_prompt_to_its_target_within_one_filler(tokenizer, target, filled, asked):
    assert fill_repeats(target, tokenizer, FILLER) == filled
    assert tokenizer.asked == asked


@pytest.mark.parametrize(
    'tokenizer, target, expected_msg',
    [
        (
            Tokenizer(base=50),
            40,
            'the prompt without filler (the fact, the question and the chat template) comes to 50 tokens, more than '
            'long_prompt.target_tokens (40)',
        ),
        (
            Tokenizer(per_filler=0),
            1000,
            "long_prompt.filler 'The sky is blue. ' adds no tokens: 57 repeats came to 20, as none did",
        ),
    ],
    ids=['base-over-target', 'filler-adds-nothing'],
)
def test_a_prompt_no_filler_can_size_is_refused_with_the_counts(tokenizer, target, expected_msg):
    with pytest.raises(SizingFailed) as err:
        fill_repeats(target, tokenizer, FILLER)
    assert str(err.value) == expected_msg


def test_sizing_asks_at_most_seven_counts_and_keeps_the_largest_that_fitted():
    # Tokens per filler that fall as the prompt grows: each estimate undershoots, and the seventh count ends it.
    asked = []

    def concave(repeats):
        asked.append(repeats)
        return 20 + int(100 * math.sqrt(repeats))

    assert fill_repeats(1000, concave, FILLER) == (94, 989)
    assert asked == [0, 57, 74, 84, 89, 92, 94]


def test_a_filler_whose_every_count_overshoots_is_refused():
    def steep(repeats):
        return 20 + int(300 * math.log1p(repeats))

    with pytest.raises(SizingFailed) as err:
        fill_repeats(1000, steep, FILLER)
    assert str(err.value) == (
        'no repeats of long_prompt.filler kept the prompt within long_prompt.target_tokens (1000) in 7 counts '
        'of /tokenize: the fewest tried, 28, came to 1030'
    )


@pytest.mark.parametrize(
    'long_prompt, question, expected',
    [
        (
            LONG,
            'Which is the secret city?',
            'Remember this: the secret city is Lima. ' + FILLER * 2 + 'Which is the secret city?',
        ),
        (dict(LONG, fact=None), 'Q?', FILLER * 2 + 'Q?'),
        (dict(LONG, fact=''), 'Q?', FILLER * 2 + 'Q?'),
    ],
    ids=['fact-filler-question', 'no-fact', 'empty-fact'],
)
def test_the_message_is_the_fact_the_filler_then_the_question(long_prompt, question, expected):
    assert compose(long_prompt, 2, question) == expected


@pytest.mark.parametrize(
    'long_prompt, expected_msg',
    [
        (
            {'filler': FILLER},
            "long_prompt needs one of repeats and target_tokens: repeats sets the filler's count, target_tokens the "
            "prompt's size in tokens, from which the count follows",
        ),
        (
            {'filler': FILLER, 'repeats': 3, 'target_tokens': 900},
            "long_prompt needs one of repeats and target_tokens: repeats sets the filler's count, target_tokens the "
            "prompt's size in tokens, from which the count follows",
        ),
        (
            {'filler': '', 'target_tokens': 900},
            'long_prompt.filler is empty, so no repeats of it fill the prompt to long_prompt.target_tokens',
        ),
        ({'filler': FILLER, 'target_tokens': 0}, 'long_prompt.target_tokens must be at least 1, got 0'),
        (
            {'filler': FILLER, 'target_tokens': 900, 'greedy_prompt': ' '},
            'long_prompt.greedy_prompt is empty: set the short question to ask with and without the long prefix',
        ),
        (
            {'filler': FILLER, 'target_tokens': 900, 'greedy_prompt': 'Q?', 'greedy_tokens': 0},
            'long_prompt.greedy_tokens must be at least 1, got 0',
        ),
        ({'filler': FILLER, 'repeats': 3, 'min_tokens': 0, 'greedy_tokens': 8}, None),
        ({'filler': FILLER, 'target_tokens': 900, 'greedy_prompt': 'Q?', 'greedy_tokens': 1}, None),
    ],
    ids=[
        'neither',
        'both',
        'empty-filler-sized',
        'target-zero',
        'greedy-prompt-blank',
        'greedy-tokens-zero',
        'repeats',
        'sized-with-probe',
    ],
)
def test_a_long_prompt_that_cannot_be_asked_is_refused(long_prompt, expected_msg):
    assert long_prompt_problem(long_prompt, None) == expected_msg


SOURCE = 'The greedy-equivalence probe of tiny-kimi at http://127.0.0.1:8000'
PARIS = {'content': 'The capital of France is Paris.', 'reasoning': None}


@pytest.mark.parametrize(
    'alone, after, prefix_tokens, expected_msg',
    [
        (PARIS, dict(PARIS), 921, None),
        # No reasoning and an empty one are the same answer.
        (PARIS, dict(PARIS, reasoning=''), 921, None),
        (
            PARIS,
            {'content': 'The capital of France is Berlin.', 'reasoning': None},
            921,
            'The greedy-equivalence probe of tiny-kimi at http://127.0.0.1:8000 drifted after the long prompt: at '
            "temperature 0, 'What is the capital of France?' began 'The capital of France is Paris.' alone and 'The "
            "capital of France is Berlin.' after the long prompt of 921 tokens; the first 8 tokens must be the same "
            '(a decode that misreads a long context, as vllm#41623 reports of Kimi under decode context parallelism)',
        ),
        (
            {'content': None, 'reasoning': 'The user asks'},
            {'content': None, 'reasoning': 'sky sky sky'},
            None,
            'The greedy-equivalence probe of tiny-kimi at http://127.0.0.1:8000 drifted after the long prompt: at '
            "temperature 0, 'What is the capital of France?' began reasoning 'The user asks', content '' alone and "
            "reasoning 'sky sky sky', content '' after the long prompt; the first 8 tokens must be the same "
            '(a decode that misreads a long context, as vllm#41623 reports of Kimi under decode context parallelism)',
        ),
    ],
    ids=['same', 'reasoning-none-or-empty', 'drifted', 'drifted-in-reasoning-uncounted'],
)
def test_the_greedy_probe_passes_only_the_same_start(alone, after, prefix_tokens, expected_msg):
    assert greedy_problem(SOURCE, 'What is the capital of France?', 8, alone, after, prefix_tokens) == expected_msg
