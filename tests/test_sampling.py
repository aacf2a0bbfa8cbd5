import pytest
import torch

from specdec.verify.sampling import MAX_TEMPERATURE, SamplingParams, greedy_one_hot, probs_from_logits, probs_per_row, sample


def test_greedy_is_one_hot_with_ties_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_temperature_matches_softmax():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    probs = probs_from_logits(logits, SamplingParams(temperature=0.7))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, -1))


def test_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]))
    top_k = probs_from_logits(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(top_k, torch.tensor([4 / 7, 3 / 7, 0, 0, 0]))
    # top_p=0.75: 0.4 + 0.3 = 0.7 < 0.75, so the 0.2 token is needed too.
    top_p = probs_from_logits(logits, SamplingParams(top_p=0.75))
    torch.testing.assert_close(top_p, torch.tensor([0.4, 0.3, 0.2, 0, 0]) / 0.9)
    min_p = probs_from_logits(logits, SamplingParams(min_p=0.45))  # keep p >= 0.18
    torch.testing.assert_close(min_p, torch.tensor([0.4, 0.3, 0.2, 0, 0]) / 0.9)


def test_rows_sum_to_one_and_are_finite_with_extreme_logits():
    logits = torch.tensor([[1e4, -1e4, 0.0], [float("-inf"), 0.0, 0.0]])
    for params in [SamplingParams(), SamplingParams(temperature=0.1, top_p=0.5), SamplingParams(top_k=1)]:
        probs = probs_from_logits(logits, params)
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_sample_uses_explicit_generator():
    probs = torch.full((4, 50), 1 / 50)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and a.shape == (4,)


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0)]
)
def test_bad_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [float("nan")] * 3, [0.5, float("nan"), 0.5], [0.5, float("inf"), 0.5]])
def test_sample_refuses_a_row_without_mass(row):
    """It used to return id V-1 for such rows, which hid NaNs from every test downstream."""
    probs = torch.tensor([[0.2, 0.3, 0.5], row])
    with pytest.raises(ValueError, match="all zero, NaN or infinite"):
        sample(probs, torch.Generator().manual_seed(0))


def test_sample_never_returns_a_zero_probability_id():
    probs = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1e-30]]).expand(5000, 2, 4)
    ids = sample(probs, torch.Generator().manual_seed(0))
    assert (ids[:, 0] == 1).all() and (ids[:, 1] == 3).all()


def test_tiny_temperature_tends_to_greedy_without_nan():
    logits = torch.tensor([[1.0, 3.0, 2.0, -50.0], [0.5, 0.5, -1.0, 0.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1e-38))
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1].tolist() == [0.5, 0.5, 0.0, 0.0]  # a tie shares the mass


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 1e300, -0.1])
def test_temperature_out_of_range_is_rejected(temperature):
    with pytest.raises(ValueError, match="temperature must be in"):
        SamplingParams(temperature=temperature)


def test_greedy_one_hot_over_the_last_dimension_and_its_dtype():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]], [[1.0, 1.0, 5.0], [0.0, 0.0, 0.0]]])  # [2, 2, 3]
    out = greedy_one_hot(logits)
    assert out.tolist() == [[[0, 1, 0], [1, 0, 0]], [[0, 0, 1], [1, 0, 0]]]
    assert out.dtype == torch.float32
    assert greedy_one_hot(logits.double()).dtype == torch.float64  # probabilities keep fp64
    assert greedy_one_hot(logits, dtype=torch.float16).dtype == torch.float16
    assert greedy_one_hot(logits.bfloat16()).dtype == torch.float32  # never below fp32 by default


def test_probs_per_row_applies_each_rows_parameters():
    logits = torch.randn(3, 2, 11, generator=torch.Generator().manual_seed(0))
    rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.3)]
    out = probs_per_row(logits, rows)
    for b, params in enumerate(rows):
        assert torch.equal(out[b], probs_from_logits(logits[b], params))
    shared = SamplingParams(temperature=0.5, top_p=0.9)
    assert torch.equal(probs_per_row(logits, [shared] * 3), probs_from_logits(logits, shared))
    with pytest.raises(ValueError, match="2 sampling parameter sets for 3 rows"):
        probs_per_row(logits, rows[:2])


