"""The draft head: training module == runtime head, exactness in the engine, cache rollback,
training that learns and resumes exactly, head files."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import specdec.verify.chain as verify_module
from specdec.core.engine import generate
from specdec.proposers import HybridProposer, NgramProposer
from specdec.models.heads import read_head, save_head
from specdec.proposers.head import HeadProposer, HeadTreeProposer
from specdec.proposers.suffix import SuffixProposer
from specdec.runtime.head import LAYER, DraftHead, HeadConfig
from specdec.training.head_net import HeadNet
from specdec.verify.sampling import SamplingParams, sample
from specdec.training import features
from specdec.training.train import Dataset, TrainConfig, evaluate, train, vocab_subset
from stats import ALPHA, chi_square_pvalue
from tiny_models import draft_step, exact_joint, hf_tiny, ours

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3]]
SUBSET = 64  # of the tiny vocabulary's 97 ids: some ids are never drafted


def _net(target, seed=0, vocab=SUBSET) -> HeadNet:
    cfg = HeadConfig.for_target(target.cfg, intermediate_size=96)
    ids = torch.arange(vocab) * (target.vocab_size // vocab) if vocab < target.vocab_size else torch.arange(vocab)
    rows = target.lm_head.weight  # a float32 target's output layer
    return HeadNet(cfg, ids, target.embed, target.final_norm, rows[ids].clone(), seed)


def _runtime(net: HeadNet, target, dtype: str) -> DraftHead:
    return DraftHead(net.cfg, net.export(), net.vocab_ids, target, net.lm_rows, dtype)


def _corpus(target, count: int, length: int, seed: int) -> list[list[int]]:
    """The target's own samples (T = 1): text a head can learn to predict."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.vocab_size, (3,), generator=g).tolist() for _ in range(count)]
    rows = generate(target, prompts, SamplingParams(temperature=1.0), length - 3, seed=seed)
    return [p + r.token_ids for p, r in zip(prompts, rows)]


def _dataset(target, sequences) -> Dataset:
    width = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), width), -1, dtype=torch.int32)
    hidden = torch.zeros(len(sequences), width, target.cfg.hidden_size, dtype=torch.float16)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s)
        hidden[i, : len(s)] = features.prefill_features(target, s).half()
    return Dataset([(tokens, hidden)])


@pytest.fixture(scope="module")
def fp32_target():
    return ours(hf_tiny("qwen2", seed=0), "float32")


def _sharp(seed: int):
    """A tiny llama whose output layer is scaled up: peaked distributions a head can learn."""
    hf = hf_tiny("llama", seed=seed)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    return hf


@contextlib.contextmanager
def _fp32_training():
    """Training's matmuls in fp32 even where the CPU multiplies bf16 natively (``train.BF16``, read
    at each call): for tests that compare two computations to fp32 rounding, or that need the
    same trained head on every CPU. The bf16 path has its own tests, with bf16 tolerances."""
    from specdec.training import train as train_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_module, "BF16", False)
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A float32 target, its int8 twin, and a head trained for 100 steps on the target's samples,
    in fp32 on every CPU (:func:`_fp32_training`), so the tests that read this head's drafts see
    the same head on a CPU with native bf16 as on one without."""
    fp32 = ours(_sharp(5), "float32")
    int8 = ours(_sharp(5), "int8")
    data = _dataset(fp32, _corpus(fp32, 48, 40, seed=1))
    net = _net(fp32, vocab=97)
    cfg = TrainConfig(vocab_size=97, intermediate_size=96, passes=2, steps=100, batch_sequences=8, lr=3e-3,
                      warmup=5, checkpoint_every=1000)
    with _fp32_training():
        log = train(net, data, list(range(40)), cfg, tmp_path_factory.mktemp("head") / "ckpt.pt", progress=False)
    return fp32, int8, net, data, log


def test_runtime_head_equals_training_module_for_every_draft_step(fp32_target):
    """Pass m of HeadNet at slot i == drafting with the runtime head: true pairs up to slot
    i-m+1 fed in one block, then m-1 single steps on the head's own guesses (teacher tokens)."""
    target = fp32_target
    net = _net(target, seed=1)
    head = _runtime(net, target, "float32")
    seq = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]
    hidden = features.prefill_features(target, seq)  # [L, E]
    tokens = torch.tensor([seq])
    with torch.no_grad():
        outs = net.passes(hidden.unsqueeze(0), tokens, 3)
    for m in (1, 2, 3):
        for i in range(m - 1, len(seq) - 1):
            cache = head.new_cache(1, 32)
            first = i - m + 1  # the last slot holding a true pair
            _, guess = head(hidden[: first + 1].unsqueeze(0), tokens[:, 1 : first + 2], cache)
            guess = guess[:, -1:]
            for j in range(1, m):
                _, guess = head(guess, tokens[:, first + 1 + j : first + 2 + j], cache)
            torch.testing.assert_close(guess[0, -1], outs[m - 1][0, i], atol=2e-5, rtol=1e-4)
    subset_logits = head(hidden[:4].unsqueeze(0), tokens[:, 1:5], head.new_cache(1, 8))[0]  # [1, 4, N]
    with torch.no_grad():
        expected = net.target_logits(net.passes(hidden[:5].unsqueeze(0), tokens[:, :5], 1)[0][:, :4])
    torch.testing.assert_close(subset_logits, expected, atol=1e-4, rtol=1e-4)


