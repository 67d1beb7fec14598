"""Sampling (aie_lessons.sampling): parameters, the repetition penalty, top-k/top-p, seeded draws.

Three layers:
* model-free unit tests of ``SamplingParams`` validation, seeding and the greedy path;
* the oracle: on real next-token logits of the course model, the tokens we keep (and the
  penalized logits) equal what transformers' own logits processors produce;
* a chi-square goodness-of-fit test: seeded draws follow the filtered softmax distribution,
  with a negative control showing the statistic does reject a wrong distribution.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from aie_lessons.sampling import (
    SamplingParams,
    SamplingParamsError,
    apply_repetition_penalty,
    filter_top_k_top_p,
    make_generator,
    params_per_row,
    sample_next,
    sample_row,
)

# --- model-free unit tests --------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", float("nan")),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("max_new_tokens", -1),
    ("max_new_tokens", 2.0),
    ("seed", "x"),
    ("seed", 1.5),
    ("temperature", True),
    ("stop", "abc"),
    ("stop", ("ok", 3)),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=f"^{field}=") as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)  # callers catching ValueError still see it
    message = str(info.value)
    if value == "abc":
        assert "Fix: stop=('abc',)" in message
    else:
        assert "must be" in message  # says what is allowed, not only what is wrong


@pytest.mark.parametrize("field, allowed", [
    ("temperature", "≥ 0"),
    ("top_k", "≥ 0"),
    ("top_p", "(0, 1]"),
    ("repetition_penalty", "> 0"),
    ("max_new_tokens", "≥ 0"),
    ("seed", "integer or None"),
])
def test_invalid_sampling_params_state_the_allowed_range(field, allowed):
    bad = {"temperature": -1.0, "top_k": -1, "top_p": 2.0, "repetition_penalty": 0.0,
           "max_new_tokens": -1, "seed": "x"}[field]
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: bad})
    assert allowed in str(info.value)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"temperature": 2}, {"top_k": 0}, {"top_k": 50}, {"top_p": 1.0},
    {"top_p": 0.01}, {"repetition_penalty": 0.5}, {"repetition_penalty": 1.3},
    {"max_new_tokens": 0}, {"seed": 0}, {"seed": None}, {"stop": ()},
])
def test_valid_sampling_params_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_defaults_are_greedy_and_frozen():
    params = SamplingParams()
    assert params.greedy
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (0.0, 0, 1.0, 1.0)
    assert params.seed is None and params.stop == ()
    assert not SamplingParams(temperature=0.7).greedy
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # frozen: one request's parameters never change


def test_a_stop_list_becomes_a_tuple():
    params = SamplingParams(stop=["\n\n", "END"])
    assert params.stop == ("\n\n", "END")
    assert isinstance(params.stop, tuple)
    hash(params)  # frozen and hashable once the list is a tuple


def test_make_generator_with_a_seed_reproduces_draws():
    def draws(seed):
        return torch.rand(8, generator=make_generator(seed)).tolist()

    assert draws(123) == draws(123)
    assert draws(123) != draws(124)
    assert draws(None) != draws(None)  # no seed: a fresh stream each time


def random_logits(batch, vocab, seed=0):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_sample_next_is_reproducible_with_a_seed():
    logits = random_logits(2, 300)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=5)

    def run():
        generators = [make_generator(5), make_generator(6)]
        return [sample_next(logits[:, None], [params] * 2, generators, [[1, 2], [3]]) for _ in range(20)]

    assert run() == run()


def test_a_rows_draws_do_not_depend_on_the_other_rows_in_the_batch():
    """Each row owns its generator: the same seed gives the same tokens alone or batched."""
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, repetition_penalty=1.2)
    steps = [random_logits(3, 200, seed=step) for step in range(15)]

    alone, generator, history = [], make_generator(7), [5, 6]
    for logits in steps:
        token = sample_next(logits[1:2, None], [params], [generator], [history])[0]
        alone.append(token)
        history = history + [token]

    batched, generators, histories = [], [make_generator(s) for s in (1, 7, 99)], [[0], [5, 6], []]
    neighbours = [SamplingParams(temperature=0.5), params, SamplingParams()]  # each row its own params
    for logits in steps:
        tokens = sample_next(logits[:, None], neighbours, generators, histories)
        batched.append(tokens[1])
        histories = [h + [t] for h, t in zip(histories, tokens)]

    assert alone == batched
    assert len(set(alone)) > 1  # really sampled, not a constant


def test_greedy_is_argmax():
    logits = random_logits(4, 500)
    assert sample_next(logits[:, None], [SamplingParams()] * 4, [], []) == logits.argmax(-1).tolist()
    generators = [make_generator(0) for _ in range(4)]
    # greedy with a repetition penalty: the argmax of the penalized logits, no randomness
    histories = [[int(logits[i].argmax())] for i in range(4)]
    penalized = torch.stack([apply_repetition_penalty(row, torch.tensor(h), 1e3)
                             for row, h in zip(logits, histories)])
    got = sample_next(logits[:, None], [SamplingParams(repetition_penalty=1e3)] * 4, generators, histories)
    assert got == penalized.argmax(-1).tolist()
    assert got != logits.argmax(-1).tolist()  # the penalty did move the pick


def test_a_tiny_temperature_samples_the_best_token_instead_of_overflowing():
    logits = random_logits(1, 300)[0] * 20  # logits near ±100: divided by 1e-40 they overflow fp32
    params = SamplingParams(temperature=1e-40, seed=0)
    assert sample_row(logits, params, make_generator(0), []) == int(logits.argmax())


def test_params_per_row_gives_one_each_or_refuses_a_wrong_count():
    one = SamplingParams(temperature=0.5)
    assert params_per_row(one, 3) == [one, one, one]
    assert params_per_row([one, SamplingParams()], 2)[1] == SamplingParams()
    with pytest.raises(SamplingParamsError, match="got 2 SamplingParams for 3 prompts"):
        params_per_row([one, one], 3)


def test_top_k_keeps_ties_and_top_p_keeps_the_token_crossing_p():
    logits = torch.tensor([[5.0, 5.0, 4.0, 4.0, 4.0, 3.0]])
    kept = torch.isfinite(filter_top_k_top_p(logits, 3, 1.0))[0].tolist()
    assert kept == [True, True, True, True, True, False]  # the 3rd best (4.0) is tied three ways
    probs = torch.tensor([[0.6, 0.25, 0.1, 0.05]]).log()
    kept = torch.isfinite(filter_top_k_top_p(probs, 0, 0.7))[0].tolist()
    assert kept == [True, True, False, False]  # 0.6 < 0.7, so the 2nd stays; 0.85 ≥ 0.7 drops the 3rd


def test_filters_and_penalty_leave_the_callers_logits_alone():
    logits = random_logits(2, 100)
    before = logits.clone()
    filter_top_k_top_p(logits, 5, 0.5)
    apply_repetition_penalty(logits[0], torch.tensor([1, 2, 2]), 1.5)
    assert torch.equal(logits, before)


# --- real next-token logits -------------------------------------------------------------------

CHAT_PROMPTS = [
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "List three tips for learning a new programming language.",
]
LONG_TEXT = (
    "The lighthouse stood on the rocks at the edge of the bay. Every night the keeper climbed "
    "the stairs, trimmed the wick and wound the clockwork that turned the lens. Ships far out "
    "at sea saw the beam sweep across the water and knew the rocks were near. When the storm "
    "came in November, the keeper stayed awake for three nights, and the light never went out."
)
LONG_TEXT_POSITIONS = (6, 19, 37, 58, -1)



@pytest.fixture(scope="module")
def hf():
    """transformers' own logits processors: imported plainly, so a broken install fails the test."""
    from transformers.generation import logits_process

    return logits_process


