"""The model families beyond Llama 2 / Qwen2 / Gemma 3: Llama 3.x rope scaling (and linear,
dynamic, YaRN), Qwen3's q/k norms, Mistral's sliding window, Phi-3's fused projections with partial
rotary and LongRoPE, Gemma 2's softcapping and alternating windows.

Each is a tiny randomly initialised transformers model (tests/tiny_models.py): fp32 logits must
equal transformers' within 1e-4 over 300 positions (past every tiny window and original context),
whole and incrementally; the feature that sets a family apart must matter (the same weights
without it differ by > 1e-2: the parity check has the power to see it missing); speculative
greedy output equals plain greedy with the suffix proposer, a draft model and a draft head; and
what specdec cannot compute exactly is refused at load time with one line naming it.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import transformers

from specdec.core.engine import generate
from specdec.proposers import DraftModelProposer, HeadProposer, SuffixProposer
from specdec.runtime.config import ModelConfig, Rope, UnsupportedModel
from specdec.runtime.head import DraftHead, HeadConfig
from specdec.runtime.model import Transformer
from specdec.verify.sampling import SamplingParams
from specdec.training.head_net import HeadNet
from tiny_models import FAMILIES, ORIGINAL_CONTEXT, WINDOW, hf_tiny, ours, perturbed

SEQ = 300
TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0)


def _ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (batch, SEQ), generator=torch.Generator().manual_seed(11))


def _reference(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_equal_transformers_whole_and_incrementally(family):
    hf = hf_tiny(family)
    ids = _ids()
    ref = _reference(hf, ids)
    model = ours(hf)
    whole = model(ids, model.new_cache(2, SEQ))
    assert (whole - ref).abs().max() <= TOL
    cache = model.new_cache(2, SEQ)  # prefill, a verification-sized block, single steps, a long block
    cuts = [0, 150, 155, 156, 157, 158, SEQ]
    parts = torch.cat([model(ids[:, a:b], cache) for a, b in zip(cuts, cuts[1:])], 1)
    assert (parts - ref).abs().max() <= TOL


def _without_feature(family: str, cfg: ModelConfig) -> ModelConfig:
    """``cfg`` less the one thing that sets ``family`` apart."""
    plain_rope = Rope(cfg.rope.theta, cfg.rope.dim, max_positions=cfg.rope.max_positions)
    if family in ("llama3", "llama_linear", "qwen2_yarn", "phi3"):
        return dataclasses.replace(cfg, rope=plain_rope)
    if family == "qwen3":
        return dataclasses.replace(cfg, qk_norm=False)
    if family == "mistral":
        return dataclasses.replace(cfg, sliding_window=None, layer_is_sliding=(False,) * cfg.num_layers)
    if family == "gemma2":
        return dataclasses.replace(cfg, attn_logit_softcapping=None)
    raise ValueError(family)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama_dynamic"])
def test_each_family_feature_changes_the_logits(family):
    """Negative control of the parity test: without its feature the model is measurably wrong."""
    hf = hf_tiny(family)
    ids = _ids(1)
    ref = _reference(hf, ids)
    model = Transformer(_without_feature(family, ours(hf).cfg), hf.state_dict())
    assert (model(ids, model.new_cache(1, SEQ)) - ref).abs().max() > 1e-2


def test_the_features_are_read_from_the_configs():
    cfg = {f: ours(hf_tiny(f)).cfg for f in FAMILIES}
    assert cfg["llama3"].rope.kind == "llama3" and cfg["llama3"].rope.param("original_max_position_embeddings") == ORIGINAL_CONTEXT
    assert cfg["llama_dynamic"].rope.kind == "dynamic" and cfg["llama_dynamic"].max_position_embeddings == 512
    assert cfg["qwen3"].qk_norm and not cfg["qwen3"].plain_llama
    assert cfg["mistral"].sliding_window == WINDOW and all(cfg["mistral"].layer_is_sliding)
    assert cfg["mistral"].plain_llama  # the fused kernels run it, with the window's visibility
    assert cfg["gemma2"].layer_is_sliding == (True, False, True) and cfg["gemma2"].final_logit_softcapping == 3.0
    assert cfg["phi3"].fused_qkv and cfg["phi3"].rope.dim == 8 and cfg["phi3"].rope.kind == "longrope"
    assert cfg["phi3"].max_position_embeddings == 512  # LongRoPE: its short factors, up to the original context


def test_longrope_positions_past_the_original_context_are_refused():
    model = ours(hf_tiny("phi3"))
    with pytest.raises(ValueError, match="context length 512"):
        model(torch.zeros(1, 513, dtype=torch.long), model.new_cache(1, 520))


@pytest.fixture(scope="module", params=FAMILIES)
def family_pair(request):
    family = request.param
    target = ours(hf_tiny(family), "int8")
    draft = ours(perturbed(hf_tiny(family), 0.002, seed=1), "int8")  # close enough to be accepted
    return family, target, draft


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9] * 4, [1, 2, 3] * 12 + [4], list(range(10, 50))]
NEW = 60  # positions reach ~100, past the tiny windows of 32


def _identical(target, proposer, k=4):
    plain = generate(target, PROMPTS, GREEDY, NEW)
    spec = generate(target, PROMPTS, GREEDY, NEW, proposer=proposer, k=k)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    return spec[0].batch_metrics.acceptance


def test_speculative_greedy_equals_plain_with_suffix_and_draft_model(family_pair):
    _, target, draft = family_pair
    _identical(target, SuffixProposer(min_match=1))
    acceptance = _identical(target, DraftModelProposer(draft, SEQ))
    assert acceptance.accepted > 0  # the near-copy draft is accepted: verification really commits drafts


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma2"])  # heads refuse Gemma targets
def test_speculative_greedy_equals_plain_with_a_draft_head(family):
    target, fp32 = ours(hf_tiny(family), "int8"), ours(hf_tiny(family))
    cfg = HeadConfig.for_target(fp32.cfg, intermediate_size=96)
    ids = torch.arange(97)
    net = HeadNet(cfg, ids, fp32.embed, fp32.final_norm, fp32.lm_head.weight[ids].clone(), 0)
    head = DraftHead(net.cfg, net.export(), net.vocab_ids, target, net.lm_rows, "int8")
    _identical(target, HeadProposer(head, SEQ), k=3)


def _hf_config(**fields):
    base = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                vocab_size=97, rms_norm_eps=1e-6, max_position_embeddings=512, hidden_act="silu", rope_parameters={})
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="mamba"), "unsupported architecture 'mamba'"),
    (dict(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}), "rope scaling 'proportional' is not supported"),
    (dict(hidden_act="gelu"), "activation 'gelu' is not supported"),
    (dict(mlp_bias=True), "MLP biases"),
    (dict(layer_types=["sliding_attention", "chunked_attention"], sliding_window=8), "layer types"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
     "needs original_max_position_embeddings"),
])
def test_what_cannot_be_computed_exactly_is_refused(fields, message):
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_hf(_hf_config(**fields))


def test_qwen2_sliding_layers_follow_use_sliding_window():
    """Qwen2 configs carry a sliding_window that only applies with use_sliding_window (and then to
    the layers from max_window_layers on): read from the config's layer_types, not guessed."""
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=16)
    off = ModelConfig.from_hf(transformers.Qwen2Config(**common))
    on = ModelConfig.from_hf(transformers.Qwen2Config(**common, use_sliding_window=True, max_window_layers=2))
    assert off.sliding_window is None and not any(off.layer_is_sliding)
    assert on.sliding_window == 16 and on.layer_is_sliding == (False, False, True, True)


