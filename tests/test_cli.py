"""The CLI with bad input: every case is one readable line on stderr and a non-zero exit status
(or correct behaviour), never a traceback, never an option silently ignored."""

from __future__ import annotations

import io
import json
import math

import pytest

from specdec.cli import main
from tiny_models import hf_tiny, save_hf_dir

MISSING = "/nonexistent/model"  # options must be rejected before any model is looked for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_hf_dir(hf_tiny("qwen2"), tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(autouse=True)
def _every_test_in_an_empty_home(home):
    """Every test here runs in an empty ``SPECDEC_HOME`` (conftest's ``home``)."""


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors (a usage line, then the error)
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "inf"], "temperature must be in"),
        (["--temperature", "nan"], "temperature must be in"),
        (["--temperature", "1e300"], "temperature must be in"),
        (["--temperature", "-1"], "temperature must be in"),
        (["--top-p", "0"], "top_p must be in"),
        (["--top-k", "-3"], "top_k must be"),
        (["--min-p", "2"], "min_p must be in"),
        (["--system", "be brief"], "--system has no effect without --chat"),
        (["--draft-dtype", "float32"], "--draft-dtype has no effect without --draft"),
        (["--exit-layer", "2"], "--exit-layer has no effect without --proposer early-exit"),
        (["--proposer", "draft", "--draft", "small", "--exit-layer", "2"], "--exit-layer has no effect"),
        (["--ngram-min", "3"], "--ngram-min/--ngram-max has no effect"),
        (["--proposer", "ngram", "--ngram-min", "5", "--ngram-max", "3"], "1 <= min <= max (--ngram-min, --ngram-max), got (5, 3)"),
        (["--proposer", "ngram", "--k", "3", "--k-max", "4"], "--k-max has no effect without --k auto"),
        (["--prompt", "\udcff\udcfe"], "not valid UTF-8"),
        (["--proposer", "none", "--k", "3"], "--k has no effect without a proposer"),
        (["--proposer", "ngram", "--head", "h.safetensors"], "--head has no effect"),
        (["--proposer", "head"], "'head' needs a draft head: this target has none shipped"),
        (["--proposer", "hybrid-tree"], "'hybrid-tree' needs a draft head"),
        (["--proposer", "suffix", "--ngram-max", "3"], "--ngram-min/--ngram-max has no effect"),
        (["--proposer", "draft"], "'draft' needs a draft model (--draft NAME_OR_PATH"),
        (["--proposer", "ngram", "--ngram-max", "1"], "got (2, 1)"),
        (["--draft", "small", "--proposer", "ngram"], "--draft has no effect with --proposer ngram"),
    ],
)
def test_bad_options_fail_in_one_line_before_loading(capsys, extra, message):
    code, out, err = _run(capsys, "generate", "--target", MISSING, "--prompt", "hi", *extra)
    assert code == 2 and out == ""
    assert message in _one_line(err)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--replicas", "2"], "--replicas: replicas need Ray Serve, which is not installed: pip install -e '.[ray]'"),
        (["--threads-per-replica", "2"], "--threads-per-replica has no effect without --replicas"),
        (["--ray-address", "10.0.0.1:6379"], "--ray-address has no effect without --replicas"),
        (["--prefix-cache-mb", "-1"], "must be >= 0"),
    ],
)
def test_serve_options_fail_in_one_line_before_loading(capsys, monkeypatch, extra, message):
    """Without Ray installed (hidden here), `serve --replicas` says how to get it."""
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code, out, err = _run(capsys, "serve", "--target", MISSING, *extra)
    assert code == 2 and out == ""
    assert message in (err if extra[0] == "--prefix-cache-mb" else _one_line(err))  # (argparse: usage, then the error)


@pytest.mark.parametrize(
    "extra",
    [["--seed", str(2**64 - 1)], ["--seed", "-1"], ["--max-new-tokens", "0"], ["--k", "-1"], ["--k", "x"],
     ["--exit-layer", "0"], ["--k-max", "0"]],
)
def test_out_of_range_numbers_are_argparse_errors(capsys, extra):
    code, out, err = _run(capsys, "generate", "--target", MISSING, "--prompt", "hi", *extra)
    assert code == 2 and out == ""
    assert "error: argument" in err


