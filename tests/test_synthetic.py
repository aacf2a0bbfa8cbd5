"""Synthetic real-shape GGUF files, and what loading one in place costs.

The scale benchmark runs 7-8B shapes written by :mod:`specdec.models.synthetic`; here the same
writer makes small shapes of each architecture, which must load in place: the repack kernel's
tiles equal its torch reference byte for byte, no weight matrix of a kernel's type is ever
dequantized, the load's peak memory stays near the file's size, and a model that cannot fit is
refused in one line before anything is read.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from specdec.models import synthetic
from specdec.runtime import q4

needs_kernels = pytest.mark.skipif(not q4.available(), reason="the GGUF kernels need AVX2")

# Small shapes of the three architectures (rows a multiple of 256 inputs, as the K-quants need);
# "odd" has a q/k/v of 3 x 80 rows (not whole 16-row tiles) and 6 heads.
SMALL = {
    "llama-small": synthetic.Shape("llama", 512, 256, 512, 3, 4, 2, 64, False, 500000.0, 4096),
    "qwen2-small": synthetic.Shape("qwen2", 512, 256, 768, 3, 4, 2, 64, True, 1000000.0, 4096, bias=True),
    "qwen3-small": synthetic.Shape("qwen3", 512, 256, 512, 2, 4, 2, 64, False, 1000000.0, 4096, qk_norm=True),
}


@pytest.fixture
def small(tmp_path, monkeypatch):
    from conftest import fresh_home

    fresh_home(tmp_path, monkeypatch)
    for name, shape in SMALL.items():
        monkeypatch.setitem(synthetic.SHAPES, name, shape)
    return lambda name, mix="q4_k_m": synthetic.write(name, mix, progress=False)


def test_the_mixes_follow_llama_cpps_rules():
    t = lambda name, mix, cols=4096: synthetic.tensor_type(name, mix, 32, cols)  # noqa: E731
    assert t("blk.0.attn_v.weight", "q4_k_m") == "Q6_K"  # the first eighth of the layers get more bits
    assert t("blk.5.attn_v.weight", "q4_k_m") == "Q4_K"
    assert t("blk.6.ffn_down.weight", "q4_k_m") == "Q6_K"  # every third between
    assert t("blk.31.ffn_down.weight", "q5_k_m") == "Q6_K"  # the last eighth
    assert t("blk.5.ffn_up.weight", "q5_k_m") == "Q5_K"
    assert t("output.weight", "q4_k_m") == "Q6_K"
    assert t("blk.5.attn_q.weight", "q8_0") == "Q8_0"
    assert t("blk.5.attn_norm.weight", "q8_0") == "F32"
    assert t("blk.5.ffn_up.weight", "q4_k_m", cols=896) == "Q5_0"  # not whole superblocks: llama.cpp's fallback


def test_a_written_file_has_the_shapes_and_types_of_its_mix(small):
    from specdec.models.gguf_file import GGUFFile

    for mix in synthetic.MIXES:
        f = GGUFFile(small("llama-small", mix))
        assert f.tensors["blk.0.ffn_gate.weight"].shape == (512, 256)
        assert f.tensors["output.weight"].shape == (512, 256)
        expected = {n: synthetic.tensor_type(n, mix, 3, dims[-1]) for n, dims in synthetic.tensors(SMALL["llama-small"])}
        assert {n: t.type_name for n, t in f.tensors.items()} == expected
        assert f.field("llama.block_count") == 3


KINDS_OF_MIX = {"q4_k_m": {"q4k", "q6k"}, "q5_k_m": {"Q5_K", "q6k"}, "q8_0": {"Q8_0"}, "q4_0": {"Q4_0", "q6k"},
                "iq4_xs": {"IQ4_XS", "q6k"}}


@needs_kernels
@pytest.mark.parametrize("mix", synthetic.MIXES)
@pytest.mark.parametrize("name", list(SMALL))
def test_the_repack_kernel_equals_its_torch_reference_byte_for_byte(small, name, mix):
    """Every layer of a kernel's type in the file (llama's permuted q/k rows included), with a bias."""
    from specdec.models.gguf_file import GGUFFile
    from specdec.runtime import gguf_linear

    f = GGUFFile(small(name, mix))
    compared = set()
    for gguf_name, info in f.tensors.items():
        kind = gguf_linear.KERNELS.get(info.type_name)
        if kind is None or len(info.shape) != 2:
            continue
        hf = next(h for h in _hf_names(f) if f.gguf_name(h) == gguf_name)
        bias = torch.randn(info.shape[0])
        got = gguf_linear._packed_run(f, kind, [hf], bias)
        ref = gguf_linear.packed_run_reference(f, kind, [hf], bias)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), gguf_name
        compared.add(kind)
    assert KINDS_OF_MIX[mix] - {"q6k"} <= compared <= KINDS_OF_MIX[mix]  # q4_0's Q6_K: the output, if untied


def _hf_names(f):
    """transformers' names of the file's matrices."""
    layers = int(f.field(f"{f.arch}.block_count"))
    parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]
    return [f"model.layers.{i}.{p}.weight" for i in range(layers) for p in parts] + ["lm_head.weight", "model.embed_tokens.weight"]


@needs_kernels
@pytest.mark.parametrize("mix", synthetic.MIXES)
@pytest.mark.parametrize("name", list(SMALL))
def test_a_synthetic_file_loads_in_place_and_generates(small, name, mix, monkeypatch):
    """Loaded by default: every matrix of a kernel's type runs in its kernel, none is dequantized
    (gguf's dequantize is never called on one), and the logits are finite."""
    from gguf import GGMLQuantizationType, quants

    from specdec.core.engine import generate
    from specdec.models import loading
    from specdec.verify.sampling import SamplingParams

    from specdec.runtime.gguf_linear import KERNELS

    path = small(name, mix)
    dequantized = []
    real = quants.dequantize

    def watch(data, qtype):
        dequantized.append(GGMLQuantizationType(qtype).name)
        return real(data, qtype)

    monkeypatch.setattr(quants, "dequantize", watch)
    model = loading.load(str(path))
    assert model.model.dtype_name == "gguf"
    assert not set(dequantized) & set(KERNELS), dequantized
    with torch.inference_mode():
        out = generate(model.model, [[5, 6, 7, 8]], SamplingParams(temperature=0.0), 4)[0]
    assert len(out.token_ids) == 4


_PEAK = textwrap.dedent("""
    import json, resource, sys
    from specdec.models import loading
    from specdec.runtime import native
    native.kernel("repack"); native.kernel("q4"); native.kernel("q6k")
    loading._config_and_tokenizer(loading.metadata_for(sys.argv[1]))  # transformers imported before the baseline
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from now
    before = status("VmRSS:")
    model = loading.load(sys.argv[1])
    print(json.dumps({"before": before, "peak": status("VmHWM:"), "after": status("VmRSS:")}))
""")


@needs_kernels
def test_loading_in_place_peaks_near_the_files_size(small, monkeypatch):
    """A 74 MB Q4_K_M file (112M weights; fp32: 450 MB) grows the loading process by at most its
    size + 40 MB (measured on a Zen 4: +21 MB, the largest tensor's mapped pages beside its tiles). Power: an fp32 copy of its output matrix alone
    is 134 MB, and its file pages kept mapped beside the repacked tiles would add ~70 MB; an fp32
    copy of any smaller matrix fails the in-place test above."""
    monkeypatch.setitem(synthetic.SHAPES, "mid", synthetic.Shape("qwen2", 32768, 1024, 2816, 4, 16, 4, 64, False, 1e6, 4096, bias=True))
    path = small("mid")
    size = path.stat().st_size
    run = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, check=True)
    m = json.loads(run.stdout.strip().splitlines()[-1])
    grew = m["peak"] - m["before"]
    assert 60e6 < size < 90e6
    assert grew < size + 40e6, (grew, size, m, run.stderr)