def test_training_loss_decreases_and_the_head_learns(trained):
    fp32, _, net, data, log = trained
    first = sum(sum(x) for x in log["loss"][:10]) / 10
    last = sum(sum(x) for x in log["loss"][-10:]) / 10
    assert last < 0.8 * first
    scores = evaluate(net, data, list(range(40, 48)), 2, fp32.lm_head.weight)
    untrained = evaluate(_net(fp32, vocab=97, seed=3), data, list(range(40, 48)), 2, fp32.lm_head.weight)
    assert scores["alpha"][0] > untrained["alpha"][0] + 0.05
    assert scores["greedy"][0] > untrained["greedy"][0]


@pytest.mark.parametrize("loss", [{}, {"label_top_k": 8, "chain_share": 0.5}])
def test_resume_reproduces_an_uninterrupted_run(fp32_target, tmp_path, loss):
    data = _dataset(fp32_target, _corpus(fp32_target, 8, 20, seed=2))
    cfg = TrainConfig(vocab_size=SUBSET, intermediate_size=96, passes=2, steps=6, batch_sequences=2, lr=3e-3,
                      warmup=2, checkpoint_every=3, **loss)
    straight = _net(fp32_target, seed=4)
    train(straight, data, list(range(8)), cfg, tmp_path / "a.pt", progress=False)
    # An interrupted run: 3 steps (checkpointed), then a fresh process resumes to 6.
    interrupted = _net(fp32_target, seed=4)
    train(interrupted, data, list(range(8)), dataclasses.replace(cfg, steps=3), tmp_path / "b.pt", progress=False)
    state = torch.load(tmp_path / "b.pt", weights_only=False)
    state["train_config"]["steps"] = 6  # the same run, which had been asked for 6 steps
    state["log"]["seconds"] = 1000.0  # a mark: a resumed run keeps its log, a run started over does not
    torch.save(state, tmp_path / "b.pt")
    resumed = _net(fp32_target, seed=4)  # built as the interrupted run was (a fresh process)
    log = train(resumed, data, list(range(8)), cfg, tmp_path / "b.pt", progress=False)
    assert log["seconds"] > 1000 and len(log["loss"]) == 6
    for name, value in straight.export().items():
        assert torch.equal(value, resumed.export()[name]), name
    with pytest.raises(ValueError, match="other settings"):
        train(_net(fp32_target, seed=4), data, list(range(8)), dataclasses.replace(cfg, lr=1.0), tmp_path / "b.pt",
              progress=False)
    # the same settings but another run's checkpoint (another starting head, or other rows): refused
    for net, ids in ((_net(fp32_target, seed=5), list(range(8))), (_net(fp32_target, seed=4), list(range(6)))):
        with pytest.raises(ValueError, match="another run's"):
            train(net, data, ids, cfg, tmp_path / "b.pt", progress=False)


def _head_proposer(net, target, capacity=96):
    return HeadProposer(_runtime(net, target, target.dtype_name), capacity)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_is_token_identical_to_plain_decoding(trained, k, batch):
    _, int8, net, _, _ = trained
    prompts = PROMPTS[:batch]
    plain = generate(int8, prompts, GREEDY, 40)
    spec = generate(int8, prompts, GREEDY, 40, proposer=_head_proposer(net, int8), k=k)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    acc = spec[0].batch_metrics.acceptance
    assert 0 < acc.accepted < acc.drafted  # both acceptance and rejection happen
    assert spec[0].batch_metrics.target_calls < plain[0].batch_metrics.target_calls


def test_hybrid_with_head_and_adaptive_k_is_token_identical(trained):
    _, int8, net, _, _ = trained
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [9, 9, 9, 9], [4, 5, 6]]
    plain = generate(int8, prompts, GREEDY, 48)
    for k in (3, "auto"):
        hybrid = HybridProposer(NgramProposer(2, 3), _head_proposer(net, int8))
        spec = generate(int8, prompts, GREEDY, 48, proposer=hybrid, k=k)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


@pytest.mark.parametrize("kind", ["head-tree", "hybrid-tree"])
def test_trained_head_trees_are_accepted_and_token_identical(trained, kind):
    """Head trees with a head that has learned something (an untrained head's candidates are
    almost never accepted, so greedy identity alone would not exercise the accept path): greedy
    output token-identical to plain decoding, drafts accepted, and the trees really branch."""
    _, int8, net, _, _ = trained
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [9, 9, 9, 9], [4, 5, 6]]
    plain = generate(int8, prompts, GREEDY, 48)
    head = _runtime(net, int8, "int8")
    for k in (6, "auto"):
        tree = HeadTreeProposer(head, 128, width=3, depth=4, min_score=0.0)
        proposer = tree if kind == "head-tree" else HybridProposer(SuffixProposer(), tree)
        spec = generate(int8, prompts, GREEDY, 48, proposer=proposer, k=k, k_max=9)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        acc = spec[0].batch_metrics.acceptance
        assert acc.accepted > 0, k
        if k == 6:  # (adaptive k may prune this head's trees down to one node: measured the cheapest here)
            assert acc.scored > acc.drafted  # more nodes scored than depth positions