def test_stdin_closed_or_not_utf8(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", None)
    code, _, err = _run(capsys, "generate", "--target", MISSING, "--prompt", "-")
    assert code == 2 and "standard input is closed" in _one_line(err)

    class Stdin:
        closed = False
        buffer = io.BytesIO(b"def f(\xff\xfe):")

    monkeypatch.setattr("sys.stdin", Stdin())
    code, _, err = _run(capsys, "generate", "--target", MISSING, "--prompt", "-")
    assert code == 2 and "not valid UTF-8" in _one_line(err)


def test_missing_model_and_damaged_gguf(capsys, tmp_path):
    code, _, err = _run(capsys, "generate", "--target", MISSING, "--prompt", "hi")
    assert code == 2 and "neither a known model" in _one_line(err)
    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 7)  # a header cut short
    code, out, err = _run(capsys, "generate", "--target", str(gguf), "--prompt", "hi")
    assert code == 1 and out == ""
    assert "damaged or not a supported GGUF" in err.splitlines()[-1]


def test_suffix_trees_from_the_command_line(capsys, model_dir):
    base = ["generate", "--target", model_dir, "--prompt", "abcabcabcabc", "--max-new-tokens", "12", "--json"]
    code, plain, err = _run(capsys, *base)
    assert code == 0, err
    code, spec, err = _run(capsys, *base, "--proposer", "suffix", "--k", "6")
    assert code == 0, err
    assert json.loads(spec)["token_ids"] == json.loads(plain)["token_ids"]
    assert json.loads(spec)["metrics"]["acceptance"]["scored_draft_tokens"] > 0


def test_tiny_temperature_is_greedy_and_json_is_valid(capsys, model_dir):
    base = ["generate", "--target", model_dir, "--prompt", "abc de", "--max-new-tokens", "8", "--json"]
    code, out, _ = _run(capsys, *base)
    greedy = json.loads(out)
    code2, out2, _ = _run(capsys, *base, "--temperature", "1e-38")
    tiny = json.loads(out2)
    assert code == code2 == 0
    assert tiny["token_ids"] == greedy["token_ids"]
    assert math.isfinite(tiny["config"]["temperature"])


def test_the_precision_a_model_runs_at_is_named_and_lowering_is_never_silent(capsys, model_dir):
    """The tiny model's weights are F32: float32 runs them as stored and says nothing; int8 says in
    one stderr line what it lowers; --json names the precision either way."""
    base = ["generate", "--target", model_dir, "--prompt", "abc", "--max-new-tokens", "2", "--json", "--dtype"]
    code, out, err = _run(capsys, *base, "float32")
    assert code == 0 and json.loads(out)["config"]["precision"] == {"target": "float32: the stored weights exactly (F32)",
                                                                      "draft": None}
    assert "re-quantized" not in err
    code, out, err = _run(capsys, *base, "int8")
    assert code == 0 and json.loads(out)["config"]["precision"]["target"] == "int8: F32 re-quantized to 8 bits (int8)"
    assert [line for line in err.splitlines() if "re-quantized" in line] == [
        "specdec: model runs at int8: F32 re-quantized to 8 bits (int8) (--dtype float32 multiplies the stored weights)"]


def test_ctrl_c_keeps_the_streamed_text_and_exits_130(capsys, model_dir, monkeypatch):
    from specdec.api import TextGenerator

    def interrupted(self, prompts, params, max_new_tokens, **kw):
        kw["on_text"](0, "partial answer")
        raise KeyboardInterrupt

    monkeypatch.setattr(TextGenerator, "generate", interrupted)
    code, out, err = _run(capsys, "generate", "--target", model_dir, "--prompt", "abc")
    assert code == 130
    assert out == "partial answer"
    assert err.splitlines()[-1] == "specdec generate: interrupted"


def test_stdout_closed_early_is_one_line(capsys, model_dir, monkeypatch, tmp_path):
    sink = open(tmp_path / "sink", "w")

    class ClosedPipe(io.TextIOBase):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return sink.fileno()

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    try:
        code = main(["generate", "--target", model_dir, "--prompt", "abc", "--max-new-tokens", "4"])
    finally:
        sink.close()
    err = capsys.readouterr().err
    assert code == 141
    assert "Traceback" not in err and "broken pipe" in err.splitlines()[-1]


