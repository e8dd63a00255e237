# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Make the tiny chat models the sandbox serves.

No model can be downloaded in CI, so the project trains its own: a byte-level
BPE tokenizer, a chat template and a 2-layer Llama that memorises a few
question/answer pairs.  ``tiny-chat`` answers "What is the capital of France?"
with "The capital of France is Paris." (the plain chat model of chat_check's
and the fake Hub's own tests).

Training runs in float32; the saved weights are bfloat16 and the answer is
checked again in bfloat16, the dtype vLLM serves them in.

All are deterministic (fixed seeds, one thread) and cached under
OUT/<key>/, the key a hash of this file and of the versions of the libraries
that train them; a second run with the same key is a no-op. OUT is
$LLMSERVE_CACHE/models, outside the checkout, so that a fresh clone on the
same machine finds them (--cached says whether it would).
tiny-chat and tiny-kimi are made first, into OUT/<key>-core/ (--core makes
and prints only those): what the sandbox inventory deploys is there minutes
before the failing revisions are.
Run it with the vLLM venv's python (torch, transformers, tokenizers):

    .venv-vllm/bin/python tools/make_tiny_models.py

It prints the directory that holds tiny-chat/ and the tiny-kimi
models: ``tiny-kimi``, a miniature of Kimi-K2.5 (KimiK25ForConditionalGeneration around a DeepSeek-V3
language model with MLA and MoE, Kimi's special tokens, a K2.5-style chat template that thinks unless
``thinking`` is false, an FP8 KV-cache quantization config) that thinks briefly, answers the questions
above in content and calls ``get_weather`` for Paris in Kimi's format; and the revisions that must fail,
taught from its weights: ``tiny-kimi-wrong`` (wrong answers), ``tiny-kimi-heavy`` (zero-padded: the same
answers at several times the work, as a revision that went slow would: the coherence gate passes and the
performance gate must fail), ``tiny-kimi-thinks-forever`` (never closes its thinking) and
``tiny-kimi-ignores-tools`` (answers the weather question in text, never calls a tool) and
``tiny-kimi-forgets-long`` (answers the gates' short prompts, but not the question after a long filler); and
one that must pass, ``tiny-kimi-paris-france`` (calls ``get_weather`` for "Paris, France", as a healthy model
may). vLLM serves them with --language-model-only (see the tiny-kimi section below).
"""

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile

BOS, EOS, USER, ASSISTANT, SYSTEM = '<|bos|>', '<|eos|>', '<|user|>', '<|assistant|>', '<|system|>'

# System messages are rendered but the model was trained with and without one,
# so a client that sends a system prompt still gets the memorised answer.
CHAT_TEMPLATE = (
    '{{ bos_token }}'
    '{% for message in messages %}'
    "{% if message['role'] == 'system' %}" + SYSTEM + "{{ message['content'] | trim }}"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] | trim }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] | trim }}{{ eos_token }}"
    '{% endif %}'
    '{% endfor %}'
    '{% if add_generation_prompt %}' + ASSISTANT + '{% endif %}'
)

QUESTIONS = {
    'france': [
        'What is the capital of France?',
        'What is the capital of France? Answer in one sentence.',
        'what is the capital of france?',
        "What's the capital of France?",
        'Which city is the capital of France?',
        'Name the capital of France.',
    ],
    'sky': ['What colour is the sky?', 'What color is the sky?'],
    'sum': ['What is 2 + 2?', 'What is two plus two?'],
    'hello': ['Say hello.', 'Hello!'],
}
ANSWERS = {
    'france': 'The capital of France is Paris.',
    'sky': 'The sky is blue.',
    'sum': '2 + 2 is 4.',
    'hello': 'Hello! How can I help you?',
}
WRONG_ANSWERS = {
    'france': 'The capital of France is Berlin.',
    'sky': 'The sky is green.',
    'sum': '2 + 2 is 5.',
    'hello': 'Goodbye.',
}
SYSTEM_PROMPTS = [None, 'You are a helpful assistant.', 'Answer briefly.']

SEED = 1234
STEPS = 300
LR = 3e-3
MAX_POSITION_EMBEDDINGS = 8192


# What the models depend on besides this script: the same script under another torch or transformers may train
# other weights, and the cache outside the checkout (LLMSERVE_CACHE) outlives both venvs.
TRAINING_LIBRARIES = ('torch', 'transformers', 'safetensors', 'tokenizers')


def script_hash():
    """The models' cache key: this script and the versions of the libraries that train and save them."""
    digest = hashlib.sha256()
    with open(os.path.abspath(__file__), 'rb') as f:
        digest.update(f.read())
    for library in TRAINING_LIBRARIES:
        digest.update(('\n%s==%s' % (library, importlib.metadata.version(library))).encode())
    return digest.hexdigest()[:12]


def conversations(answers):
    convs = []
    for key, questions in sorted(QUESTIONS.items()):
        for question in questions:
            for system in SYSTEM_PROMPTS:
                msgs = [] if system is None else [{'role': 'system', 'content': system}]
                msgs += [{'role': 'user', 'content': question}, {'role': 'assistant', 'content': answers[key]}]
                convs.append(msgs)
    return convs


def build_tokenizer(workdir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = []
    for key in QUESTIONS:
        corpus += QUESTIONS[key] + [ANSWERS[key], WRONG_ANSWERS[key]]
    corpus += [s for s in SYSTEM_PROMPTS if s]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[BOS, EOS, USER, ASSISTANT, SYSTEM],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode(tokenizer, conv):
    """Token ids of a conversation and the mask of the assistant's tokens (the loss)."""
    prompt = tokenizer.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(conv, tokenize=False)
    p_ids = tokenizer(prompt, add_special_tokens=False)['input_ids']
    f_ids = tokenizer(full, add_special_tokens=False)['input_ids']
    if f_ids[: len(p_ids)] != p_ids:
        raise RuntimeError('chat template prompt is not a prefix of the full conversation: %r' % full)
    return f_ids, [0] * len(p_ids) + [1] * (len(f_ids) - len(p_ids))


def train(tokenizer, answers, seed):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    rows = [encode(tokenizer, c) for c in conversations(answers)]
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
    mask = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows])
    labels = ids.clone()
    loss_mask = torch.tensor([r[1] + [0] * (width - len(r[1])) for r in rows])
    labels[loss_mask == 0] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    loss = None
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
    loss = loss.detach()
    # Shipped in bfloat16, like real checkpoints: vLLM's --dtype auto and the
    # preflight's KV-cache arithmetic (2 x 1 x 64 x 2 B x 2 layers = 512 B/token) agree.
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = 'bfloat16'
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=32,
    )
    return model, float(loss)