def test_a_model_that_cannot_fit_is_refused_in_one_line_before_loading(small, monkeypatch):
    from specdec.models import loading, memory

    path = small("llama-small")
    monkeypatch.setattr(memory, "available", lambda: (80_000_000, None))
    with pytest.raises(loading.ModelLoadError) as info:
        loading.load(str(path), context=4096)
    message = str(info.value)
    assert "\n" not in message and "does not fit" in message and "0.1 GB of memory available" in message
    assert "shorter context (specdec serve --max-model-len)" in message and "damaged" not in message


def test_a_memory_error_while_loading_is_never_called_damage(small, monkeypatch):
    from specdec.models import loading

    path = small("llama-small")

    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(loading, "_load_gguf", exhausted)
    with pytest.raises(loading.ModelLoadError, match="out of memory while loading llama-small-q4_k_m.gguf .*not damaged"):
        loading.load(str(path))


@needs_kernels
def test_the_scale_benchmark_measures_a_case_and_resumes(small, tmp_path):
    """``specdec bench --scale`` on a small shape (specdec alone): a row with both loads, TPOT
    and the 1/2/3/5/9-token forwards; a rerun measures nothing again."""
    from specdec.bench import scale

    small("qwen2-small")
    out = tmp_path / "scale"
    case = str(synthetic.path_for("qwen2-small", "q4_k_m"))
    rows = scale.run_scale(out, [case], None, 512, 2, 16.0, llamacpp=False)
    (row,) = rows
    assert "error" not in row["first"] and "error" not in row["later"], row
    assert set(row["later"]["forward_ms"]) == {"1", "2", "3", "5", "9"} and row["later"]["tpot_ms"] > 0
    assert row["first"]["wall_to_first_token_s"] > 0 and row["later"]["peak_rss_gb"] > 0
    assert "| specdec |" in (out / "scale.md").read_text()
    assert scale.run_scale(out, [case], None, 512, 2, 16.0, llamacpp=False) == rows
    with pytest.raises(ValueError, match="neither SHAPE:MIX"):
        scale.case_file("no-such-shape.gguf")