def test_an_unexpected_error_is_one_line_with_a_hint(capsys, model_dir, monkeypatch):
    from specdec.api import TextGenerator

    def broken(self, *a, **kw):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(TextGenerator, "generate", broken)
    code, _, err = _run(capsys, "generate", "--target", model_dir, "--prompt", "abc", "--json")
    assert code == 1
    assert "internal error: ZeroDivisionError: boom" in err.splitlines()[-1]


def _tiny_chat_model(tmp_path, template: str):
    """A tiny llama saved as a model directory whose tokenizer has the chat ``template``."""
    model = save_hf_dir(hf_tiny("llama"), tmp_path / "model")
    tok_config = model / "tokenizer_config.json"
    config = json.loads(tok_config.read_text())
    config["chat_template"] = template
    tok_config.write_text(json.dumps(config))
    return model


def test_train_head_self_distills_on_sharegpt_user_turns(capsys, tmp_path, monkeypatch):
    """`train-head --corpus sharegpt --extract-only --answer-batches N`: the target answers N
    batches of ShareGPT user turns (training split) and, apart, two batches of held-out ones; the
    shards hold prompt + answer ids with a feature per position, and a rerun redoes nothing."""
    from safetensors.torch import load_file

    from specdec.training import run as training_run, sharegpt

    model = _tiny_chat_model(tmp_path, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}assistant:{% endif %}")
    records = [{"id": f"c{i}_0", "conversations": [
        {"from": "human", "value": f"please tell me about {i}" + (" and the way it is used in the town where we live"
                                                                    if i % 2 else "")},
        {"from": "gpt", "value": f"it is {i} and more"}]} for i in range(2500)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(records))
    monkeypatch.setattr(sharegpt, "data_path", lambda: data)
    monkeypatch.setattr(training_run, "ANSWER_TOKENS", 6)
    work = tmp_path / "work"
    args = ["train-head", "--target", str(model), "--dtype", "float32", "--out", str(tmp_path / "h.safetensors"),
            "--corpus", "sharegpt", "--tokens", "2000", "--workdir", str(work), "--extract-only", "--answer-batches", "2"]
    code, stdout, err = _run(capsys, *args)
    assert code == 0, err
    assert "own answers: batch 2/2 in own-answers-sharegpt " in err
    assert "own answers: batch 2/2 in own-answers-sharegpt-held-out" in err
    for name in ("own-answers-sharegpt", "own-answers-sharegpt-held-out"):
        shards = sorted((work / name).glob("features-*.safetensors"))
        assert len(shards) == 2
        for shard in shards:
            d = load_file(str(shard))
            lengths = (d["tokens"] >= 0).sum(1)
            assert d["tokens"].shape[0] == 16 and d["hidden"].shape[:2] == d["tokens"].shape
            assert bool((lengths > 4).all()) and bool(d["hidden"][0, : int(lengths[0])].abs().sum(-1).gt(0).all())
    code, _, err = _run(capsys, *args)
    assert code == 0 and "own answers" not in err

    # --answers: batch ranges per request source; only the batches named are made, and batch b is the
    # same 16 requests whichever range names it (python-docs requests from --corpus-root's chunks)
    sources = tmp_path / "src"
    sources.mkdir()
    for i in range(80):
        (sources / f"m{i}.py").write_text("".join(f'def f{i}_{j}(x):\n    """Return x plus {j}, the usual way."""\n'
                                                  f"    return x + {j}\n\n" for j in range(30)))
    before = (work / "own-answers-sharegpt" / "features-00001.safetensors").read_bytes()
    mixed = args[:-2] + ["--corpus-root", str(sources), "--answers", "sharegpt:1-4", "python-docs:1-2",
                         "sharegpt-translate:0-1"]
    code, _, err = _run(capsys, *mixed)
    assert code == 0, err
    assert sorted(p.name for p in (work / "own-answers-sharegpt").iterdir()) == [
        f"features-0000{b}.safetensors" for b in range(4)]
    assert (work / "own-answers-sharegpt" / "features-00001.safetensors").read_bytes() == before  # not redone
    assert [p.name for p in (work / "own-answers").iterdir()] == ["features-00001.safetensors"]
    assert [p.name for p in (work / "own-answers-sharegpt-translate").iterdir()] == ["features-00000.safetensors"]
    for bad, says in ((["--answers", "sharegpt:2-2"], "first < end"), (["--answers", "web:0-2"], "must be one of"),
                      (["--answers", "sharegpt:1", "--answer-batches", "2"], "give one"),
                      (["--corpus-root", str(sources), "--answer-batches", "1"], "does not apply")):
        code, _, err = _run(capsys, *args[:-2], *bad)
        assert code == 2 and says in err, err