@pytest.fixture(scope="module")
def real_rows(real_model_dir):
    """(name, next-token logits (vocab,) fp32, the ids before it) from the real model."""
    from aie_lessons.model import LlamaModel
    from aie_lessons.tokenizer import Tokenizer

    model = LlamaModel.from_pretrained(real_model_dir, dtype=torch.float32)
    tokenizer = Tokenizer.from_pretrained(real_model_dir)
    rows = []
    with torch.inference_mode():
        for i, prompt in enumerate(CHAT_PROMPTS):
            ids = tokenizer.encode_chat(prompt)
            rows.append((f"chat{i}", model(torch.tensor([ids]))[0, -1].float().clone(), ids))
        ids = tokenizer.encode(LONG_TEXT)
        logits = model(torch.tensor([ids]))[0].float().clone()
        for position in LONG_TEXT_POSITIONS:
            position = position % len(ids)
            rows.append((f"text@{position}", logits[position], ids[: position + 1]))
    return rows


def theirs(hf, row, history, *, penalty=1.0, temperature=1.0, top_k=0, top_p=1.0):
    """transformers' processors in generate()'s order: penalty → temperature → top-k → top-p."""
    input_ids = torch.tensor([history])
    scores = row[None].clone()
    if penalty != 1.0:
        scores = hf.RepetitionPenaltyLogitsProcessor(penalty=penalty)(input_ids, scores)
    if temperature != 1.0:
        scores = hf.TemperatureLogitsWarper(float(temperature))(input_ids, scores)
    if top_k > 0:
        scores = hf.TopKLogitsWarper(top_k=top_k)(input_ids, scores)
    if top_p < 1.0:
        scores = hf.TopPLogitsWarper(top_p=top_p)(input_ids, scores)
    return scores[0]