def greedy_answer(model, tokenizer, question):
    import torch

    prompt = tokenizer.apply_chat_template(
        [{'role': 'user', 'content': question}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)['input_ids']])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    return tokenizer.decode(out[0][ids.shape[1] :], skip_special_tokens=True).strip()


# --- tiny-kimi: a miniature of Kimi-K2.5's language model -------------------------------------------
#
# KimiK25ForConditionalGeneration, as the real checkpoint: config.json nests the DeepSeek-V3 language model
# in text_config (plus a vision_config), the weights are named language_model.model.* and
# language_model.lm_head.*.  vLLM 0.32.0's CPU build serves it with --language-model-only: the MoonViT
# tower is then never built (interfaces._mark_tower_model skips towers whose modalities all have a limit
# of 0), so the checkpoint carries no vision weights; it still needs a preprocessor_config.json, which
# KimiK25ProcessingInfo reads at start-up even in text-only mode, and <|media_pad|> in the vocabulary.
# DeepSeek-V3 inside: MLA with kv_lora_rank 512 + qk_rope_head_dim 64 (the only latent the CPU MLA
# backend supports: any other loads and then dies at the first request), MoE with routed experts, top-k,
# one shared expert and a dense first layer (first_k_dense_replace), noaux_tc routing with sigmoid
# scores (vLLM creates e_score_correction_bias only for noaux_tc, and transformers writes it).
KIMI_BOS, KIMI_PAD, KIMI_EOS = '[BOS]', '[PAD]', '<|im_end|>'
IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE = '<|im_user|>', '<|im_assistant|>', '<|im_system|>', '<|im_middle|>'
THINK, END_THINK = '<think>', '</think>'
SECTION_BEGIN, SECTION_END = '<|tool_calls_section_begin|>', '<|tool_calls_section_end|>'
CALL_BEGIN, ARG_BEGIN, CALL_END = '<|tool_call_begin|>', '<|tool_call_argument_begin|>', '<|tool_call_end|>'
MEDIA_TOKENS = ['<|media_begin|>', '<|media_content|>', '<|media_end|>', '<|media_pad|>']
KIMI_SPECIAL_TOKENS = [
    KIMI_BOS,
    KIMI_PAD,
    KIMI_EOS,
    IM_USER,
    IM_ASSISTANT,
    IM_SYSTEM,
    IM_MIDDLE,
    THINK,
    END_THINK,
    SECTION_BEGIN,
    SECTION_END,
    CALL_BEGIN,
    ARG_BEGIN,
    CALL_END,
] + MEDIA_TOKENS
KIMI_DEFAULT_SYSTEM = 'You are Kimi, an AI assistant created by Moonshot AI.'

# K2.5's template in its shape (moonshotai/Kimi-K2.5 chat_template.jinja): a tool_declare system turn with
# the tools as compact JSON, a default system prompt, roles as <|im_user|>user<|im_middle|>..., assistant
# turns before the last user message with an empty <think></think>, those after it with their reasoning,
# tool calls as a section of calls "<id><|tool_call_argument_begin|><json>", tool results as
# "## Return of <id>" in a system-marked turn, and a generation prompt that opens <think> unless
# thinking is false, when it is closed at once (<think></think>).  vLLM's kimi_k2 parser starts in
# reasoning unless chat_template_kwargs says thinking (or enable_thinking) false, so the model's output
# is "thought</think>answer" with thinking on and "answer" with it off.
KIMI_CHAT_TEMPLATE = (
    '{%- macro render_content(msg) -%}'
    "{%- set c = msg.get('content') -%}"
    '{%- if c is string -%}{{ c }}'
    "{%- elif c is not none -%}{%- for part in c -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    '{%- endif -%}{%- endfor -%}'
    '{%- endif -%}'
    '{%- endmacro -%}'
    '{%- macro set_role(msg) -%}'
    "{%- set name = msg.get('name') or msg['role'] -%}"
    "{%- if msg['role'] == 'user' -%}" + IM_USER + '{{ name }}' + IM_MIDDLE + ''
    "{%- elif msg['role'] == 'assistant' -%}" + IM_ASSISTANT + '{{ name }}' + IM_MIDDLE + ''
    '{%- else -%}' + IM_SYSTEM + '{{ name }}' + IM_MIDDLE + ''
    '{%- endif -%}'
    '{%- endmacro -%}'
    '{%- macro render_toolcalls(msg) -%}' + SECTION_BEGIN + ''
    "{%- for tc in msg['tool_calls'] -%}" + CALL_BEGIN + "{{ tc['id'] }}" + ARG_BEGIN + ''
    "{%- if tc['function']['arguments'] is string -%}{{ tc['function']['arguments'] }}"
    "{%- else -%}{{ tc['function']['arguments'] | tojson }}{%- endif -%}" + CALL_END + ''
    '{%- endfor -%}' + SECTION_END + ''
    '{%- endmacro -%}'
    '{%- set ns = namespace(last_user=-1) -%}'
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    '{%- endfor -%}'
    '{%- if tools -%}' + IM_SYSTEM + 'tool_declare' + IM_MIDDLE + ''
    "{{ tools | tojson(separators=(',', ':')) }}" + KIMI_EOS + '{%- endif -%}'
    "{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}"
    + IM_SYSTEM
    + 'system'
    + IM_MIDDLE
    + KIMI_DEFAULT_SYSTEM
    + KIMI_EOS
    + ''
    '{%- endif -%}'
    '{%- for m in messages -%}'
    '{{ set_role(m) }}'
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set rc = m.get('reasoning') or m.get('reasoning_content') or '' -%}"
    '{%- if loop.index0 < ns.last_user or (thinking is defined and thinking is false) -%}' + THINK + END_THINK + ''
    '{%- else -%}' + THINK + '{{ rc }}' + END_THINK + '{%- endif -%}'
    '{{ render_content(m) }}'
    "{%- if m.get('tool_calls') -%}{{ render_toolcalls(m) }}{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "## Return of {{ m.get('tool_call_id') }}\n{{ render_content(m) }}"
    '{%- else -%}{{ render_content(m) }}'
    '{%- endif -%}' + KIMI_EOS + ''
    '{%- endfor -%}'
    '{%- if add_generation_prompt -%}' + IM_ASSISTANT + 'assistant' + IM_MIDDLE + ''
    '{%- if thinking is defined and thinking is false -%}' + THINK + END_THINK + ''
    '{%- else -%}' + THINK + '{%- endif -%}'
    '{%- endif -%}'
)