def test_train_head_hours_runs_the_recipe_stage_after_stage_and_resumes(capsys, tmp_path, monkeypatch):
    """`train-head --hours H`: stage 1 on text sized from the measured prefill rate, then rounds of
    own answers (each replaying the earlier ones, from the previous head) while the next one's
    estimate fits; one line per stage with its held-out acceptance; --out gets the last head and
    its card; a rerun redoes nothing. (Here the estimate lets exactly one round fit.)"""
    from specdec.training import plan, run as training_run

    model = _tiny_chat_model(tmp_path, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}assistant:{% endif %}")  # (answers only: a header)
    sources = tmp_path / "src"
    sources.mkdir()
    for i in range(40):
        (sources / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(40)))
    monkeypatch.setattr(training_run, "ANSWER_TOKENS", 6)
    monkeypatch.setattr(plan, "ROUND", {"python-docs": (("python-docs", 1),)})
    monkeypatch.setattr(plan, "prefill_rate", lambda model, seq_len: 1.0)  # the smallest stage 1: 16 windows
    monkeypatch.setattr(plan, "_estimate", lambda stages, recipe: 0.0 if recipe.finetune_steps <= plan.STEPS_PER_BATCH
                        else 1e9)
    out = tmp_path / "head.safetensors"
    args = ["train-head", "--target", str(model), "--dtype", "float32", "--out", str(out), "--hours", "1",
            "--corpus-root", str(sources), "--workdir", str(tmp_path / "work"), "--batch", "4",
            "--vocab-size", "64", "--intermediate-size", "64", "--passes", "2"]
    code, stdout, err = _run(capsys, *args)
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("train-head: ")]
    assert len(lines) == 2 and "stage 1 (text) -> plan-00" in lines[0] and "round 1 (own answers) -> plan-01" in lines[1]
    assert all("held-out first-position acceptance 0." in line for line in lines)
    log = json.loads((tmp_path / "work" / "plan" / "plan.json").read_text())
    assert log["stage1"]["tokens"] == 16 * 512 and log["stage1"]["steps"] == 2 * 16 // 4
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["finetune"]["answers"] == ["python-docs:0-1"] and card["init_head"]["file"] == "plan-00.safetensors"
    assert "; then specdec train-head" in card["command"] and out.with_suffix(".md").exists()
    code, _, err = _run(capsys, *args)  # rerun: both stages are done, nothing runs again
    assert code == 0 and "train head" not in err and "extract features" not in err, err
    assert json.loads((tmp_path / "work" / "plan" / "plan.json").read_text()) == log
    code, _, err = _run(capsys, *args, "--answer-batches", "2", "--finetune-steps", "4")
    assert code == 2 and "does not take --answers/--answer-batches, --finetune-steps" in err, err


def test_the_plan_estimates_a_round_from_the_last_stage():
    from specdec.training import plan
    from specdec.training.recipe import HeadRecipe

    base = HeadRecipe(source="python-docs")
    first = {"head": "plan-00.safetensors", "seconds": 600.0, "steps": 100}
    second = {"head": "plan-01.safetensors", "seconds": 900.0, "steps": plan.STEPS_PER_BATCH * 8}
    round2 = plan._round(base, 2, None)
    assert [str(a) for a in round2.answers] == ["python-docs:0-16"] and round2.finetune_steps == plan.STEPS_PER_BATCH * 16
    assert round2.train.label_top_k == 32 and round2.train.chain_share == 0.25
    assert plan._estimate([first], plan._round(base, 1, None)) == 600.0  # after stage 1: its time
    assert plan._estimate([first, second], round2) == 1800.0  # twice the steps: twice the time


