"""Tiny randomly initialised models, built inside the tests (no downloads)."""

from __future__ import annotations

import copy
from functools import lru_cache

import torch
import transformers

from specdec.runtime.config import ModelConfig
from specdec.runtime.model import Transformer
from specdec.verify.sampling import SamplingParams


def hf_tiny(kind: str, vocab: int = 97, seed: int = 0, layers: int = 3, hidden: int = 64):
    """A tiny Hugging Face model, built once per worker and argument set, shared by every test as
    a copy of its own (tests perturb weights in place). The global torch RNG is left as a fresh
    build leaves it, so tests that draw from it after this call see the same numbers."""
    model, rng = _build(kind, vocab, seed, layers, hidden)
    torch.set_rng_state(rng)
    return copy.deepcopy(model)


@lru_cache(maxsize=None)
def _build(kind: str, vocab: int, seed: int, layers: int, hidden: int):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**common, tie_word_embeddings=False), transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common, tie_word_embeddings=True), transformers.Qwen2ForCausalLM
    elif kind in FAMILIES:
        cfg, cls = _family_config(kind, common)
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=8,
            layer_types=(["sliding_attention"] * (layers - 1) + ["full_attention"]),
            query_pre_attn_scalar=16,
        )
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(kind)
    model = cls(cfg).eval()
    with torch.no_grad():  # larger random weights give sharper, more interesting distributions
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, torch.get_rng_state()


# Tiny models of the families issue 56 added, each exercising what sets it apart: scaled rope
# frequencies (over several hundred positions), q/k norms, fused projections with partial rotary,
# sliding windows shorter than the tests' sequences, softcapping that bites.
FAMILIES = ["llama3", "llama_linear", "llama_dynamic", "qwen2_yarn", "qwen3", "mistral", "phi3", "gemma2"]
ORIGINAL_CONTEXT = 64  # the tiny llama3/yarn models' original_max_position_embeddings: 300 positions pass it
WINDOW = 32  # the tiny sliding-window models' window


def _family_config(kind: str, common: dict):
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT}
    if kind == "llama3":
        return transformers.LlamaConfig(**common, rope_parameters=llama3), transformers.LlamaForCausalLM
    if kind == "llama_linear":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        return transformers.LlamaConfig(**common, rope_parameters=rope), transformers.LlamaForCausalLM
    if kind == "llama_dynamic":
        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
        return transformers.LlamaConfig(**common, rope_parameters=rope), transformers.LlamaForCausalLM
    if kind == "qwen2_yarn":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": ORIGINAL_CONTEXT}
        return transformers.Qwen2Config(**common, rope_parameters=rope), transformers.Qwen2ForCausalLM
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True), transformers.Qwen3ForCausalLM
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=WINDOW), transformers.MistralForCausalLM
    if kind == "phi3":  # Phi-4-mini's shape: partial rotary, LongRoPE; max 2048 positions, original 512
        dim = 8  # rotary dims of a 16-wide head at partial_rotary_factor 0.5
        short = [1.0 + 0.5 * i for i in range(dim // 2)]
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "short_factor": short,
                "long_factor": [4.0 * f for f in short], "original_max_position_embeddings": 512}
        cfg = transformers.Phi3Config(**{**common, "max_position_embeddings": 2048}, rope_parameters=rope,
                                      original_max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
        return cfg, transformers.Phi3ForCausalLM
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, attn_implementation="eager")
        return cfg, transformers.Gemma2ForCausalLM
    raise ValueError(kind)


def ours(hf_model, dtype: str = "float32", act_absmax=None) -> Transformer:
    return Transformer(ModelConfig.from_hf(hf_model.config), hf_model.state_dict(), dtype, act_absmax)


def char_tokenizer(shift: int = 0):
    """A 97-token byte-level BPE over single characters (no merges): every ASCII text encodes,
    and transformers' Qwen2/Llama tokenizer classes read it back unchanged. ``shift``: character
    i gets id (i + shift) % 97 (another tokenizer for the same text)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = (string.ascii_letters + string.digits + string.punctuation)[:95] + "ĠĊ"
    tok = Tokenizer(models.BPE({c: (i + shift) % len(chars) for i, c in enumerate(chars)}, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="!")


def merging_char_tokenizer(shift: int = 0):
    """:func:`char_tokenizer` (ids rotated by ``shift``) with its last 5 punctuation strings
    replaced by merged letter pairs: another tokenization of text, sharing 92 of the
    target's 97 strings (below specdec.text.vocab.MIN_SHARED: a text draft, not an intersection)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [("x", "q"), ("q", "z"), ("z", "x"), ("j", "q"), ("q", "j")]  # pairs the tests' prompts never hold
    chars = list((string.ascii_letters + string.digits + string.punctuation)[:90]) + [a + b for a, b in merges] + ["Ġ", "Ċ"]
    tok = Tokenizer(models.BPE({c: (i + shift) % len(chars) for i, c in enumerate(chars)}, merges, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="!")


def save_hf_dir(hf_model, directory):
    """A Hugging Face model directory (weights, config, tokenizer) as a user would have one."""
    hf_model.save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)
    return directory


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def save_chat_model_dir(hf_model, directory):
    """:func:`save_hf_dir` with a minimal chat template (for the server's chat endpoint)."""
    import json

    save_hf_dir(hf_model, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return directory


def exact_joint(target, prompt: list[int], params, vocab: int):
    """p(t1, t2, t3 | prompt) ``[V, V, V]`` by enumerating the target's processed conditionals
    (for chi-square tests of the first three generated tokens on a tiny vocabulary)."""
    import itertools

    from specdec.verify.sampling import probs_from_logits

    joint = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)

    def next_probs(prefixes):
        logits = target(torch.tensor(prefixes), target.new_cache(len(prefixes), len(prefixes[0]) + 1))[:, -1]
        return probs_from_logits(logits, params).double()

    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [a] for a in range(vocab)])
    pairs = list(itertools.product(range(vocab), repeat=2))
    p3 = next_probs([prompt + [a, b] for a, b in pairs])
    for idx, (a, b) in enumerate(pairs):
        joint[a, b] = p1[a] * p2[a, b] * p3[idx]
    return joint