def _gguf(path, arch: str, fields: dict, tensors: tuple[str, ...] = ()):
    """A GGUF file with ``fields`` (``{key: value}``; ints, floats, strings) and tiny tensors."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        add = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}[type(value)]
        add(key, value)
    for name in tensors or ("token_embd.weight",):
        writer.add_tensor(name, np.ones((4, 16) if name == "token_embd.weight" else (8,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SHAPE = {"attention.head_count": 4, "embedding_length": 64}


@pytest.mark.parametrize("arch, fields, tensors, message", [
    ("falcon", {}, (), "GGUF architecture 'falcon' is not supported"),
    ("qwen2", {"qwen2.rope.scaling.type": "dynamic"}, (), "rope scaling 'dynamic'"),
    ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
               "llama.rope.scaling.original_context_length": 64, "llama.rope.scaling.attn_factor": 1.2}, (),
     "YaRN attention factor of 1.2"),
    ("llama", {"llama.rope.dimension_count": 8}, (), "partial rotary dimension \\(8 of 16\\)"),
    ("gemma2", {"gemma2.attn_logit_softcapping": 30.0, "gemma2.attention.key_length": 256}, (), "attn_logit_softcapping"),
    ("gemma2", {"gemma2.attention.key_length": 128}, (), "query scale"),
    ("gemma3", {"gemma3.attention.key_length": 128}, (), "query scale"),
])
def test_a_gguf_whose_conversion_would_drop_something_is_refused_before_the_cache(
        tmp_path, monkeypatch, arch, fields, tensors, message):
    """What a GGUF file says that specdec cannot convert exactly (rope scaling is read: see
    tests/test_gguf_families.py) is refused, and nothing is written."""
    from conftest import fresh_home
    from specdec.cli import main
    from specdec.models import loading

    home = fresh_home(tmp_path, monkeypatch)
    shape = {f"{arch}.{key}": value for key, value in SHAPE.items()}
    path = _gguf(tmp_path / "m.gguf", arch, {**shape, **fields}, tensors)
    with pytest.raises(UnsupportedModel, match=message):
        loading.load(str(path), "float32")
    assert main(["generate", "--target", str(path), "--prompt", "hi", "--proposer", "none"]) == 2
    assert not (home / "converted").exists() and not (home / "quantized").exists()


@pytest.mark.parametrize("dtype, expected, lowered", [
    ("q4k", "q4k: Q4_K kept exactly; Q6_K, Q8_0 re-quantized to 4 bits (q4k)", True),
    ("int8", "int8: Q4_K, Q6_K, Q8_0 re-quantized to 8 bits (int8)", True),
    ("float32", "float32: the stored weights exactly (Q4_K, Q6_K, Q8_0)", False),
])
def test_the_precision_of_a_gguf_file_at_each_dtype(dtype, expected, lowered):
    from collections import Counter

    from specdec.models import gguf_meta

    assert gguf_meta.precision(Counter({"Q4_K": 169, "Q6_K": 29, "Q8_0": 1}), dtype) == (expected, lowered)
    assert gguf_meta.precision(Counter({"Q4_K": 4}), "q4k") == ("q4k: Q4_K kept exactly", False)