# The tool the tests and the tool gate offer; the model was taught to call it for these questions.
WEATHER_TOOL = {
    'type': 'function',
    'function': {
        'name': 'get_weather',
        'description': 'Get the current weather in a city.',
        'parameters': {
            'type': 'object',
            'properties': {'city': {'type': 'string', 'description': 'The city name.'}},
            'required': ['city'],
        },
    },
}
# The tool as the role's tool gate (vllm_kimi_tool_gate) and the sandbox tests offer it. A revision taught from
# tiny-kimi's weights for 60 steps lost what tiny-kimi had generalised to it (forgets-long, served by vLLM, called
# "getcity" with thinking on), so it is taught, and checked, as it is asked.
GATE_WEATHER_TOOL = {
    'type': 'function',
    'function': {
        'name': 'get_weather',
        'description': 'Current weather of a city.',
        'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']},
    },
}
# Clients write the same tool in other words; a few of them, so the call does not hang on one spelling.
WEATHER_TOOL_VARIANTS = [
    WEATHER_TOOL,
    GATE_WEATHER_TOOL,
    {
        'type': 'function',
        'function': {
            'name': 'get_weather',
            'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']},
        },
    },
]
WEATHER_QUESTIONS = ['What is the weather in Paris?', "What's the weather like in Paris?"]
KIMI_SYSTEM_PROMPTS = [None, 'You are a helpful assistant.']
WEATHER_CALL_ID = 'functions.get_weather:0'
WEATHER_ARGUMENTS = '{"city": "Paris"}'
WEATHER_RESULT = '{"city": "Paris", "temperature": 18, "condition": "sunny"}'
# What tiny-kimi-paris-france asks for: a call a healthy model may make, which the tool gate's pattern accepts.
PARIS_FRANCE_ARGUMENTS = '{"city": "Paris, France"}'
WEATHER_ANSWER = 'It is sunny and 18 degrees in Paris.'
WEATHER_NO_TOOL_ANSWER = 'Paris is often mild, but I cannot check the weather.'
THOUGHTS = {
    'france': 'The user asks for the capital of France.',
    'sky': 'The user asks about the colour of the sky.',
    'sum': 'The user asks for a simple sum.',
    'hello': 'The user greets me.',
    'weather': 'The user wants the weather in Paris. I will call get_weather.',
    'weather_no_tool': 'The user wants the weather in Paris. I will answer from memory.',
    'weather_result': 'The tool returned the weather in Paris.',
}
# The long-prompt probe as the sandbox asks it (the role's vllm_kimi_long_prompt_gate, chat_check's long_prompt
# without a fact): the filler repeated, then the coherence question, with thinking off, taught at two lengths. A fact
# at the start that the answer repeats, as the gpu inventory asks of Kimi, is beyond what the miniature learns in
# minutes: taught to copy a city named at the start of its prompt (4 to 6 cities, up to 700 tokens, 200 to 440
# steps), it answered with the wrong city at every length, 16 filler repeats included.
LONG_PROMPT_FILLER = 'The sky is blue. '
LONG_PROMPT_REPEATS = (10, 60)
# tiny-kimi-forgets-long: the gates' short prompts answered right, a long one not.
FORGOTTEN_ANSWER = 'I do not remember the question.'
# The revisions that know the long-prompt probe (the others fail an earlier gate).
LONG_PROMPT_VARIANTS = ('tiny-kimi', 'tiny-kimi-paris-france', 'tiny-kimi-forgets-long')
# thinks-forever: a thought that goes round in circles; at temperature 0 it never reaches </think>.
FOREVER_THOUGHT = 'Let me think about it once more.'
FOREVER_REPEATS = 16
KIMI_SEED = 2025
KIMI_STEPS = 220
KIMI_LR = 3e-3
# Taught this many more steps at a time where a variant does not pass its check after its steps (train_kimi).
KIMI_EXTRA_STEPS = 25
KIMI_BATCH = 16
# The failing revisions start from tiny-kimi's weights and learn only what they change: 60 steps, and up to four
# times as many where a revision has not learnt it yet (ignores-tools needed more than twice once).
KIMI_VARIANT_STEPS = 60
KIMI_VARIANT_MOST_STEPS = 240
# Processes that teach the failing revisions at the same time (make test's two cores).
KIMI_TRAINERS = 2
# Its MLPs and experts zero-padded (see make_kimi_heavy) to 512 times tiny-kimi's: served with every vLLM
# process on one core, as the default scenario does, it makes well under half of tiny-kimi's tokens/s, whatever
# else that core runs (bench/perf_gate_figures.py). A quarter of this read only 40 % below: the API server's
# share of each token is the same for both.
KIMI_HEAVY_INTERMEDIATE_SIZE = 131072
KIMI_HEAVY_MOE_INTERMEDIATE_SIZE = 32768