def ours(row, history, *, penalty=1.0, temperature=1.0, top_k=0, top_p=1.0):
    """Our functions in the order sample_row applies them."""
    if penalty != 1.0:
        row = apply_repetition_penalty(row, torch.tensor(history, dtype=torch.long), penalty)
    return filter_top_k_top_p(row[None] / temperature, top_k, top_p)[0]


def assert_same_kept(mine, reference, case):
    """Exactly the same kept set, removed tokens at -inf, kept logits equal; returns how many."""
    kept_mine, kept_ref = torch.isfinite(mine), torch.isfinite(reference)
    if (kept_mine ^ kept_ref).any():
        only_mine = (kept_mine & ~kept_ref).nonzero().flatten().tolist()
        only_ref = (kept_ref & ~kept_mine).nonzero().flatten().tolist()
        pytest.fail(f"{case}: kept {int(kept_mine.sum())} tokens, transformers {int(kept_ref.sum())}; "
                    f"only ours {only_mine[:10]}, only transformers {only_ref[:10]}")
    assert (mine[~kept_mine] == float("-inf")).all(), f"{case}: removed tokens must be -inf"
    both = kept_mine & kept_ref
    torch.testing.assert_close(mine[both], reference[both], rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"{case}: kept logits differ: {m}")
    return int(kept_mine.sum())


@pytest.mark.oracle
def test_real_rows_have_repeats_in_their_history(real_rows):
    """The penalty tests below mean something only if histories repeat tokens."""
    repeats = {name: len(set(history)) < len(history) for name, _, history in real_rows}
    assert all(repeats[name] for name in repeats if name.startswith("chat")), repeats
    assert sum(repeats.values()) >= 6, repeats


@pytest.mark.oracle
@pytest.mark.parametrize("penalty", [0.7, 1.1, 1.3, 2.0])
def test_repetition_penalty_values_match_transformers(hf, real_rows, penalty):
    for name, row, history in real_rows:
        mine = apply_repetition_penalty(row, torch.tensor(history), penalty)
        reference = theirs(hf, row, history, penalty=penalty)
        torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{name}, penalty {penalty}: {m}")
        changed = set((mine != row).nonzero().flatten().tolist())
        assert changed == {t for t in set(history) if row[t] != 0}, name  # the seen tokens, once each


@pytest.mark.oracle
@pytest.mark.parametrize("top_k", [1, 2, 5, 40, 1000, 49152, 60000])
def test_top_k_keeps_what_transformers_keeps(hf, real_rows, top_k):
    for name, row, history in real_rows:
        kept = assert_same_kept(ours(row, history, top_k=top_k), theirs(hf, row, history, top_k=top_k),
                                f"{name}, top_k={top_k}")
        assert kept >= min(top_k, row.numel())


TOP_P_VALUES = (0.01, 0.1, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999)


@pytest.mark.oracle
@pytest.mark.parametrize("top_p", TOP_P_VALUES)
def test_top_p_keeps_what_transformers_keeps(hf, real_rows, top_p):
    sizes = []
    for name, row, history in real_rows:
        sizes.append(assert_same_kept(ours(row, history, top_p=top_p), theirs(hf, row, history, top_p=top_p),
                                      f"{name}, top_p={top_p}"))
    if top_p >= 0.8:
        assert max(sizes) > 1  # the comparison is not only "keep the argmax"