def test_own_answers_features_equal_a_prefill_of_the_whole_answer(trained):
    """generate_with_features (the engine recording features, no proposer): every position's feature
    == one prefill over prompt + answer, and the answer is the target's own."""
    _, int8, _, _, _ = trained
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [9, 9, 9, 9], [4, 5, 6]]
    plain = generate(int8, prompts, GREEDY, 20)
    rows = features.generate_with_features(int8, prompts, GREEDY, 20, eos_token_ids=frozenset())
    for prompt, ref, (ids, hidden) in zip(prompts, plain, rows):
        assert ids == (prompt + ref.token_ids)[:-1] and hidden.shape == (len(ids), int8.cfg.hidden_size)
        torch.testing.assert_close(hidden, features.prefill_features(int8, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_recorded_features_are_each_committed_position_once_while_speculating(trained, kind):
    """A speculating engine that records features keeps those of exactly the kept positions, in
    order (a chain's accepted prefix; a tree's root and accepted path), whatever was rejected."""
    from specdec.core.engine import Engine, kv_capacity, steps
    from specdec.core.recorder import FeatureRecorder
    from specdec.core.rows import Request

    _, int8, net, _, _ = trained
    head = _runtime(net, int8, "int8")
    proposer = _head_proposer(net, int8) if kind == "chain" else HeadTreeProposer(head, 128, width=3, depth=4)
    engine = Engine(int8, proposer, capacity=kv_capacity(60, 6, 9), k=6)
    recorder = FeatureRecorder()
    engine.attach(recorder)
    rows = [engine.add(Request(p, GREEDY, 40)) for p in ([1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6])]
    for _ in steps(engine, rows):
        pass
    assert engine.metrics.acceptance.accepted > 0
    for row in rows:
        ids, got = row.request.prompt + row.token_ids, recorder.features(row)
        # the last token is fed only where it was an accepted draft (the row's budget ended inside a
        # block); an accepted draft past the budget is not a committed position (the tree case's)
        assert len(ids) - 1 <= got.shape[0] <= len(ids)
        torch.testing.assert_close(got, features.prefill_features(int8, ids[: got.shape[0]]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_head_cache_rollback_equals_fresh_computation(trained, params):
    """After drafting and a partial acceptance, the next proposal is bit-identical to the one of
    a head that is fed the committed text from scratch (greedy: the argmax drafts with no q;
    sampled: the drafts and every q, both proposers drawing from generators in the same state)."""
    _, int8, net, _, _ = trained
    prompt = [4, 8, 15, 16, 23, 42]
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    cache = int8.new_cache(1, 64)
    _, hidden = int8(torch.tensor([prompt]), cache, return_hidden=True)
    proposer = _head_proposer(net, int8)
    states = proposer.add([prompt], target_hidden=hidden)
    drafts = draft_step(proposer, states, [[7]], 4, params, g()).tokens[0].tolist()
    block = [7] + drafts
    _, block_hidden = int8(torch.tensor([block]), cache, return_hidden=True)
    accepted = 2
    proposer.observe(states, torch.tensor([accepted]), target_hidden=block_hidden)
    committed = drafts[:accepted] + [31]  # accepted drafts, then a replacement token
    after = draft_step(proposer, states, [committed], 3, params, g())  # the same random state as the fresh proposer's below

    text = prompt + [7] + drafts[:accepted]
    fresh_cache = int8.new_cache(1, 64)
    _, fresh_hidden = int8(torch.tensor([text]), fresh_cache, return_hidden=True)
    fresh = _head_proposer(net, int8)
    expected = draft_step(fresh, fresh.add([text], target_hidden=fresh_hidden), [[31]], 3, params, g())
    assert torch.equal(after.tokens, expected.tokens)
    if params.greedy:
        assert after.probs is None and expected.probs is None
    else:
        assert after.probs.shape == (1, 3, int8.vocab_size) and torch.equal(after.probs, expected.probs)


def test_ids_outside_the_subset_are_never_drafted(fp32_target):
    net = _net(fp32_target, vocab=SUBSET)
    proposer = _head_proposer(net, fp32_target)
    prompt = [1, 2, 3]
    _, hidden = fp32_target(torch.tensor([prompt]), fp32_target.new_cache(1, 8), return_hidden=True)
    out = draft_step(proposer, proposer.add([prompt], target_hidden=hidden), [[4]], 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    outside = torch.ones(fp32_target.vocab_size, dtype=torch.bool)
    outside[net.vocab_ids] = False
    assert torch.all(out.probs[..., outside] == 0)
    assert torch.allclose(out.probs.sum(-1), torch.ones(1, 3, dtype=out.probs.dtype))
    assert not outside[out.tokens].any()


def test_sampling_over_the_subset_draws_what_the_full_q_would(fp32_target):
    """The head samples over its id subset; with the same uniforms that picks exactly the tokens
    inverse-CDF sampling of the full-vocabulary q (zeros outside the subset) picks."""
    net = _net(fp32_target, vocab=SUBSET)
    proposer = _head_proposer(net, fp32_target)
    prompts = [[1, 2, 3], [7, 3, 9]]
    _, hidden = fp32_target(torch.tensor(prompts), fp32_target.new_cache(2, 8), return_hidden=True)
    out = draft_step(proposer, proposer.add(prompts, target_hidden=hidden), [[4], [5]], 4, SamplingParams(temperature=1.3), torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    expected = torch.stack([sample(out.probs[:, i], g) for i in range(4)], 1)  # one uniform per row per draft
    assert torch.equal(out.tokens, expected)
    assert len(set(out.tokens.flatten().tolist())) > 1  # not a degenerate draw


def test_a_head_with_unsorted_vocab_ids_is_refused(fp32_target):
    net = _net(fp32_target, vocab=SUBSET)
    with pytest.raises(ValueError, match="sorted and unique"):
        DraftHead(net.cfg, net.export(), net.vocab_ids.flip(0), fp32_target, net.lm_rows, fp32_target.dtype_name)


# Exact joint law of the first three tokens at T = 0.7 with top-k, through the engine with a head.
V_SMALL, N_SAMPLES = 6, 100_000
PARAMS = SamplingParams(temperature=0.7, top_k=5)
PROMPT = [1, 4, 2]


@pytest.fixture(scope="module")
def small():
    target = ours(hf_tiny("llama", vocab=V_SMALL, seed=3), "int8")
    fp32 = ours(hf_tiny("llama", vocab=V_SMALL, seed=3), "float32")
    net = _net(fp32, vocab=5, seed=2)  # 5 of 6 ids: one id is never drafted
    return target, DraftHead(net.cfg, net.export(), net.vocab_ids, target, net.lm_rows, "int8")


def _exact_joint(target) -> torch.Tensor:
    return exact_joint(target, PROMPT, PARAMS, V_SMALL)


def _counts(target, head, k):
    rows = generate(target, [PROMPT] * N_SAMPLES, PARAMS, 3, proposer=HeadProposer(head, 16), k=k, seed=11)
    tokens = torch.tensor([r.token_ids for r in rows])
    counts = torch.bincount((tokens[:, 0] * V_SMALL + tokens[:, 1]) * V_SMALL + tokens[:, 2], minlength=V_SMALL**3)
    return counts, rows[0].batch_metrics.acceptance.to_dict()["acceptance_rate"]


def test_first_three_tokens_follow_the_exact_target_law(small):
    """Power: 10^5 samples over <= 216 cells; the negative control below must fail (p < 1e-12)."""
    target, head = small
    counts, acceptance = _counts(target, head, 2)
    assert 0.1 < acceptance < 0.95
    assert chi_square_pvalue(counts, _exact_joint(target)) > ALPHA


def test_negative_control_without_residual_fails(small, monkeypatch):
    target, head = small
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q, tolerance=1e-6: p)
    counts, _ = _counts(target, head, 2)
    assert chi_square_pvalue(counts, _exact_joint(target)) < 1e-12


def test_head_file_round_trip_and_errors(fp32_target, tmp_path):
    net = _net(fp32_target, seed=6)
    path = tmp_path / "h.safetensors"
    save_head(path, net.cfg, net.export(), net.vocab_ids, {"note": "test"})
    cfg, state, ids, info = read_head(path)
    assert cfg == net.cfg and torch.equal(ids, net.vocab_ids) and info == {"note": "test"}
    for name, value in net.export().items():
        assert torch.equal(state[name].float(), value.half().float())
    other = ours(hf_tiny("qwen2", vocab=50, seed=0), "float32")
    with pytest.raises(ValueError, match="trained for a target with vocabulary 97"):
        DraftHead(cfg, state, ids, other, net.lm_rows, "float32")
    bad = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(bad))
    with pytest.raises(ValueError, match="not a specdec draft head"):
        read_head(bad)
    with pytest.raises(ValueError, match="Gemma"):
        HeadConfig.for_target(ours(hf_tiny("gemma3", seed=0), "float32").cfg, 96)


def _head_outputs(head: DraftHead, target, seed: int = 0):
    """The head's subset logits and guessed features for random features and tokens (2 rows of 5)."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(2, 5, target.cfg.hidden_size, generator=g)
    tokens = torch.randint(0, target.vocab_size, (2, 5), generator=g)
    return head(feats, tokens, head.new_cache(2, 16))


def test_a_q4k_head_file_computes_what_its_fp16_original_computes_at_q4k(fp32_target, tmp_path):
    """A head stored in the q4k decomposition (how the head ships) is read back as the exact values
    of that decomposition, and on the q4k and gguf runtimes, which take the stored decomposition
    as it is, it computes the fp16 file's bits; at float32 the two files differ (the control)."""
    from specdec.models.heads import _read
    from specdec.runtime import q4

    net = _net(fp32_target, seed=6)
    fp16, packed = tmp_path / "h16.safetensors", tmp_path / "h4.safetensors"
    save_head(fp16, net.cfg, net.export(), net.vocab_ids, {"note": "t"})
    save_head(packed, net.cfg, net.export(), net.vocab_ids, {"note": "t"}, weights="q4k")
    assert packed.stat().st_size < 0.45 * fp16.stat().st_size
    cfg, state, ids, info, grids = _read(packed)
    _, state16, _, _ = read_head(fp16)
    assert cfg == net.cfg and torch.equal(ids, net.vocab_ids) and info == {"note": "t"}
    for name, value in state16.items():
        if value.dim() == 2:
            assert name in grids and torch.equal(state[name], q4.dequantize_q4k(q4.quantize_q4k(value.float()), value.shape[1]))
        else:
            assert name not in grids and torch.equal(state[name], value)
    for dtype in ("q4k", "gguf"):
        ref = _head_outputs(DraftHead(cfg, state16, ids, fp32_target, net.lm_rows, dtype), fp32_target)
        got = _head_outputs(DraftHead(cfg, state, ids, fp32_target, net.lm_rows, dtype, grids), fp32_target)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), dtype
    # the comparison sees the storage: at float32 the q4k file's values are not the fp16 ones
    fp = [_head_outputs(DraftHead(cfg, st, ids, fp32_target, net.lm_rows, "float32"), fp32_target)[0]
          for st in (state16, state)]
    assert (fp[0] - fp[1]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="weights must be"):
        save_head(tmp_path / "x.safetensors", net.cfg, net.export(), net.vocab_ids, weights="int4")


def test_a_head_stored_as_an_update_of_another_is_refused(fp32_target, tmp_path):
    """The delta-chain format of earlier versions is refused with what to do, never half-read."""
    import json

    from safetensors.torch import save_file

    from specdec.models.heads import FORMAT

    net = _net(fp32_target, seed=6)
    path = tmp_path / "delta.safetensors"
    meta = {"format": FORMAT, "config": json.dumps(dataclasses.asdict(net.cfg)), "info": "{}",
            "base": json.dumps({"file": "base.safetensors", "sha256": "0" * 64})}
    save_file({"vocab_ids": net.vocab_ids.to(torch.int32)}, str(path), metadata=meta)
    with pytest.raises(ValueError, match="stored as an update of another"):
        read_head(path)


def test_the_shipped_head_is_one_q4k_file_and_its_card():
    """specdec/heads/ ships one head file (q4k, under the 20 MB a commit may add) and one card."""
    from importlib import resources
    from pathlib import Path

    from specdec.models import heads
    from specdec.models.heads import _read

    (name,) = heads.SHIPPED.values()
    path = Path(str(resources.files("specdec.heads") / name))
    shipped = sorted(p.name for p in path.parent.iterdir() if not p.name.startswith(("__", ".")))
    assert shipped == sorted([name, name.replace(".safetensors", ".md")])
    assert path.stat().st_size < 20e6
    cfg, state, ids, _, grids = _read(path)
    assert ids.numel() == 20480 and cfg.intermediate_size == 4096
    for key, w in state.items():
        assert (key in grids) == (w.dim() == 2) and torch.isfinite(w.float()).all(), key


def test_vocab_subset_ranks_by_frequency_and_keeps_end_ids():
    rows = [torch.tensor([5, 5, 5, 7, 7, 9, -1]), torch.tensor([7, 5, 2])]
    assert vocab_subset(rows, 3, {90}, 97).tolist() == [5, 7, 90]
    assert vocab_subset(rows, 6, set(), 97).tolist() == [0, 1, 2, 5, 7, 9]
    # share 1/2: the 3 most frequent (end id first), then the lowest unused ids
    assert vocab_subset(rows, 6, {90}, 97, frequent_share=0.5).tolist() == [0, 1, 2, 5, 7, 90]
    with pytest.raises(ValueError, match="frequent_share"):
        vocab_subset(rows, 6, set(), 97, frequent_share=0)


def test_top_k_loss_with_every_id_equals_the_full_soft_label_loss(fp32_target):
    """The fast loss (top-k labels, computed only at valid slots) with k = the whole subset is
    the full distillation loss: logsumexp(z) - sum p z == -sum p log softmax(z), slot for slot."""
    from specdec.training.train import pass_losses, pass_losses_top_k

    data = _dataset(fp32_target, _corpus(fp32_target, 4, 20, seed=7))
    net = _net(fp32_target, vocab=SUBSET, seed=2)
    tokens, feats, lengths = data.batch([0, 1, 2, 3])
    full = pass_losses(net, tokens, feats, lengths, 3)
    fast = pass_losses_top_k(net, tokens, feats, lengths, 3, SUBSET)
    for a, b in zip(full, fast):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # both under bf16 autocast
    # negative control: a truncated label set is a different (larger-entropy-gap) objective
    assert abs(float(pass_losses_top_k(net, tokens, feats, lengths, 3, 2)[0].detach()) - float(full[0].detach())) > 1e-3


def _reference_top_k_losses(net, tokens, feats, lengths, passes, k):
    """The top-k loss over every labelled slot, computed from :meth:`HeadNet.passes` (every pass
    at every slot): what the chain-sampled loss estimates and, at share 1, equals."""
    slots = torch.arange(tokens.shape[1] - 1)
    inside = slots.view(1, -1) + 1 < lengths.view(-1, 1)
    with torch.no_grad():
        top = torch.topk(net.target_logits(feats[:, 1:]), k, dim=-1)  # [B, L-1, k]
        probs = torch.softmax(top.values, -1)
    losses = []
    for m, out in enumerate(net.passes(feats, tokens, passes), start=1):
        z = net.target_logits(out[:, :-1])  # [B, L-1, N]
        ce = torch.logsumexp(z, -1) - (probs * z.gather(-1, top.indices)).sum(-1)
        valid = inside & (slots.view(1, -1) >= m - 1)
        losses.append(ce[valid].mean())
    return losses


def test_chains_are_the_passes_at_their_slots(fp32_target):
    """Step m of the chain from anchor a, computed with a few chains (-1: none) == pass m at slot
    a+m-1, computed with the chain from every slot, in rows of unequal lengths (padding), with
    grouped-query attention: a chain depends on
    nothing but its own steps and the prefix. (That :meth:`HeadNet.passes` is what drafting
    computes is test_runtime_head_equals_training_module_for_every_draft_step's.)"""
    target = fp32_target
    net = _net(target, seed=1)
    assert net.cfg.num_heads > net.cfg.num_kv_heads
    seqs = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 6], [4, 5, 6, 7, 8, 9, 10], [1, 2, 3]]
    width = max(map(len, seqs))
    tokens = torch.full((3, width), -1)
    hidden = torch.zeros(3, width, target.cfg.hidden_size)
    for b, seq in enumerate(seqs):
        tokens[b, : len(seq)] = torch.tensor(seq)
        hidden[b, : len(seq)] = features.prefill_features(target, seq)
    anchors = torch.tensor([[0, 3, 7, 9, 10], [1, 2, 4, -1, -1], [0, 1, -1, -1, -1]])
    with torch.no_grad():
        ref, outs = net.passes(hidden, tokens, 3), net.chains(hidden, tokens, anchors, 3)
    checked = 0
    for m in (1, 2, 3):
        for b, row in enumerate(anchors.tolist()):
            for j, a in enumerate(row):
                if a >= 0 and a + m - 1 < len(seqs[b]):
                    torch.testing.assert_close(outs[m - 1][b, j], ref[m - 1][b, a + m - 1], atol=1e-5, rtol=1e-5)
                    checked += 1
    assert checked == 28


def test_the_loss_over_every_chain_is_the_loss_over_every_slot(fp32_target):
    """chain_share = 1: the same losses and the same gradients as the top-k loss computed over
    every slot of every pass (:func:`_reference_top_k_losses`), padding included. In fp32 on every
    CPU: under bf16 autocast the two round differently (~5e-4 relative), which says nothing of
    their algebra."""
    from specdec.training.train import pass_losses_top_k

    data = _dataset(fp32_target, _corpus(fp32_target, 3, 20, seed=7) + _corpus(fp32_target, 1, 11, seed=8))
    net = _net(fp32_target, vocab=SUBSET, seed=2)
    tokens, feats, lengths = data.batch([0, 1, 2, 3])
    assert len(set(lengths.tolist())) == 2
    grads = []
    with _fp32_training():
        for losses in (_reference_top_k_losses(net, tokens, feats, lengths, 3, 8),
                       pass_losses_top_k(net, tokens, feats, lengths, 3, 8)):
            net.zero_grad(set_to_none=True)
            sum(losses).backward()
            grads.append(({n: p.grad.clone() for n, p in net.named_parameters()}, [float(x.detach()) for x in losses]))
    assert grads[0][1] == pytest.approx(grads[1][1], rel=1e-5)
    for name, g in grads[0][0].items():
        torch.testing.assert_close(grads[1][0][name], g, atol=1e-6, rtol=1e-4)


def test_sampled_chains_estimate_the_loss_over_every_slot(trained, monkeypatch):
    """chain_share < 1 draws ceil(share x n) of each row's anchors, uniformly: each pass's loss
    averages to the loss over every slot. 300 draws at share 0.25 on a trained head, whose losses
    differ from slot to slot: the mean is within 4 standard errors (~0.023 nats, 0.8% of the loss)
    of the full loss, so a bias of that size would fail it (seeded: it saw 0.9 and 0.4 standard
    errors per pass). Negative control: drawing from the first half of each row only (a biased
    sampler) fails the same check, by more than 10 standard errors (it saw ~20)."""
    import specdec.training.train as train_module

    _, _, net, data, _ = trained
    tokens, feats, lengths = data.batch([40, 41, 42, 43, 44, 45, 46, 47])
    with torch.no_grad():
        full = torch.stack(_reference_top_k_losses(net, tokens, feats, lengths, 2, 16))
        gen = torch.Generator().manual_seed(0)
        anchors = train_module._draw_anchors(torch.rand(4, 30, generator=gen) < 0.6, 0.25, gen)
        assert ((anchors[:, 1:] > anchors[:, :-1]) | (anchors[:, 1:] < 0)).all()  # increasing, distinct

        def draws():
            g = torch.Generator().manual_seed(1)
            return torch.stack([torch.stack(train_module.pass_losses_top_k(net, tokens, feats, lengths, 2, 16,
                                                                           chain_share=0.25, generator=g))
                                for _ in range(300)])  # [300, passes]

        def deviation(samples):
            return (samples.mean(0) - full).abs() / (samples.std(0) / 300 ** 0.5)  # in standard errors

        fair = draws()
        assert float(fair.std(0).min()) > 0.02  # the draws differ: the check has something to test
        assert float(deviation(fair).max()) < 4
        draw = train_module._draw_anchors

        def first_half(candidates, share, generator):
            early = candidates.clone()
            early[:, candidates.shape[1] // 2 :] = False
            return draw(early, share, generator)

        monkeypatch.setattr(train_module, "_draw_anchors", first_half)
        assert float(deviation(draws()).max()) > 10


def test_answer_mask_covers_each_answer_and_its_end_token():
    from specdec.training.train import answer_mask

    header, end = [1, 2], 7
    tokens = torch.tensor([[5, 1, 2, 9, 9, 7, 8, 1, 2, 3, 7, -1], [9] * 12])
    mask = answer_mask(tokens, header, {end})
    assert mask.int().tolist() == [[0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0], [0] * 12]
    # the last turn alone (a generated answer after a multi-turn context): padding and rows
    # without any answer stay out
    last = answer_mask(tokens, header, {end}, last_only=True)
    assert last.int().tolist() == [[0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0], [0] * 12]
    unended = torch.tensor([[1, 2, 4, 7, 1, 2, 5, 5, -1, -1]])  # the last answer ran out of tokens
    assert answer_mask(unended, header, {end}, last_only=True).int().tolist() == [[0, 0, 0, 0, 0, 0, 1, 1, 0, 0]]


def test_bf16_autocast_only_where_the_cpu_multiplies_bf16_natively():
    """Emulated bf16 (an AVX2 CPU) trained >10x slower than fp32: autocast only with AVX-512 BF16 or AMX."""
    from specdec.training.train import native_bf16

    avx2 = "flags\t\t: fpu sse2 avx avx2 fma f16c"
    assert not native_bf16(avx2)
    assert native_bf16(avx2 + " avx512f avx512_bf16")
    assert native_bf16(avx2 + " amx_bf16 amx_tile")
    assert not native_bf16(avx2 + " avx512f avx512_vnni")  # VNNI alone: int8, not bf16


def test_a_head_file_that_reads_fused_features_is_refused(fp32_target, tmp_path):
    """A head file of the removed EAGLE-3 fused features (its config names target blocks) is
    refused, not run on the last block's features it was not trained for; one recording none
    (every earlier last-block head) loads."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    net = _net(fp32_target, seed=8)
    path = tmp_path / "h.safetensors"
    save_head(path, net.cfg, net.export(), net.vocab_ids, {})
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for layers, refused in (([], False), ([0, 1], True)):
        config = json.loads(meta["config"]) | {"feature_layers": layers}
        save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta | {"config": json.dumps(config)})
        if refused:
            with pytest.raises(ValueError, match="fused features"):
                read_head(tmp_path / "old.safetensors")
        else:
            assert read_head(tmp_path / "old.safetensors")[0] == net.cfg


def test_a_shipped_card_renders_its_evaluation(tmp_path):
    """specdec/training/head_card.py's additions (issue 29, item 6): the bench's acceptance per category
    pooled over prompts (accepted / reached per position, median and pooled first position), and
    the card's Markdown shows the held-out sets, the categories and the learning curve."""
    import json
    from pathlib import Path

    from specdec.training import head_card
    from specdec.training.run import card_markdown

    def run(category, temp, accepted, reached):
        return {"method": "head", "category": category, "temperature": temp, "metrics": {"acceptance": {
            "accepted_per_position": accepted, "reached_per_position": reached}}}

    runs = [run("code", 0.0, [3, 1], [4, 3]), run("code", 0.0, [1, 0], [4, 1]), run("math", 0.0, [1, 1], [5, 1]),
            run("qa", 0.0, [0, 0], [2, 0]), run("code", 0.7, [1, 0], [2, 1]), {"method": "plain", "temperature": 0.0}]
    (tmp_path / "runs.jsonl").write_text("\n".join(json.dumps(r) for r in runs))
    table = head_card.bench_acceptance(tmp_path / "runs.jsonl")
    greedy = table["0.0"]
    assert greedy["categories"]["code"] == {"per_position": [0.5, 0.25], "calls": 8, "prompts": 2}
    assert greedy["categories"]["qa"]["per_position"] == [0.0, None]  # no call reached position 2
    assert greedy["median_first"] == 0.2 and greedy["pooled_first"] == round(5 / 15, 3)
    assert table["0.7"]["categories"]["code"]["per_position"] == [0.5, 0.0]
    # runs of different lengths (a hybrid: no drafts at all, then a longer chain) pool position by position
    runs = [run("code", 0.0, [], []), run("code", 0.0, [1, 1, 1], [2, 1, 1]), run("code", 0.0, [0], [1])]
    (tmp_path / "runs.jsonl").write_text("\n".join(json.dumps(r) for r in runs))
    assert head_card.bench_acceptance(tmp_path / "runs.jsonl")["0.0"]["categories"]["code"] == {
        "per_position": [round(1 / 3, 3), 1.0, 1.0], "calls": 3, "prompts": 3}
    runs.append(run("qa", 0.0, [], []))  # a category where nothing was drafted: in the table, not in the median
    (tmp_path / "runs.jsonl").write_text("\n".join(json.dumps(r) for r in runs))
    mixed = head_card.bench_acceptance(tmp_path / "runs.jsonl")["0.0"]
    assert mixed["categories"]["qa"] == {"per_position": [], "calls": 0, "prompts": 1}
    assert mixed["median_first"] == mixed["pooled_first"] == round(1 / 3, 3)

    root = Path(__file__).resolve().parents[1]
    card = read_head(root / "specdec" / "heads" / "qwen2.5-coder-1.5b-instruct.head.safetensors")[3]  # the shipped training record
    card |= {"bytes": 16.9e6, "sha256": "ab" * 32}
    scores = {"greedy": [0.3, 0.2], "alpha": [0.25, 0.15], "slots": 100}
    card |= {"machine": "AMD EPYC (avx2 f16c fma)", "bench_acceptance": {"command": "specdec bench", "by_temperature": table},
             "held_out_eval_sets": {"sharegpt": {"by_temperature": {"1.0": scores}}},
             "learning_curve": [{"head": "a", "chat_tokens": 0, **scores}, {"head": "b", "chat_tokens": 1000, **scores}]}
    text = card_markdown(card, "h.safetensors")
    assert "Taken on AMD EPYC (avx2 f16c fma)." in text and "**Held-out sharegpt**" in text
    assert "| 0.0 | code | 0.500 / 0.250 | 8 |" in text and "| 0.0 | qa | 0.000 / - | 2 |" in text
    assert "| 0.0 | **median (pooled)** | 0.200 (0.333) | |" in text and "| b | 1,000 | 0.300 / 0.200 |" in text
    # the drafted ids are the card's record of them (the shipped head widened them in an earlier round)
    assert "output rows for 20480 token ids" in card_markdown(card, "h.safetensors")
    assert "output rows for 96 token ids" in card_markdown(card | {"drafted_ids": 96}, "h.safetensors")
    for key in ("machine", "bench_acceptance", "held_out_eval_sets", "learning_curve"):  # a card without them
        card.pop(key)
    assert "## Evaluation" not in card_markdown(card, "h.safetensors")



def test_a_chain_cut_to_nothing_by_the_head_confidence_keeps_the_exact_law(small):
    """Here the head's first raw distribution has a top probability below 0.5 after every first
    token, so ``min_score`` 0.5 cuts every chain before its first draft: each step is a plain
    step after the head's catch-up (the test above: the same law uncut). That the cut is exact
    per row, where rows differ, is shown on :func:`specdec.verify_chain` with a stopping rule
    and its negative control (tests/test_verify_stats.py). Power: as the test above."""
    target, head = small
    rows = generate(target, [PROMPT] * N_SAMPLES, PARAMS, 3, proposer=HeadProposer(head, 16, min_score=0.5), k=2,
                    seed=11)
    assert rows[0].batch_metrics.acceptance.drafted == 0
    tokens = torch.tensor([r.token_ids for r in rows])
    counts = torch.bincount((tokens[:, 0] * V_SMALL + tokens[:, 1]) * V_SMALL + tokens[:, 2], minlength=V_SMALL**3)
    assert chi_square_pvalue(counts, _exact_joint(target)) > ALPHA


def test_greedy_chains_cut_by_the_head_confidence_are_token_identical(trained):
    _, int8, net, _, _ = trained
    plain = generate(int8, PROMPTS, GREEDY, 40)
    for min_score in (0.3, 0.9):  # cuts some chains short / every chain before its first draft
        proposer = HeadProposer(_runtime(net, int8, int8.dtype_name), 96, min_score=min_score)
        spec = generate(int8, PROMPTS, GREEDY, 40, proposer=proposer, k=4)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        acc = spec[0].batch_metrics.acceptance
        assert (0 < acc.drafted < 4 * acc.calls) if min_score == 0.3 else acc.drafted == 0
    with pytest.raises(ValueError, match="min_score"):
        HeadProposer(_runtime(net, int8, int8.dtype_name), 96, min_score=1.5)


class _RecordingCut(HeadProposer):
    """Records, per step, the confidences the chain gate read and the chain it returned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = []

    def propose(self, states, k, tree, sampling):
        self.steps.append({"k": k, "conf": []})
        proposal = super().propose(states, k, tree, sampling)
        self.steps[-1]["size"], self.steps[-1]["declined"] = proposal.size, proposal.declined
        return proposal

    def _confidence(self, subset_logits):
        conf = super()._confidence(subset_logits)
        self.steps[-1]["conf"].append(float(conf[0]))
        return conf


def test_the_chain_cut_is_the_product_rule_read_before_each_draft(trained):
    """The proposer's own cut, step by step (sampled rows, batch 1): a chain of size s had the
    product of the raw top probabilities >= min_score at positions 1..s and, if s < k, below it
    at s + 1, where drafting stopped before drawing (and the proposal declares that it
    declined position s + 1, for adaptive k). Two cuts make every chain size 0..k occur.
    That such a rule keeps the target's law (and that reading the drawn token does not) is
    tests/test_verify_stats.py's stopping-rule test and its negative control."""
    _, int8, net, _, _ = trained
    params = SamplingParams(temperature=0.7)
    sizes = set()
    for min_score in (0.1, 0.3):
        for prompt in PROMPTS:
            cut = _RecordingCut(_runtime(net, int8, int8.dtype_name), 96, min_score=min_score)
            generate(int8, [prompt], params, 30, proposer=cut, k=4, seed=5)
            for step in cut.steps:
                if step["k"] == 0:
                    continue
                products = torch.tensor(step["conf"]).cumprod(0)
                size = step["size"]
                sizes.add(size)
                assert (products[:size] >= min_score).all()
                assert len(products) == size + (size < step["k"])
                assert step["declined"] == (size < step["k"])  # what adaptive k counts as a rejection
                if size < step["k"]:
                    assert products[size] < min_score
    assert sizes == {0, 1, 2, 3, 4}, sizes


def test_the_recipe_refuses_to_widen_and_re_choose_the_ids_at_once(tmp_path):
    """The recipe (what ``train-head`` runs) refuses ``--widen-vocab`` with ``--new-vocab`` and the
    other combinations that cannot run, each in one line naming the options, before anything
    touches the target or the disk; a valid one renders the command that reproduces it."""
    from specdec.training.recipe import AnswerSlice, HeadRecipe

    head = tmp_path / "h.safetensors"
    head.write_bytes(b"")
    stage2 = {"answers": (AnswerSlice("sharegpt", 0, 2),), "finetune_steps": 4, "init_head": head}
    with pytest.raises(ValueError, match="not with --new-vocab"):
        HeadRecipe(**stage2, new_vocab=True, widen_vocab=96)
    for bad, message in (({"finetune_steps": 3}, "go together"), ({"new_vocab": True}, "--new-vocab applies to stage 2"),
                         ({"corpus_root": tmp_path / "none"}, "is not a directory"), ({"source": "web"}, "--corpus")):
        with pytest.raises(ValueError, match=message):
            HeadRecipe(**bad)
    recipe = HeadRecipe(**stage2, widen_vocab=96)
    assert recipe.stage2 and recipe.seq_len == 1024
    assert recipe.command("t", "q4k", "out.safetensors").endswith(
        "--init-head h.safetensors --answers sharegpt:0-2 --finetune-steps 4 --widen-vocab 96 --out out.safetensors")
    assert not list(tmp_path.glob("*.json"))