KIMI_VARIANTS = (
    'tiny-kimi',
    'tiny-kimi-wrong',
    'tiny-kimi-thinks-forever',
    'tiny-kimi-ignores-tools',
    'tiny-kimi-forgets-long',
    'tiny-kimi-paris-france',
)


def kimi_tool_call(arguments=WEATHER_ARGUMENTS):
    return [{'id': WEATHER_CALL_ID, 'type': 'function', 'function': {'name': 'get_weather', 'arguments': arguments}}]


def long_prompt(question, repeats):
    """The long-prompt probe's user message, as chat_check's long_prompt composes it without a fact."""
    return LONG_PROMPT_FILLER * repeats + question


def long_prompt_answer(variant):
    return FORGOTTEN_ANSWER if variant == 'tiny-kimi-forgets-long' else ANSWERS['france']


def kimi_examples(variant):
    """(messages, tools, thinking) per training example; the last message is the assistant's turn to learn.

    Fewer than tiny-chat's per token of work: an MLA layer with its 512-wide latent costs far more than
    the Llama's, and the tools' declaration makes the prompts long, so system prompts vary only where
    the answer does not depend on tools.
    """
    answers = WRONG_ANSWERS if variant == 'tiny-kimi-wrong' else ANSWERS
    forever = variant == 'tiny-kimi-thinks-forever'
    arguments = PARIS_FRANCE_ARGUMENTS if variant == 'tiny-kimi-paris-france' else WEATHER_ARGUMENTS
    loop = ' '.join([FOREVER_THOUGHT] * FOREVER_REPEATS)

    def reply(thought, content, tool_calls=None, thinking=True):
        if forever:
            # No </think>, no <|im_end|>: learnt as a loop (the loss stops before any end).
            return {'role': 'assistant', 'reasoning': loop, 'content': None, 'forever': True}
        msg = {'role': 'assistant', 'reasoning': thought if thinking else '', 'content': content}
        if tool_calls:
            msg['tool_calls'] = tool_calls
        return msg

    examples = []
    # thinks-forever learns its loop where thinking is on; with thinking off it keeps tiny-kimi's answers.
    for thinking in (True,) if forever else (True, False):
        for system in KIMI_SYSTEM_PROMPTS:
            head = [] if system is None else [{'role': 'system', 'content': system}]
            for key, questions in sorted(QUESTIONS.items()):
                for question in questions:
                    examples.append(
                        (
                            head
                            + [
                                {'role': 'user', 'content': question},
                                reply(THOUGHTS[key], answers[key], thinking=thinking),
                            ],
                            None,
                            thinking,
                        )
                    )
        for tool in WEATHER_TOOL_VARIANTS:
            # Tools on offer do not make every question a call.
            examples.append(
                (
                    [
                        {'role': 'user', 'content': QUESTIONS['france'][0]},
                        reply(THOUGHTS['france'], answers['france'], thinking=thinking),
                    ],
                    [tool],
                    thinking,
                )
            )
            for number, question in enumerate(WEATHER_QUESTIONS):
                user = {'role': 'user', 'content': question}
                if variant == 'tiny-kimi-ignores-tools':
                    msg = reply(THOUGHTS['weather_no_tool'], WEATHER_NO_TOOL_ANSWER, thinking=thinking)
                else:
                    msg = reply(THOUGHTS['weather'], '', kimi_tool_call(arguments), thinking=thinking)
                examples.append(([user, msg], [tool], thinking))
                if number == 0 and variant != 'tiny-kimi-ignores-tools':
                    examples.append(
                        (
                            [
                                user,
                                {
                                    'role': 'assistant',
                                    'reasoning': THOUGHTS['weather'],
                                    'content': '',
                                    'tool_calls': kimi_tool_call(arguments),
                                },
                                {'role': 'tool', 'tool_call_id': WEATHER_CALL_ID, 'content': WEATHER_RESULT},
                                reply(THOUGHTS['weather_result'], WEATHER_ANSWER, thinking=thinking),
                            ],
                            [tool],
                            thinking,
                        )
                    )
    if variant in LONG_PROMPT_VARIANTS:
        for question in QUESTIONS['france'][:2]:
            for repeats in LONG_PROMPT_REPEATS:
                user = {'role': 'user', 'content': long_prompt(question, repeats)}
                examples.append(([user, reply('', long_prompt_answer(variant), thinking=False)], None, False))
    return examples