def test_train_head_then_generate_with_it(capsys, tmp_path):
    """`specdec train-head` end to end on a tiny model and a tiny corpus (resumable stages), then
    `generate --head` with the result: the same tokens as plain decoding (greedy)."""
    model = _tiny_chat_model(tmp_path, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    sources = tmp_path / "src"
    sources.mkdir()
    for i in range(40):
        body = "".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(40))
        (sources / f"m{i}.py").write_text(body)
    out = tmp_path / "head.safetensors"
    args = ["train-head", "--target", str(model), "--dtype", "float32", "--out", str(out), "--tokens", "20000",
            "--steps", "4", "--batch", "2", "--vocab-size", "64", "--intermediate-size", "64", "--passes", "2",
            "--corpus-root", str(sources), "--workdir", str(tmp_path / "work"), "--answer-batches", "1",
            "--finetune-steps", "2"]
    code, stdout, err = _run(capsys, *args)
    assert code == 0, err
    # the newest stage's figures: stage 2's, before and after (not an earlier stage's)
    assert "wrote" in stdout and "held-out own answers, acceptance per draft position" in stdout
    assert " before, " in stdout and " after; " in stdout
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["corpus"]["sequences"] >= 16 and len(card["held_out"]["greedy"]) == 2
    assert card["finetune"]["own_answer_sequences"] >= 1 and "--answers python-docs:0-1 --finetune-steps 2" in card["command"]
    assert out.with_suffix(".md").read_text().startswith("# Draft head")
    code, stdout, err = _run(capsys, *args)  # everything is there: nothing is redone
    assert code == 0 and "extract features" not in err

    # stage 2 again, from the head just made (no stage 1): the card keeps both records and commands
    card = json.loads(out.with_suffix(".json").read_text())
    out2 = tmp_path / "head2.safetensors"
    # in another runtime dtype of the same target: a continuation, which the card records
    again = ["train-head", "--target", str(model), "--dtype", "bfloat16", "--out", str(out2), "--tokens", "20000",
             "--corpus-root", str(sources), "--workdir", str(tmp_path / "work2"), "--init-head", str(out),
             "--answers", "python-docs:0-2", "--finetune-steps", "2", "--new-vocab"]
    code, _, err = _run(capsys, *again[:-5], "--answers", "python-docs:9-10", "--finetune-steps", "2")
    assert code == 2 and "fewer than batch 9 needs" in err, err  # the requests ran out: said, not an empty stage
    code, stdout, err = _run(capsys, *again)
    assert code == 0, err
    assert "extract features" not in err and "train head" in err
    card2 = json.loads(out2.with_suffix(".json").read_text())
    assert card2["held_out"] == card["held_out"]
    assert card2["finetune_earlier"]["own_answer_tokens"] == card["finetune"]["own_answer_tokens"]
    assert card2["init_head"]["sha256"] == card["sha256"]
    assert card2["init_head"]["target_dtype"] == "float32" and card2["target_dtype"] == "bfloat16"
    assert card2["command"].startswith(card["command"] + "; then specdec train-head")
    assert card2["finetune"]["own_answer_sequences"] >= 2 and card2["finetune"]["corpus_mixed_in"] == 0
    assert card2["finetune"]["answers"] == ["python-docs:0-2"] and "--answers python-docs:0-2" in card2["command"]
    from specdec.training.train import precision

    assert card2["finetune"]["precision"] == precision()  # the stage's own path, not only the first stage's
    assert f", in {precision()}" in out2.with_suffix(".md").read_text()
    new_vocab = card2["finetune"]["new_vocab"]  # re-chosen, as many ids, evaluated before training too
    assert new_vocab["size"] == 64 and new_vocab["kept_from_before"] <= 64 and "--new-vocab" in card2["command"]
    assert len(new_vocab["before_training"]["greedy"]) == len(card2["finetune"]["held_out_own_answers_before"]["greedy"])
    from specdec.models.heads import read_head

    assert read_head(out2)[2].numel() == 64
    # the next stage of the chain in the same workdir (a replay names the answers again, reading the
    # features already there): its checkpoint is its own, named after its --out, so it neither
    # resumes nor trips over the previous stage's (which started from another head)
    assert (tmp_path / "work2" / "finetune-own-python-docs-head2.pt").exists()
    out2b = tmp_path / "head2b.safetensors"
    chained = again[:-1]
    chained[chained.index("--out") + 1], chained[chained.index("--init-head") + 1] = str(out2b), str(out2)
    code, _, err = _run(capsys, *chained)
    assert code == 0, err
    assert "own answers: batch" not in err and "train head" in err  # the answers were read, not generated again
    assert (tmp_path / "work2" / "finetune-own-python-docs-head2b.pt").exists()
    card2b = json.loads(out2b.with_suffix(".json").read_text())
    assert card2b["init_head"]["sha256"] == card2["sha256"] and card2b["finetune"]["answers"] == ["python-docs:0-2"]
    code, _, err = _run(capsys, *chained)  # rerun: resumes its own finished checkpoint, trains nothing again
    assert code == 0 and "own answers: batch" not in err, err
    # the checkpoint's log came back whole (its clock too: no step ran again)
    assert json.loads(out2b.with_suffix(".json").read_text())["finetune"]["seconds"] == card2b["finetune"]["seconds"]
    # widened from the head just made: every id it drafted is kept, the own answers' ids come next
    out_w = tmp_path / "head-wide.safetensors"
    widen = again[:-1] + ["--widen-vocab", "96"]
    widen[widen.index("--out") + 1], widen[widen.index("--init-head") + 1] = str(out_w), str(out2)
    widen[widen.index("--workdir") + 1] = str(tmp_path / "work-wide")
    for bad, says in ((["--widen-vocab", "60"], "multiple of 8"), (["--widen-vocab", "96", "--new-vocab"], "not with"),
                      (["--widen-vocab", "56"], "above the head's 64 ids")):
        code, _, err = _run(capsys, *widen[:-2], *bad)
        assert code == 2 and says in err, err
    code, _, err = _run(capsys, *widen)
    assert code == 0, err
    wide = read_head(out_w)[2]
    assert wide.numel() == 96 and set(read_head(out2)[2].tolist()) <= set(wide.tolist())
    card_w = json.loads(out_w.with_suffix(".json").read_text())
    assert card_w["finetune"]["new_vocab"]["widened_from"] == 64 and "--widen-vocab 96" in card_w["command"]
    assert card_w["drafted_ids"] == 96 and card_w["train_config"]["vocab_size"] == 64  # the card says what the file drafts
    assert "drafted ids widened from 64 to 96" in out_w.with_suffix(".md").read_text()
    assert "output rows for 96 token ids" in out_w.with_suffix(".md").read_text()
    # stage 1 from the head just made: trained further on the corpus (top-k labels), evaluated before and after
    out3 = tmp_path / "head3.safetensors"
    code, _, err = _run(capsys, "train-head", "--target", str(model), "--dtype", "float32", "--out", str(out3),
                        "--tokens", "20000", "--corpus-root", str(sources), "--workdir", str(tmp_path / "work"),
                        "--init-head", str(out), "--steps", "3", "--batch", "2", "--passes", "2", "--label-top-k", "8",
                        "--chain-share", "0.5")
    assert code == 0, err
    card3 = json.loads(out3.with_suffix(".json").read_text())
    assert card3["train_config"]["chain_share"] == 0.5 and "feature_noise" not in card3["train_config"]
    assert card3["command"].endswith("--chain-share 0.5 --out head3.safetensors")
    assert card3["init_head"]["sha256"] == card["sha256"] and len(card3["final_losses"]) == 2
    assert (tmp_path / "work" / "finetune-python-docs-512-head3.pt").exists()  # named after its --out, too
    assert len(card3["held_out_eval"]["before"]["greedy"]) == len(card3["held_out_eval"]["after"]["greedy"]) == 2
    # a head made for another target (the same shapes, another model) is refused on both paths
    import shutil

    other = shutil.copytree(model, tmp_path / "other-model")
    for stage in (["--steps", "3"], ["--answers", "python-docs:0-1", "--finetune-steps", "2"]):
        code, _, err = _run(capsys, "train-head", "--target", str(other), "--dtype", "float32", "--out",
                            str(tmp_path / "h4.safetensors"), "--tokens", "20000", "--corpus-root", str(sources),
                            "--workdir", str(tmp_path / "work4"), "--init-head", str(out), "--label-top-k", "8", *stage)
        assert code == 2 and f"was trained for {model}, not {other}" in err, err
    code, _, err = _run(capsys, "train-head", "--target", str(model), "--out", str(out2), "--answers-only")
    assert code == 2 and "--label-top-k" in err
    for share, message in (("0", "--chain-share must be in (0, 1]"), ("1.5", "--chain-share must be in (0, 1]"),
                           ("0.5", "--chain-share needs --label-top-k")):
        code, _, err = _run(capsys, "train-head", "--target", str(model), "--out", str(out2), "--chain-share", share)
        assert code == 2 and message in err, err
    code, _, err = _run(capsys, "train-head", "--target", str(model), "--out", str(out2), "--new-vocab")
    assert code == 2 and "--new-vocab applies to stage 2" in err

    base = ["generate", "--target", str(model), "--dtype", "float32", "--prompt", "def f(x):", "--max-new-tokens", "12",
            "--json"]
    code, plain, err = _run(capsys, *base, "--proposer", "none")
    assert code == 0, err
    for proposer in ("head", "hybrid-head", "head-tree", "hybrid-tree"):
        code, spec, err = _run(capsys, *base, "--proposer", proposer, "--head", str(out), "--k", "3")
        assert code == 0, err
        assert json.loads(spec)["token_ids"] == json.loads(plain)["token_ids"]
    code, _, err = _run(capsys, "train-head", "--target", str(model), "--out", str(tmp_path / "h.bin"))
    assert code == 2 and "--out must end in .safetensors" in err