@needs_kernels
def test_the_scale_benchmark_fills_the_context_when_asked(small, tmp_path):
    """``--fill``: the later process prefills a ``--context``-token prompt with the draft's cache
    filled and held, and reads its peak again (a measured figure, not the KV added as computed)."""
    from specdec.bench import scale

    case = str(small("qwen2-small"))
    (row,) = scale.run_scale(tmp_path / "scale", [case], case, 512, 2, 16.0, llamacpp=False, fill=True)
    later = row["later"]
    assert "error" not in later and later["filled_held"], row
    assert later["filled_peak_rss_gb"] >= later["peak_rss_gb"] > 0 and later["fill_s"] > 0
    assert "with 512 filled" in (tmp_path / "scale" / "scale.md").read_text()


@needs_kernels
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama.cpp is an optional extra: pip install -e '.[llamacpp]'")
def test_the_scale_benchmark_runs_llama_cpp_beside_and_interleaved(small, tmp_path, monkeypatch):
    from specdec.bench import scale

    monkeypatch.setitem(synthetic.SHAPES, "wide-vocab", synthetic.Shape("llama", 16384, 256, 512, 2, 4, 2, 64, False, 5e5, 4096))
    case = str(small("wide-vocab"))
    rows = scale.run_scale(tmp_path / "scale", [case], None, 512, 2, 16.0, llamacpp=True)
    assert [r["runtime"] for r in rows] == ["specdec", "llama.cpp", "interleaved"]
    assert all("error" not in r["later"] for r in rows), rows
    assert len(rows[2]["later"]["tpot_ms"]["llama.cpp"]) == 4
    assert "Interleaved in one process" in (tmp_path / "scale" / "scale.md").read_text()


def test_a_file_written_like_a_truncated_header_keeps_its_metadata_and_tensors(small, tmp_path):
    """write_like: only the start of a file at hand (as the registry's R1-distill part 0000): the
    copy has the header's every key (tokenizer included) and tensor (name, shape, type)."""
    from specdec.models.gguf_file import GGUFFile

    whole = small("qwen2-small", "q4_k_m")
    header = tmp_path / "part_0000"
    header.write_bytes(whole.read_bytes()[: whole.stat().st_size // 3])  # the header and some tensors
    copy = synthetic.write_like(header, tmp_path / "like.gguf", progress=False)
    a, b = GGUFFile(whole), GGUFFile(copy)
    assert {n: (t.shape, t.type_name) for n, t in a.tensors.items()} == {n: (t.shape, t.type_name) for n, t in b.tensors.items()}
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "qwen2.block_count", "general.name"):
        assert b.field(key) == a.field(key)
    assert copy.stat().st_size == whole.stat().st_size