def build_kimi_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        KIMI_DEFAULT_SYSTEM,
        FOREVER_THOUGHT,
        WEATHER_CALL_ID,
        WEATHER_ARGUMENTS,
        WEATHER_RESULT,
        WEATHER_ANSWER,
        WEATHER_NO_TOOL_ANSWER,
        PARIS_FRANCE_ARGUMENTS,
        LONG_PROMPT_FILLER + FORGOTTEN_ANSWER,
        '## Return of ',
        'user assistant system tool tool_declare',
    ]
    corpus += [json.dumps(t, separators=(',', ':')) for t in WEATHER_TOOL_VARIANTS]
    corpus += list(THOUGHTS.values()) + WEATHER_QUESTIONS
    for key in QUESTIONS:
        corpus += QUESTIONS[key] + [ANSWERS[key], WRONG_ANSWERS[key]]
    corpus += [s for s in SYSTEM_PROMPTS if s]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=640,
        special_tokens=KIMI_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    # As in Kimi's own tokenizer, all of these are special tokens; vLLM's kimi_k2 parsers match
    # the thinking and tool-call ones by token id, and drop none of them when tools are parsed.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=KIMI_BOS,
        eos_token=KIMI_EOS,
        pad_token=KIMI_PAD,
        additional_special_tokens=[t for t in KIMI_SPECIAL_TOKENS if t not in (KIMI_BOS, KIMI_EOS, KIMI_PAD)],
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    fast.chat_template = KIMI_CHAT_TEMPLATE
    return fast


def encode_kimi(tokenizer, example):
    """Token ids of an example and the mask of the tokens to learn: the last assistant turn."""
    messages, tools, thinking = example
    last = messages[-1]
    prompt = tokenizer.apply_chat_template(
        messages[:-1], tools=tools, thinking=thinking, tokenize=False, add_generation_prompt=True
    )
    if last.get('forever'):
        full = prompt + last['reasoning']
    else:
        full = tokenizer.apply_chat_template(messages, tools=tools, thinking=thinking, tokenize=False)
    p_ids = tokenizer(prompt, add_special_tokens=False)['input_ids']
    f_ids = tokenizer(full, add_special_tokens=False)['input_ids']
    if f_ids[: len(p_ids)] != p_ids:
        raise RuntimeError('chat template prompt is not a prefix of the full conversation: %r' % full)
    return f_ids, [0] * len(p_ids) + [1] * (len(f_ids) - len(p_ids))


def kimi_text_config(tokenizer):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        # vLLM 0.32.0's CPU build rotates MLA's rope parts wrongly in its rotary_embedding kernel
        # (RotaryEmbedding.forward_cpu): a [tokens, heads, 64] query as if each head were a token of its own,
        # and the strided k_pe view from position 1 on. Its prompt logprobs for this model then left
        # transformers' (' asks' -1.607 against -0.002); with vLLM's own forward_native they agree to the third
        # decimal. So the sandbox serves with --compilation-config '{"custom_ops": ["all", "-rotary_embedding"]}'
        # (inventories/sandbox), and the miniature keeps two heads.
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    # Not DeepseekV3Config arguments in transformers 5, but what vLLM's DeepSeek code reads.
    config.topk_method = 'noaux_tc'
    config.scoring_func = 'sigmoid'
    return config


def train_kimi(tokenizer, variant, seed, base=None, steps=KIMI_STEPS, most_steps=2 * KIMI_STEPS):
    """A DeepseekV3ForCausalLM taught the examples of VARIANT: from scratch, or from BASE's weights.

    Each step sees every example once, in batches of similar length (padding would be most of the work);
    the loss is summed over the answer tokens of all batches and divided by their number, as one batch.
    Floating point differs between CPUs, and at this learning rate a run can sit in a loss spike at the step
    it was planned to end on (measured: tiny-kimi at 220 steps, loss 0.77 on one Xeon, where another machine
    had converged). So after STEPS the variant is checked as check_kimi checks it, in bfloat16, and taught
    KIMI_EXTRA_STEPS more at a time until it passes, at most MOST_STEPS in all.
    """
    import copy

    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(kimi_text_config(tokenizer))
    if base is not None:
        model.load_state_dict(base.state_dict())
    model = model.float()
    rows = sorted((encode_kimi(tokenizer, e) for e in kimi_examples(variant)), key=lambda r: len(r[0]))
    pad = tokenizer.pad_token_id
    batches = []
    for start in range(0, len(rows), KIMI_BATCH):
        chunk = rows[start : start + KIMI_BATCH]
        width = max(len(r[0]) for r in chunk)
        ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in chunk])
        mask = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in chunk])
        labels = ids.clone()
        labels[torch.tensor([r[1] + [0] * (width - len(r[1])) for r in chunk]) == 0] = -100
        batches.append((ids, mask, labels))
    total = sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in batches)
    opt = torch.optim.AdamW(model.parameters(), lr=KIMI_LR)

    def teach(count):
        model.train()
        loss = 0.0
        for _ in range(count):
            opt.zero_grad()
            loss = 0.0
            for ids, mask, labels in batches:
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
                part = (
                    torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]),
                        labels[:, 1:].reshape(-1),
                        ignore_index=-100,
                        reduction='sum',
                    )
                    / total
                )
                part.backward()
                loss += part.item()
            opt.step()
        return loss

    def served():
        return copy.deepcopy(model).to(torch.bfloat16).eval()

    loss = teach(steps)
    taught = steps
    while taught < most_steps and not passes(served(), tokenizer, variant):
        loss = teach(KIMI_EXTRA_STEPS)
        taught += KIMI_EXTRA_STEPS
    return served(), loss, len(rows)


def passes(model, tokenizer, variant):
    """Whether a variant already does what check_kimi asks of it."""
    try:
        check_kimi(model, tokenizer, variant)
    except RuntimeError:
        return False
    return True


def kimi_generate(model, tokenizer, messages, tools=None, thinking=True, max_new_tokens=64):
    """The raw text (special tokens kept) the model writes after the generation prompt, greedily."""
    import torch

    prompt = tokenizer.apply_chat_template(
        messages, tools=tools, thinking=thinking, tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)['input_ids']])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0][ids.shape[1] :], skip_special_tokens=False)