@pytest.mark.oracle
def test_top_p_is_exact_at_the_boundary(hf, real_rows):
    for top_p in TOP_P_VALUES:
        for temperature in (1.0, 1.5):
            for name, row, history in real_rows:
                assert_same_kept(ours(row, history, temperature=temperature, top_p=top_p),
                                 theirs(hf, row, history, temperature=temperature, top_p=top_p),
                                 f"{name}, temperature={temperature}, top_p={top_p}")


@pytest.mark.oracle
def test_the_whole_batch_is_filtered_row_by_row(hf, real_rows):
    """(B, vocab) in one call keeps, per row, what transformers keeps on the same batch."""
    batch = torch.stack([row for _, row, _ in real_rows])
    for top_k, top_p in [(0, 0.9), (50, 1.0), (50, 0.8), (3, 0.5)]:
        mine = filter_top_k_top_p(batch, top_k, top_p)
        dummy = torch.zeros(batch.shape[0], 1, dtype=torch.long)
        before_top_p = hf.TopKLogitsWarper(top_k=top_k)(dummy, batch.clone()) if top_k else batch.clone()
        reference = hf.TopPLogitsWarper(top_p=top_p)(dummy, before_top_p.clone()) if top_p < 1 else before_top_p
        for i, (name, _, _) in enumerate(real_rows):
            assert_same_kept(mine[i], reference[i], f"batch row {name}, top_k={top_k}, top_p={top_p}")


COMBO_PENALTIES = (1.0, 1.3)
COMBO_TEMPERATURES = (0.6, 1.0, 1.5)
COMBO_TOP_K = (0, 1, 10, 64)
COMBO_TOP_P = (1.0, 0.3, 0.8, 0.95)


@pytest.mark.oracle
@pytest.mark.parametrize("penalty", COMBO_PENALTIES)
@pytest.mark.parametrize("temperature", COMBO_TEMPERATURES)
def test_combinations_keep_what_transformers_keeps(hf, real_rows, penalty, temperature):
    """Penalty, temperature, top-k and top-p together, in transformers' order."""
    changed_by_penalty = 0
    for top_k in COMBO_TOP_K:
        for top_p in COMBO_TOP_P:
            setting = dict(penalty=penalty, temperature=temperature, top_k=top_k, top_p=top_p)
            for name, row, history in real_rows:
                mine = ours(row, history, **setting)
                assert_same_kept(mine, theirs(hf, row, history, **setting), f"{name}, {setting}")
                if penalty != 1.0:
                    unpenalized = ours(row, history, **(setting | {"penalty": 1.0}))
                    changed_by_penalty += not torch.equal(torch.isfinite(unpenalized), torch.isfinite(mine))
    if penalty != 1.0:
        assert changed_by_penalty > 0  # the penalty does change kept sets on these rows


# --- chi-square: seeded draws follow the filtered softmax -------------------------------------

SLICE = 2048  # the best 2048 tokens of a real row: real logit values, cheap enough to draw 20k times
DRAWS = 20_000
MIN_EXPECTED = 5.0


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's goodness-of-fit p-value, bins with expected counts < 5 pooled together.

    ``counts`` and ``probs`` cover the same support; returns (p-value, degrees of freedom).
    """
    counts, probs = counts.double(), probs.double()
    expected = probs / probs.sum() * counts.sum()
    order = expected.argsort()
    cut = int((expected < MIN_EXPECTED).sum())  # the small bins come first in `order`
    while 0 < cut < len(order) and expected[order[:cut]].sum() < MIN_EXPECTED:
        cut += 1  # the pool is itself small: grow it with the next-smallest bin
    if cut:
        obs = torch.cat([counts[order[:cut]].sum()[None], counts[order[cut:]]])
        exp = torch.cat([expected[order[:cut]].sum()[None], expected[order[cut:]]])
    else:
        obs, exp = counts, expected
    dof = len(obs) - 1
    assert dof >= 1, "too few bins for a chi-square test"
    statistic = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2)), dof


def test_chi_square_p_value_is_the_known_chi_square_tail():
    # Statistic 10 with 4 degrees of freedom: the survival function is e^-5 (1 + 5) = 0.0404...
    counts, probs = torch.tensor([30.0, 10, 20, 20, 20]), torch.full((5,), 0.2)
    p, dof = chi_square_p_value(counts, probs)
    assert dof == 4
    assert math.isclose(p, math.exp(-5) * (1 + 5), rel_tol=1e-9)
    # small bins are pooled: 3 bins of expected 2 become one of 6, so 2 degrees of freedom
    p, dof = chi_square_p_value(torch.tensor([47.0, 47, 2, 2, 2]), torch.tensor([0.47, 0.47, 0.02, 0.02, 0.02]))
    assert dof == 2 and p > 0.99


def real_slice(real_rows, index):
    """A row's best SLICE tokens (in id order) and its history mapped into the slice."""
    _, row, history = real_rows[index]
    ids = row.topk(SLICE).indices.sort().values
    position = {int(t): i for i, t in enumerate(ids)}
    return row[ids].clone(), [position[t] for t in history if t in position]