def test_the_default_proposer_is_the_hybrid_over_whichever_model_is_loaded(capsys, model_dir):
    """One place decides the default (``SpeculationConfig.resolve``): the hybrid, whose model side
    is the draft model when one is given, else the target's head; lookup alone when neither exists;
    "none" (never None) is plain decoding."""
    from specdec.speculation import SpeculationConfig

    resolve = SpeculationConfig.resolve
    assert (resolve(None, draft=True, head=True).method, resolve(None, draft=True, head=True).model_side) == ("hybrid", "draft")
    assert (resolve(None, draft=False, head=True).method, resolve(None, draft=False, head=True).model_side) == ("hybrid", "head")
    assert resolve(None, draft=False, head=False).method == "suffix"  # no model to draft with: lookup only
    assert resolve("none", draft=True, head=True).method == "none" and not resolve("none", draft=True, head=True).speculates
    assert resolve(None, draft=True, head=True, k=0).method == "none"  # k = 0: no speculation
    # From the command line: --draft with no proposer speculates (n-gram lookup on this
    # repetitive prompt) and gives plain decoding's greedy tokens.
    base = ["generate", "--target", model_dir, "--prompt", "abcabcabcabc", "--max-new-tokens", "12", "--json"]
    code, plain, err = _run(capsys, *base, "--proposer", "none")
    assert code == 0, err
    code, spec, err = _run(capsys, *base, "--draft", model_dir, "--ngram-min", "2")
    assert code == 0, err
    assert json.loads(spec)["token_ids"] == json.loads(plain)["token_ids"]
    assert json.loads(spec)["metrics"]["acceptance"]["scored_draft_tokens"] > 0