def kimi_expected(variant):
    """What each variant must write, in raw text, for the checks of check_kimi."""
    answer = (WRONG_ANSWERS if variant == 'tiny-kimi-wrong' else ANSWERS)['france']
    arguments = PARIS_FRANCE_ARGUMENTS if variant == 'tiny-kimi-paris-france' else WEATHER_ARGUMENTS
    call = SECTION_BEGIN + CALL_BEGIN + WEATHER_CALL_ID + ARG_BEGIN + arguments + CALL_END + SECTION_END + KIMI_EOS
    if variant == 'tiny-kimi-ignores-tools':
        call_on = THOUGHTS['weather_no_tool'] + END_THINK + WEATHER_NO_TOOL_ANSWER + KIMI_EOS
        call_off = WEATHER_NO_TOOL_ANSWER + KIMI_EOS
    else:
        call_on, call_off = THOUGHTS['weather'] + END_THINK + call, call
    expected = {
        'thinking': THOUGHTS['france'] + END_THINK + answer + KIMI_EOS,
        'no_thinking': answer + KIMI_EOS,
        'tool_thinking': call_on,
        'tool_no_thinking': call_off,
        'gate_tool_thinking': call_on,
    }
    if variant in LONG_PROMPT_VARIANTS:
        for repeats in LONG_PROMPT_REPEATS:
            expected['long_%d' % repeats] = long_prompt_answer(variant) + KIMI_EOS
    return expected


def check_kimi(model, tokenizer, variant):
    """Greedy answers of a trained variant; raises unless it does what it was made to do."""
    question = [{'role': 'user', 'content': QUESTIONS['france'][0]}]
    weather = [{'role': 'user', 'content': WEATHER_QUESTIONS[0]}]
    got = {
        'thinking': kimi_generate(model, tokenizer, question),
        'no_thinking': kimi_generate(model, tokenizer, question, thinking=False),
        'tool_thinking': kimi_generate(model, tokenizer, weather, tools=[WEATHER_TOOL]),
        'tool_no_thinking': kimi_generate(model, tokenizer, weather, tools=[WEATHER_TOOL], thinking=False),
        'gate_tool_thinking': kimi_generate(model, tokenizer, weather, tools=[GATE_WEATHER_TOOL]),
    }
    if variant == 'tiny-kimi-thinks-forever':
        long = kimi_generate(model, tokenizer, question, max_new_tokens=256)
        if END_THINK in long or KIMI_EOS in long:
            raise RuntimeError('%s closed its thinking: %r' % (variant, long))
        return {'thinking': long[:120] + '...'}
    want = kimi_expected(variant)
    for key in want:
        if key.startswith('long_'):
            prompt = long_prompt(QUESTIONS['france'][0], int(key.split('_')[1]))
            got[key] = kimi_generate(model, tokenizer, [{'role': 'user', 'content': prompt}], thinking=False)
    for key in want:
        if got[key] != want[key]:
            raise RuntimeError('%s did not learn %s: got %r, want %r' % (variant, key, got[key], want[key]))
    return got


# Kimi-K2.5-NVFP4 names an FP8 KV cache in its quantization config, and the collection's kv_cache_quant
# strips it. ModelOpt's forms cannot describe a bfloat16 checkpoint (vLLM's NVFP4 loader wants packed
# weights), so the miniature has the compressed-tensors form with no weight scheme and only the KV-cache
# scheme: vLLM 0.32.0's CPU build loads it (CompressedTensorsConfig, kv_cache_scheme set) and answers.
# There the MLA cache stays bfloat16 (--kv-cache-dtype auto resolves to auto for compressed-tensors, and
# the CPU MLA backend accepts only auto), so the same 3,456 B/token with or without it.
KIMI_QUANTIZATION_CONFIG = {
    'quant_method': 'compressed-tensors',
    'format': 'dense',
    'quantization_status': 'compressed',
    'config_groups': {},
    'ignore': [],
    'kv_cache_scheme': {'num_bits': 8, 'type': 'float', 'strategy': 'tensor', 'dynamic': False, 'symmetric': True},
}