# The law tests' shared set-up: a 6-token vocabulary, so that the joint law of the first three
# tokens (216 cells) is enumerated exactly and compared with 10^5 speculative samples.
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3]]
V_SMALL = 6
N_SAMPLES = 100_000
PARAMS = SamplingParams(temperature=0.7, top_k=5)  # top-k puts exact zeros into p and q
PROMPT = [1, 4, 2]


def law_joint(target) -> torch.Tensor:
    """The exact joint law ``[V_SMALL] * 3`` of the first three tokens after :data:`PROMPT`."""
    return exact_joint(target, PROMPT, PARAMS, V_SMALL)


def perturbed(hf, scale: float, seed: int):
    """``hf`` with Gaussian noise of std ``scale`` added to every parameter (a related draft)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return hf


def draft_step(proposer, states, pending, k, params=None, generator=None, tree=False):
    """One drafting step of a proposer outside an engine, as the engine runs it: ``feed`` the
    rows' ``states`` (from ``add``) the committed ids, then ``propose`` under one
    :class:`SamplingParams` for every row (greedy by default) and the draft stream ``generator``."""
    from specdec.verify.sampling import SamplingMetadata, SamplingParams

    proposer.feed(states, pending)
    params = SamplingParams(temperature=0.0) if params is None else params
    return proposer.propose(states, k, tree, SamplingMetadata([params] * len(pending), generator))


def tiny_head(target, vocab: int, seed: int):
    """An untrained draft head for ``target`` over its first ``vocab`` ids (poor guesses, but
    deterministic ones: exactness must not depend on the head's quality)."""
    from specdec.runtime.head import DraftHead, HeadConfig
    from specdec.training.head_net import HeadNet

    cfg = HeadConfig.for_target(target.cfg, intermediate_size=96)
    ids = torch.arange(vocab)
    net = HeadNet(cfg, ids, target.embed.float(), target.final_norm.float(), target.embed[ids].float().clone(), seed)
    return DraftHead(net.cfg, net.export(), net.vocab_ids, target, net.lm_rows, target.dtype_name)