def test_parameter_boundaries_are_accepted_and_mean_what_they_say():
    logits = torch.randn(2, 11, generator=torch.Generator().manual_seed(1))
    hot = probs_from_logits(logits, SamplingParams(temperature=MAX_TEMPERATURE))
    assert torch.allclose(hot.sum(-1), torch.ones(2)) and float(hot.min()) > 0.5 / 11  # near uniform
    unlimited = SamplingParams(temperature=1.0, top_k=0)  # 0 = off, like None
    assert torch.equal(probs_from_logits(logits, unlimited), probs_from_logits(logits, SamplingParams(temperature=1.0)))
    top = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=1.0, min_p=1.0))  # min_p = 1: the top only
    assert torch.equal((top > 0).sum(-1), torch.ones(2, dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(top_k=-1), "top_k must be >= 0 or None, got -1"), (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
     (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"), (dict(temperature=101.0), r"temperature must be in \[0, 100\]")],
)
def test_parameter_errors_name_the_parameter_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# --- properties pinned down by mutation testing (each kills mutants that the tests above missed) ---


def test_zero_dim_logits_are_rejected_with_the_message():
    with pytest.raises(ValueError, match=r"^logits must have at least one dimension \(the vocabulary\)$"):
        probs_from_logits(torch.tensor(1.0), SamplingParams())


def test_probabilities_are_at_least_fp32_whatever_the_logits():
    assert probs_from_logits(torch.zeros(2, 5, dtype=torch.bfloat16), SamplingParams(0.7)).dtype == torch.float32
    assert probs_from_logits(torch.zeros(2, 5, dtype=torch.float64), SamplingParams(0.7)).dtype == torch.float64


def test_each_row_is_shifted_by_its_own_max():
    """A row far below another row's max must not underflow to zeros (or NaN)."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [-1000.0, -999.0, -998.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(probs[0], probs[1]) and torch.allclose(probs[0], torch.softmax(logits[0], -1))


def test_top_p_keeps_the_smallest_set_reaching_p_with_ties_to_the_lowest_id():
    probs = probs_from_logits(torch.zeros(1, 4), SamplingParams(temperature=1.0, top_p=0.5))
    assert probs.tolist() == [[0.5, 0.5, 0.0, 0.0]]  # {0, 1} reaches exactly 0.5: no third token


def test_top_p_one_keeps_tiny_tokens():
    probs = probs_from_logits(torch.tensor([[0.0, 0.0, -80.0]]), SamplingParams(temperature=1.0, top_p=1.0))
    assert probs[0, 2] > 0  # the mass before it is already 1.0 after rounding; it must stay


def test_min_p_uses_each_rows_max_and_keeps_the_max_at_one():
    logits = torch.tensor([[0.0, -1.0, -5.0], [-10.0, -11.0, -15.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=0.2))
    assert torch.equal(probs[0], probs[1])
    assert probs[0, 2] == 0 and probs[0, 1] > 0
    top = probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=1.0))
    assert top.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_probs_per_row_single_row():
    logits = torch.randn(1, 2, 7, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.9, top_k=2)
    assert torch.equal(probs_per_row(logits, [params]), probs_from_logits(logits, params))


def test_sample_is_inverse_cdf_with_one_fp64_uniform_per_row():
    """The contract verify_chain's docstring relies on: one float64 uniform per row from the
    generator, and the cumulative sum in float64 (fp32 would shift the id on a large vocabulary)."""
    vocab = 100_000
    probs = torch.rand(6, vocab, generator=torch.Generator().manual_seed(0))
    probs[:, :10] = 0.0
    probs = (probs / probs.sum(-1, keepdim=True)).float()
    for seed in range(5):
        ids = sample(probs, torch.Generator().manual_seed(seed))
        u = torch.rand(6, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        cdf = probs.double().cumsum(-1)
        expected = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        assert torch.equal(ids, expected)
        assert (ids >= 10).all()


def test_sample_error_message():
    with pytest.raises(ValueError, match=r"^cannot sample from a row whose probabilities are all zero, NaN or infinite$"):
        sample(torch.zeros(1, 3), None)


def test_tiny_temperature_shifts_each_row_by_its_own_max():
    logits = torch.tensor([[0.0, 1.0, 2.0], [-1000.0, -999.0, -998.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1e-38))
    assert probs.tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]


def test_min_p_threshold_is_relative_to_each_rows_top_probability():
    logits = torch.tensor([[0.0, -1.0, -5.0], [0.0, 0.0, 0.0]])  # a sharp row and a flat row
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=0.5))
    assert probs[1].tolist() == pytest.approx([1 / 3] * 3)  # flat: every token is at the top
    assert probs[0, 2] == 0


def test_sample_accepts_unnormalised_rows():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(64, 4)
    a = sample(probs, torch.Generator().manual_seed(1))
    b = sample(probs * 7.0, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


@pytest.mark.parametrize("temperature", [1e-41, 1e-45, 1e-50, 1e-300, 5e-324])
def test_a_temperature_too_small_for_fp32_is_greedy(temperature):
    """Regression (server hardening, defect 1): a temperature that rounds to 0 in fp32 made the
    max logit 0 / 0 = NaN and sampling raised, killing the server. Below GREEDY_BELOW it is greedy
    (ties to the lowest id), and the row samples."""
    from specdec.verify.sampling import GREEDY_BELOW

    params = SamplingParams(temperature=temperature)
    assert temperature < GREEDY_BELOW and params.greedy and params.temperature == 0.0
    logits = torch.tensor([[1.0, 3.0, 2.0, -50.0], [0.5, 0.5, -1.0, 0.0]])
    probs = probs_from_logits(logits, params)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert sample(probs, torch.Generator().manual_seed(0)).tolist() == [1, 0]


@pytest.mark.parametrize("temperature", [1e-40, 1e-39, 1e-30])
def test_the_smallest_non_greedy_temperatures_divide_stably(temperature):
    """From GREEDY_BELOW up the fp32 division is by a non-zero number: finite rows, ties shared.
    Negative control for the test above: these are not turned into greedy."""
    params = SamplingParams(temperature=temperature)
    assert not params.greedy
    probs = probs_from_logits(torch.tensor([[0.5, 0.5, -1.0, 0.0]]), params)
    assert probs.tolist() == [[0.5, 0.5, 0.0, 0.0]]