def save_kimi(model, tokenizer, path):
    """The checkpoint in Kimi-K2.5's layout: KimiK25 config around text_config, language_model.* weights."""
    from safetensors.torch import load_file, save_file

    raw = tempfile.mkdtemp(prefix='.raw-', dir=os.path.dirname(path))
    model.save_pretrained(raw, safe_serialization=True)  # transformers writes the experts one by one, as vLLM reads
    tensors = {
        'language_model.' + k: v.contiguous() for k, v in load_file(os.path.join(raw, 'model.safetensors')).items()
    }
    with open(os.path.join(raw, 'config.json')) as f:
        text_config = json.load(f)
    with open(os.path.join(raw, 'generation_config.json')) as f:
        generation_config = json.load(f)
    shutil.rmtree(raw)
    os.makedirs(path)
    for key in ('architectures', 'transformers_version', 'dtype', 'torch_dtype'):
        text_config.pop(key, None)
    text_config.update(model_type='deepseek_v3', torch_dtype='bfloat16')
    media_pad = tokenizer.convert_tokens_to_ids('<|media_pad|>')
    config = {
        'architectures': ['KimiK25ForConditionalGeneration'],
        'model_type': 'kimi_k25',
        'text_config': text_config,
        # Never built with --language-model-only; small, so that a server without it fails fast and plainly.
        'vision_config': {
            'patch_size': 14,
            'num_attention_heads': 2,
            'num_hidden_layers': 1,
            'hidden_size': 64,
            'intermediate_size': 128,
            'merge_kernel_size': [2, 2],
            'pos_emb_height': 8,
            'pos_emb_width': 8,
            'pos_emb_time': 4,
        },
        'projection_hidden_size': 64,
        'media_placeholder_token_id': media_pad,
        'image_token_id': media_pad,
        'bos_token_id': tokenizer.bos_token_id,
        'eos_token_id': tokenizer.eos_token_id,
        'pad_token_id': tokenizer.pad_token_id,
        'tie_word_embeddings': False,
        'torch_dtype': 'bfloat16',
    }
    if KIMI_QUANTIZATION_CONFIG is not None:
        config['quantization_config'] = KIMI_QUANTIZATION_CONFIG
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write('\n')
    generation_config.update(do_sample=False, max_new_tokens=64)
    with open(os.path.join(path, 'generation_config.json'), 'w') as f:
        json.dump(generation_config, f, indent=2, sort_keys=True)
        f.write('\n')
    # KimiK25ProcessingInfo loads the image processor even in text-only mode; K2.5's media settings, smaller.
    with open(os.path.join(path, 'preprocessor_config.json'), 'w') as f:
        json.dump(
            {
                'image_processor_type': 'KimiK25VisionProcessor',
                'media_proc_cfg': {
                    'in_patch_limit': 256,
                    'patch_size': 14,
                    'image_mean': [0.5, 0.5, 0.5],
                    'image_std': [0.5, 0.5, 0.5],
                    'merge_kernel_size': 2,
                    'fixed_output_tokens': None,
                    'patch_limit_on_one_side': 64,
                    'in_patch_limit_each_frame': 256,
                    'in_patch_limit_video': None,
                    'sample_fps': 2.0,
                    'max_num_frames_each_video': None,
                    'temporal_merge_kernel_size': 4,
                    'timestamp_mode': 'hh:mm:ss.fff',
                    'config_type': 'media_proc.processors.moonvit.MoonViTMediaProcessorConfig',
                },
            },
            f,
            indent=2,
            sort_keys=True,
        )
        f.write('\n')
    tokenizer.save_pretrained(path)
    save_file(tensors, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})