def draw(logits, params, history, n, seed=2024):
    generator = make_generator(seed)
    return torch.tensor([sample_row(logits, params, generator, history) for _ in range(n)])


def expected_probs(hf, logits, history, params):
    """The filtered distribution by transformers' processors, softmax in float64."""
    filtered = theirs(hf, logits, history, penalty=params.repetition_penalty,
                      temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    return filtered.double().softmax(-1)


CHI_SQUARE_CASES = [  # (index into real_rows, params)
    (3, SamplingParams(temperature=1.0, top_p=0.9)),  # ~430 tokens: many small bins to pool
    (1, SamplingParams(temperature=0.7, top_k=40, top_p=0.95)),
    (6, SamplingParams(temperature=1.3, top_k=25, repetition_penalty=1.3)),  # 6 seen tokens kept
]


@pytest.mark.oracle
@pytest.mark.parametrize("row, params", CHI_SQUARE_CASES,
                         ids=lambda c: c if isinstance(c, int) else
                         f"T{c.temperature}-k{c.top_k}-p{c.top_p}-r{c.repetition_penalty}")
def test_seeded_draws_follow_the_filtered_softmax(hf, real_rows, row, params):
    logits, history = real_slice(real_rows, row)
    probs = expected_probs(hf, logits, history, params)
    kept = probs > 0
    assert int(kept.sum()) >= 10  # enough kept tokens for the test to say something
    if params.repetition_penalty != 1.0:  # the penalty must matter on this row, or it goes untested
        unpenalized = expected_probs(hf, logits, history, replace(params, repetition_penalty=1.0))
        assert (probs - unpenalized).abs().sum() / 2 > 0.1
    samples = draw(logits, params, history, DRAWS)
    counts = torch.bincount(samples, minlength=len(logits))
    assert counts[~kept].sum() == 0, f"drew removed tokens {(counts * ~kept).nonzero().flatten().tolist()}"
    p, dof = chi_square_p_value(counts[kept], probs[kept])
    assert p > 1e-3, f"chi-square p = {p:.3g} with {dof} degrees of freedom"


@pytest.mark.oracle
def test_sample_next_on_the_full_vocabulary_follows_the_filtered_softmax(hf, real_rows):
    """The full 49152-token row through sample_next (fewer draws: each costs ~1 ms here)."""
    _, row, history = real_rows[0]
    params = SamplingParams(temperature=0.9, top_k=30, repetition_penalty=1.2, seed=3)
    probs = expected_probs(hf, row, history, params)
    generator = make_generator(params.seed)
    samples = torch.tensor([sample_next(row[None, None], [params], [generator], [history])[0] for _ in range(2500)])
    counts = torch.bincount(samples, minlength=len(row))
    kept = probs > 0
    assert counts[~kept].sum() == 0
    p, dof = chi_square_p_value(counts[kept], probs[kept])
    assert dof >= 5
    assert p > 1e-3, f"chi-square p = {p:.3g} with {dof} degrees of freedom"


@pytest.mark.oracle
def test_negative_control_the_chi_square_test_rejects_a_wrong_distribution(hf, real_rows):
    """The same statistic on the same kind of draws fails when the distribution is wrong."""
    logits, history = real_slice(real_rows, 1)
    drawn_with = SamplingParams(temperature=1.0, top_k=40)
    samples = draw(logits, drawn_with, history, DRAWS)
    counts = torch.bincount(samples, minlength=len(logits))

    right = expected_probs(hf, logits, history, drawn_with)
    p_right, _ = chi_square_p_value(counts[right > 0], right[right > 0])
    assert p_right > 1e-3  # the draws themselves are fine

    # temperature off by 5%: the same kept set, a slightly different shape
    wrong = expected_probs(hf, logits, history, SamplingParams(temperature=1.05, top_k=40))
    assert torch.equal(wrong > 0, right > 0)
    p_wrong, dof = chi_square_p_value(counts[wrong > 0], wrong[wrong > 0])
    assert p_wrong < 1e-3, f"p = {p_wrong:.3g} ({dof} dof): the test cannot tell T=1.0 from T=1.05"

    # sampling the unfiltered softmax: the support check catches it (tokens outside the top 40)
    generator = make_generator(2024)
    unfiltered = torch.multinomial(logits.softmax(-1), DRAWS, replacement=True, generator=generator)
    assert torch.bincount(unfiltered, minlength=len(logits))[right == 0].sum() > 0
    # Renormalized over the kept tokens, the unfiltered softmax *is* the filtered one: only the
    # support check can catch a missing filter, which is why every test above asserts it.


# --- the engine's batched sampler (stage 06) against stage 01's row by row ----------------------


def _mixed_params(rng: torch.Generator, rows: int) -> list[SamplingParams]:
    """Random per-row parameters: greedy or sampled, with or without a penalty, top-k and top-p,
    drawn from a few values so that some rows share a group and some do not."""
    def pick(values):
        return values[int(torch.randint(len(values), (1,), generator=rng))]
    return [SamplingParams(temperature=pick([0.0, 0.7, 1.0, 1.5]), top_k=pick([0, 5, 50]),
                           top_p=pick([1.0, 0.9, 0.5]), repetition_penalty=pick([1.0, 1.3]), seed=i)
            for i in range(rows)]


@pytest.mark.parametrize("trial", range(20))
def test_the_batched_sampler_draws_stage_01s_tokens(trial):
    """Same logits, same parameters, generators seeded alike: ``sample_batch`` gives exactly the
    tokens of ``sample_next`` row by row, for mixed batches of greedy and sampled rows."""
    from aie_lessons.engine.sampler import sample_batch

    rng = torch.Generator().manual_seed(trial)
    rows = 1 + trial % 9
    params = _mixed_params(rng, rows)
    logits = torch.randn(rows, 300, generator=rng) * 4
    histories = [torch.randint(300, (5,), generator=rng).tolist() for _ in range(rows)]
    before = logits.clone()
    batched = sample_batch(logits, params, [make_generator(p.seed) for p in params], histories)
    expected = sample_next(logits[:, None], params, [make_generator(p.seed) for p in params], histories)
    assert batched == expected, params
    assert torch.equal(logits, before), "the caller's logits were changed"


@pytest.mark.oracle
def test_the_batched_sampler_follows_the_filtered_softmax_on_real_logits(hf, real_rows):
    """Seeded draws of one real row, batched eight to a step with other rows' parameters beside
    it: the kept tokens' counts follow transformers' filtered softmax (the race argmax(p / q) is
    a true draw from p), and no removed token is ever drawn."""
    from aie_lessons.engine.sampler import sample_batch

    logits, history = real_slice(real_rows, 1)
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, repetition_penalty=1.2, seed=3)
    probs = expected_probs(hf, logits, history, params)
    generator, other = make_generator(params.seed), SamplingParams(temperature=1.0, seed=9)
    batch = [params] * 7 + [other]  # two groups in every step
    samples = []
    for _ in range(DRAWS // 7):
        tokens = sample_batch(logits.expand(8, -1), batch, [generator] * 7 + [make_generator(9)], [history] * 8)
        samples += tokens[:7]
    counts = torch.bincount(torch.tensor(samples), minlength=len(logits))
    kept = probs > 0
    assert counts[~kept].sum() == 0, f"drew removed tokens {(counts * ~kept).nonzero().flatten().tolist()}"
    p, dof = chi_square_p_value(counts[kept], probs[kept])
    assert p > 1e-3, f"chi-square p = {p:.3g} with {dof} degrees of freedom"