@pytest.mark.parametrize("temperature", ["1e-50", "1e-300"])
def test_a_temperature_too_small_for_fp32_is_greedy_from_the_command_line(capsys, model_dir, temperature):
    """Server hardening, defect 1: `--temperature 1e-300` failed after loading the model."""
    base = ["generate", "--target", model_dir, "--prompt", "abc de", "--max-new-tokens", "8", "--json"]
    code, out, _ = _run(capsys, *base)
    code2, out2, err = _run(capsys, *base, "--temperature", temperature)
    assert code == code2 == 0, err
    assert json.loads(out2)["token_ids"] == json.loads(out)["token_ids"]


def test_argparse_errors_are_one_line_and_a_help_hint(capsys):
    code, out, err = _run(capsys, "serve", "--port", "70000")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == ""
    assert lines == ["specdec serve: error: argument --port: must be in [0, 65535], got 70000",
                     "(see `specdec serve --help`)"]


def test_request_metrics_carry_no_all_zero_time_breakdown(capsys, model_dir):
    code, out, _ = _run(capsys, "generate", "--target", model_dir, "--prompt", "abc", "--max-new-tokens", "4", "--json")
    result = json.loads(out)
    assert code == 0 and "time_breakdown_s" not in result["request_metrics"]
    assert any(v > 0 for v in result["metrics"]["time_breakdown_s"].values())