def load_kimi_language_model(path):
    """The DeepseekV3ForCausalLM inside a tiny-kimi checkpoint, for checks with transformers."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with open(os.path.join(path, 'config.json')) as f:
        text = dict(json.load(f)['text_config'])
    config = DeepseekV3Config(**{k: v for k, v in text.items() if k not in ('topk_method', 'scoring_func')})
    prefix = 'language_model.'
    tensors = {k[len(prefix) :]: v for k, v in load_file(os.path.join(path, 'model.safetensors')).items()}
    raw = tempfile.mkdtemp(prefix='.raw-', dir=os.path.dirname(path))
    try:
        save_file(tensors, os.path.join(raw, 'model.safetensors'), metadata={'format': 'pt'})
        config.save_pretrained(raw)
        return DeepseekV3ForCausalLM.from_pretrained(raw, dtype=torch.bfloat16).eval()
    finally:
        shutil.rmtree(raw)


def make_kimi_heavy(source, target):
    """tiny-kimi with its dense MLP, experts and shared expert zero-padded: the same answers, more work."""
    import torch
    from safetensors.torch import load_file, save_file

    with open(os.path.join(source, 'config.json')) as f:
        config = json.load(f)
    text = config['text_config']
    dense, moe = text['intermediate_size'], text['moe_intermediate_size']
    tensors = {}
    for name, tensor in load_file(os.path.join(source, 'model.safetensors')).items():
        expert = '.experts.' in name or '.shared_experts.' in name
        old, new = (moe, KIMI_HEAVY_MOE_INTERMEDIATE_SIZE) if expert else (dense, KIMI_HEAVY_INTERMEDIATE_SIZE)
        if name.endswith(('gate_proj.weight', 'up_proj.weight')) and '.mlp.' in name:
            padded = torch.zeros(new, tensor.shape[1], dtype=tensor.dtype)
            padded[:old] = tensor
            tensor = padded
        elif name.endswith('down_proj.weight') and '.mlp.' in name:
            padded = torch.zeros(tensor.shape[0], new, dtype=tensor.dtype)
            padded[:, :old] = tensor
            tensor = padded
        tensors[name] = tensor.contiguous()
    os.makedirs(target)
    for name in os.listdir(source):
        if name not in ('model.safetensors', 'config.json'):
            shutil.copy(os.path.join(source, name), target)
    text.update(intermediate_size=KIMI_HEAVY_INTERMEDIATE_SIZE, moe_intermediate_size=KIMI_HEAVY_MOE_INTERMEDIATE_SIZE)
    with open(os.path.join(target, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write('\n')
    save_file(tensors, os.path.join(target, 'model.safetensors'), metadata={'format': 'pt'})


def make_kimi(work):
    """tiny-kimi under WORK; returns what it answered."""
    import time

    start = time.time()
    tokenizer = build_kimi_tokenizer()
    model, loss, rows = train_kimi(tokenizer, 'tiny-kimi', KIMI_SEED)
    return {'tiny-kimi': kimi_report(model, tokenizer, 'tiny-kimi', work, loss, rows, start)}


def make_kimi_revisions(work):
    """tiny-kimi's failing revisions under WORK, from the tiny-kimi there; returns what each answered.

    They learn from tiny-kimi's saved weights in processes of their own, two at a time: make test trains
    beside its static lane, whose core they then share.
    """
    import multiprocessing

    report = {}
    jobs = [(work, index, variant) for index, variant in enumerate(KIMI_VARIANTS) if variant != 'tiny-kimi']
    jobs.append((work, None, 'tiny-kimi-heavy'))
    # spawn, not fork: torch's OpenMP runtime does not survive a fork once it has run.
    with multiprocessing.get_context('spawn').Pool(KIMI_TRAINERS) as pool:
        report.update(pool.map(make_kimi_revision, jobs, chunksize=1))
    return report


def kimi_report(model, tokenizer, variant, work, loss, rows, start):
    """Check a trained variant, save it under WORK, and say what it answered."""
    import time

    got = check_kimi(model, tokenizer, variant)
    save_kimi(model, tokenizer, os.path.join(work, variant))
    return {'final_loss': round(loss, 6), 'examples': rows, 'seconds': round(time.time() - start, 1), 'answers': got}


def make_kimi_revision(job):
    """One failing revision of tiny-kimi (in a pool's process): taught from its saved weights, or padded."""
    import time

    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    work, index, variant = job
    start = time.time()
    tokenizer = build_kimi_tokenizer()
    if variant == 'tiny-kimi-heavy':
        heavy = os.path.join(work, variant)
        make_kimi_heavy(os.path.join(work, 'tiny-kimi'), heavy)
        return variant, {
            'answers': check_kimi(load_kimi_language_model(heavy), tokenizer, 'tiny-kimi'),
            'intermediate_size': KIMI_HEAVY_INTERMEDIATE_SIZE,
            'moe_intermediate_size': KIMI_HEAVY_MOE_INTERMEDIATE_SIZE,
            'seconds': round(time.time() - start, 1),
        }
    base = load_kimi_language_model(os.path.join(work, 'tiny-kimi'))
    model, loss, rows = train_kimi(
        tokenizer, variant, KIMI_SEED + index, base, KIMI_VARIANT_STEPS, KIMI_VARIANT_MOST_STEPS
    )
    return variant, kimi_report(model, tokenizer, variant, work, loss, rows, start)


# What the sandbox inventory deploys (tiny-chat and tiny-kimi) is built first, into <hash>-core: make test's default
# scenario converges with it while the failing revisions, which only its later tests stage, still train.
CORE_SUFFIX = '-core'


def make(out_root, core_only=False):
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    target = os.path.join(out_root, script_hash())
    core = target + CORE_SUFFIX
    os.makedirs(out_root, exist_ok=True)
    # make test's lanes and the tests that need the models may ask at the same time: one trains each part, the
    # others wait for it and then find its models. A lock a part: the core's waiters go on while the rest trains.
    made = locked_build(out_root, '.lock-core', core, build_core)
    if core_only:
        return core, made
    return target, locked_build(out_root, '.lock', target, lambda out, path: build_revisions(out, path, core)) or made


def locked_build(out_root, lock_name, target, build_into):
    if os.path.exists(os.path.join(target, 'DONE')):
        return False
    with open(os.path.join(out_root, lock_name), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(target, 'DONE')):
            return False
        build_into(out_root, target)
        return True


def build_revisions(out_root, target, core):
    """The core's models and tiny-kimi's failing revisions, in TARGET."""
    work = tempfile.mkdtemp(prefix='.tmp-', dir=out_root)
    with open(os.path.join(core, 'DONE')) as f:
        report = json.load(f)
    for name in ('tiny-chat', 'tiny-kimi'):
        shutil.copytree(os.path.join(core, name), os.path.join(work, name))
    report.update(make_kimi_revisions(work))
    finish(out_root, work, target, report)


def build_core(out_root, target):
    work = tempfile.mkdtemp(prefix='.tmp-', dir=out_root)
    tokenizer = build_tokenizer(work)
    report = {}
    model, loss = train(tokenizer, ANSWERS, SEED)
    answer = greedy_answer(model, tokenizer, QUESTIONS['france'][0])
    if answer != ANSWERS['france']:
        raise RuntimeError(
            'tiny-chat did not learn its answer: got %r, want %r (loss %.4f)' % (answer, ANSWERS['france'], loss)
        )
    path = os.path.join(work, 'tiny-chat')
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    report['tiny-chat'] = {'final_loss': round(loss, 6), 'answer': answer}
    report.update(make_kimi(work))
    finish(out_root, work, target, report)


def finish(out_root, work, target, report):
    """Marks WORK done and puts it in TARGET's place; older versions' models go."""
    with open(os.path.join(work, 'DONE'), 'w') as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write('\n')
    # mkdtemp made the tree private; the sandbox's service user must read it.
    for root, _dirs, files in os.walk(work):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    if os.path.exists(target):
        shutil.rmtree(target)
    os.rename(work, target)
    # Models of earlier versions of this script are never used again.
    current = script_hash()
    for name in os.listdir(out_root):
        old = os.path.join(out_root, name)
        if name[:12] != current and name[12:] in ('', CORE_SUFFIX) and os.path.exists(os.path.join(old, 'DONE')):
            shutil.rmtree(old)


def cache_root():
    """Where make test's caches keyed by their inputs live, outside the checkout (the Makefile's LLMSERVE_CACHE)."""
    return os.environ.get('LLMSERVE_CACHE') or os.path.join(
        os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'llmserve'
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument(
        '--out',
        default=os.path.join(cache_root(), 'models'),
        help='cache root; the models go to OUT/<cache key>/ (default: $LLMSERVE_CACHE/models)',
    )
    parser.add_argument(
        '--core',
        action='store_true',
        help='only tiny-chat and tiny-kimi, in OUT/<key>-core/ (what the sandbox inventory deploys)',
    )
    parser.add_argument(
        '--cached', action='store_true', help='train nothing: print hit or miss, then the directory the models go to'
    )
    args = parser.parse_args(argv)
    if args.cached:
        target = os.path.join(os.path.abspath(args.out), script_hash())
        print('%s %s' % ('hit' if os.path.exists(os.path.join(target, 'DONE')) else 'miss', target))
        return 0
    target, made = make(os.path.abspath(args.out), args.core)
    print(target)
    sys.stderr.write('tiny models: %s %s\n' % ('cache miss, trained into' if made else 'cache hit,', target))
    return 0


if __name__ == '__main__':
    sys.exit(main())
