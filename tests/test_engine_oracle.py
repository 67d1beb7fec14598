"""Stage 06's and 07's engines on the real model against oracles they do not share code with.

A request's tokens must not depend on what else the engine runs: alone, in any mix of other
requests, arriving while others are half-way, or with its prompt cut into chunks by the token
budget, greedy decoding gives stage 04's tokens, and those are transformers' tokens on the same
weights. Seeded sampling gives each request its own stream, so it is batch-independent too.
Stage 07 keeps all of it over a paged cache (KV in blocks, read by gathering or in place),
through preemption (a request recomputed from scratch) and prefix-cache hits.

fp32 results differ by summation order (batch shapes, backends) by ~1e-5 per logit, so an
argmax can only flip at a near-tie. When tokens differ, the failure reports fp32's top-2 margin
at that step: a margin near 1e-5 is a near-tie to report, anything larger is a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from aie_lessons.attention import manual_attention
from aie_lessons.cached_generate import generate_cached
from aie_lessons.engine.engine import Engine
from aie_lessons.engine.paged_engine import paged_engine
from aie_lessons.engine.request import Request
from aie_lessons.kv_cache import kv_cache_bytes
from aie_lessons.model import LlamaModel
from aie_lessons.padded_batch import left_pad
from aie_lessons.sampling import SamplingParams
from aie_lessons.tokenizer import Tokenizer

from low_precision import assert_greedy_agrees, decisive_steps, logit_tolerance

pytestmark = pytest.mark.oracle

PROMPTS = [
    "The history of the lighthouse begins with fires on hills.",  # 11 tokens
    "def fibonacci(n):\n    if n < 2:\n        return n\n",  # 17
    "The capital of France is",  # 5
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",  # 19
]
NEW_TOKENS = 12  # none of the prompts reaches EOS this early: every comparison is full length
MAX_LEN = 64  # the engine's KV slots: a longest prompt + NEW_TOKENS fits, and the cache stays small
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS)


@dataclass(frozen=True)
class Reference:
    """One prompt's greedy continuation by stage 04 (run alone), and the fp32 logits behind it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logits: torch.Tensor  # (NEW_TOKENS, vocab): the logits token i was chosen from (teacher-forced)

    def margin(self, step: int) -> float:
        """fp32's gap between the best and second-best logit at ``step``: how far from a tie."""
        best, second = self.logits[step].topk(2).values.tolist()
        return best - second


@pytest.fixture(scope="module")
def tokenizer(real_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="module")
def references(real_model, tokenizer) -> list[Reference]:
    """Stage 04's tokens, each prompt alone (no padding), with the fp32 logits of every step."""
    references = []
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        result = generate_cached(real_model, tokenizer, [prompt_ids], GREEDY)[0]
        assert result.finish_reason == "length", (prompt, result)
        with torch.inference_mode():
            logits = real_model(torch.tensor([prompt_ids + result.token_ids]))[0, len(prompt_ids) - 1:-1]
        references.append(Reference(prompt_ids, result.token_ids, logits))
    return references


def assert_tokens(got: list[int], reference: Reference, what: str) -> None:
    """``got`` equals the reference's tokens; if not, say where and how close fp32 was to a tie."""
    if got == reference.token_ids:
        return
    expected = reference.token_ids
    step = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    margin = f"{reference.margin(step):.3g}" if step < len(expected) else "n/a (lengths differ)"
    raise AssertionError(f"{what}: tokens differ from stage 04's at step {step} of {len(expected)}: "
                         f"{got[step:step + 4]} vs {expected[step:step + 4]}; fp32 top-2 margin there: "
                         f"{margin} (a near-tie only if ~1e-5)")


def run_engine(engine: Engine, prompts: Sequence[list[int]], arrivals: Sequence[tuple[int, int]],
               params: Sequence[SamplingParams]) -> dict[int, Request]:
    """The finished request of each prompt index, added ``(before step, prompt index)`` in order.

    A request added at a later step arrives mid-flight: the engine must still be busy with the
    earlier ones then (asserted), or the scenario would not test what it says.
    """
    pending = sorted(arrivals, key=lambda arrival: arrival[0])  # stable: same-step order kept
    requests = {}
    step = 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            index = pending.pop(0)[1]
            requests[index] = engine.add_request(prompts[index], params[index])
        assert engine.has_work(), f"arrivals {arrivals}: nothing running at step {step}"
        engine.step()
        step += 1
    return requests


def generated(request: Request) -> list[int]:
    """A request's tokens as its consumer's result has them: an EOS that ended it is not output."""
    return request.output_ids[:-1] if request.finish_reason == "eos" else list(request.output_ids)


# The KV memories an engine can run on: stage 06's slots, and stage 07's blocks (small blocks, so
# that the prompts of 5 to 19 tokens cross block boundaries), read by gathering or in place.
KV_KINDS = ["slots", "blocks, gathered", "blocks, in place"]


def make_engine(kind: str, model: LlamaModel, tokenizer: Tokenizer, max_seqs: int, token_budget: int,
                **kwargs) -> Engine:
    if kind == "slots":
        return Engine.from_model(model, tokenizer, max_seqs=max_seqs, token_budget=token_budget,
                                 max_len=MAX_LEN, **kwargs)
    kv_bytes = kv_cache_bytes(model.config, MAX_LEN, max_seqs, model.embed_tokens.weight.dtype)
    return paged_engine(model, tokenizer, max_seqs=max_seqs, token_budget=token_budget, kv_bytes=kv_bytes,
                        block_size=4, decode="gather" if kind == "blocks, gathered" else "paged", **kwargs)


def all_at_once(order: Sequence[int]) -> list[tuple[int, int]]:
    return [(0, index) for index in order]


@dataclass(frozen=True)
class Scenario:
    max_seqs: int
    token_budget: int
    arrivals: list[tuple[int, int]]  # (before step, prompt index)
    chunks_prompts: bool  # whether the budget makes the scheduler cut some prompt into chunks


# Budgets 4 and 7 cut the prompts into chunks; 32 cuts only the one admitted last. Late arrivals
# and chunks make steps where one request's prefill runs next to another's decode.
GREEDY_SCENARIOS = {
    "alone": Scenario(1, 256, all_at_once([0, 1, 2, 3]), False),  # one slot: the batch to itself
    "all at once, budget 32": Scenario(4, 32, all_at_once([0, 1, 2, 3]), True),
    "two slots, reversed, arriving mid-flight": Scenario(2, 256, [(0, 3), (2, 2), (5, 1), (5, 0)], False),
    "budget 4, shuffled": Scenario(4, 4, all_at_once([2, 0, 3, 1]), True),
    "budget 7, arriving mid-flight": Scenario(3, 7, [(0, 1), (3, 2), (3, 0), (8, 3)], True),
}


def test_stage04_greedy_tokens_equal_transformers(references, gguf_reference):
    """The oracle of every test below is itself checked: transformers on the same weights
    (tests/test_oracle_transformers.py shows the GGUF it reads holds our converted tensors)."""
    batch = left_pad([r.prompt_ids for r in references], pad_id=0)
    with torch.inference_mode():
        out = gguf_reference.generate(batch.input_ids, attention_mask=batch.is_real.long(),
                                      max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    for row, reference in zip(out[:, batch.input_ids.shape[1]:].tolist(), references):
        assert_tokens(row, reference, "transformers' greedy generate")


# Every scenario on slots and on gathered blocks; reading blocks in place (the same arithmetic in
# another order) on the two scenarios that mix chunks, decodes and late arrivals the most.
GREEDY_RUNS = [(name, kind) for name in GREEDY_SCENARIOS for kind in KV_KINDS[:2]] + [
    ("all at once, budget 32", "blocks, in place"), ("budget 7, arriving mid-flight", "blocks, in place")]


@pytest.mark.parametrize("name, kind", GREEDY_RUNS)
def test_engine_greedy_tokens_do_not_depend_on_the_batch(real_model, tokenizer, references, name, kind):
    scenario = GREEDY_SCENARIOS[name]
    engine = make_engine(kind, real_model, tokenizer, scenario.max_seqs, scenario.token_budget)
    requests = run_engine(engine, [r.prompt_ids for r in references], scenario.arrivals,
                          [GREEDY] * len(references))
    for index, reference in enumerate(references):
        assert_tokens(generated(requests[index]), reference, f"engine, {name}, prompt {index}")
    # The scenario really ran what its name says (read from the chunks, not from StepStats' counts).
    chunks = [[(start, length, len(engine.requests[rid].prompt_ids)) for rid, start, length in s.chunks]
              for s in engine.stats]
    cut = any(0 < start < prompt for step in chunks for start, _, prompt in step)
    assert cut == scenario.chunks_prompts, chunks
    mixed = any({start >= prompt for start, _, prompt in step} == {True, False} for step in chunks)
    assert mixed == (scenario.max_seqs > 1), chunks  # alone: never a prefill next to a decode


# temperature, top-k and top-p all in play, a seed per request
SAMPLED = [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=40, top_p=0.9, seed=100 + i)
           for i in range(len(PROMPTS))]


@pytest.mark.parametrize("kind", KV_KINDS[:2])  # in place: test_preempted_and_resumed_equals_uninterrupted
def test_seeded_sampling_does_not_depend_on_the_batch(real_model, tokenizer, references, kind):
    """Each request draws from its own generator: the same tokens alone, in any batch or order,
    and as stage 04's padded batch (which also keeps one generator per row) draws them."""
    prompts = [r.prompt_ids for r in references]
    expected = [r.token_ids for r in generate_cached(real_model, tokenizer, prompts, SAMPLED)]
    greedy = [r.token_ids for r in references]
    assert expected != greedy, "the sampling parameters sample nothing but the greedy tokens"
    runs = {
        "together": (4, 256, all_at_once([0, 1, 2, 3])),
        "reversed, budget 7, arriving mid-flight": (3, 7, [(0, 3), (0, 2), (4, 1), (6, 0)]),
        "alone": (1, 256, all_at_once([2])),
    }
    for name, (max_seqs, token_budget, arrivals) in runs.items():
        engine = make_engine(kind, real_model, tokenizer, max_seqs, token_budget)
        for index, request in run_engine(engine, prompts, arrivals, SAMPLED).items():
            got = generated(request)
            assert got == expected[index], f"{name}, prompt {index}: {got} vs stage 04's {expected[index]}"


@pytest.mark.parametrize("kind", ["slots", "blocks, gathered"])
def test_manual_attention_gives_the_sdpa_tokens(real_model, tokenizer, references, kind):
    """Stage 02's kernel through the engine's cache: chunks and decodes in one pass. The runner binds
    it into its steps; the shared model keeps its own kernel."""
    chosen = [references[0], references[3]]
    engine = make_engine(kind, real_model, tokenizer, 2, 7, attention=manual_attention)
    requests = run_engine(engine, [r.prompt_ids for r in chosen], all_at_once([0, 1]), [GREEDY] * 2)
    for index, reference in enumerate(chosen):
        assert_tokens(generated(requests[index]), reference, f"engine with attention=manual_attention, prompt {index}")
    assert real_model.attention is not manual_attention


def test_bf16_engine_agrees_with_stage04_in_bf16(real_model_dir, tokenizer, references):
    """bf16 rounds differently on every CPU family, so nothing is compared exactly: logits within
    the measured bf16 bound of fp32's, and tokens equal while fp32's choice is decisive
    (tests/low_precision.py). Both bf16 paths (engine, stage 04) keep a bf16 KV cache."""
    model = LlamaModel.from_pretrained(real_model_dir, dtype=torch.bfloat16)
    chosen = [references[0], references[2]]  # their first few steps are far from a tie
    prompts = [r.prompt_ids for r in chosen]
    engine = Engine.from_model(model, tokenizer, max_seqs=2, token_budget=7, max_len=MAX_LEN)
    rows: dict[str, list[torch.Tensor]] = {}
    sample = engine.sampler.sample

    def recording_sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
        for row, request in zip(logits, requests):
            rows.setdefault(request.id, []).append(row.clone())
        return sample(logits, requests)

    engine.sampler.sample = recording_sample
    requests = run_engine(engine, prompts, all_at_once([0, 1]), [GREEDY] * 2)
    stage04 = generate_cached(model, tokenizer, prompts, GREEDY)  # a padded batch: a third rounding
    for index, reference in enumerate(chosen):
        decisive = decisive_steps(reference.logits, torch.bfloat16)
        assert decisive >= 4, f"prompt {index}: only {decisive} decisive steps; pick a prompt further from ties"
        assert_greedy_agrees(stage04[index].token_ids, reference.token_ids, reference.logits, torch.bfloat16)
        request = requests[index]
        assert_greedy_agrees(generated(request), reference.token_ids, reference.logits, torch.bfloat16)
        # Up to and including the first non-decisive step, the engine saw fp32's tokens: its
        # logits there are the same positions' logits, rounded.
        ours = torch.stack(rows[request.id])[:decisive + 1]
        theirs = reference.logits[:decisive + 1]
        errors = (ours - theirs).abs().amax(dim=-1)
        bounds = torch.tensor([logit_tolerance(torch.bfloat16, s) for s in theirs.abs().amax(dim=-1).tolist()])
        assert (errors <= bounds).all(), f"prompt {index}: errors {errors.tolist()} over bounds {bounds.tolist()}"


def test_step_stats_on_the_real_model(real_model, tokenizer, references):
    """Every step records its phases' times (the model's run and the Python around it) and
    its tokens: a prompt token is prefill exactly once, every sampled token but the last decodes."""
    # 11 then 5 prompt tokens, budget 5: the first prompt's last token is a chunk of its own
    # (step 2), as is the second's (step 3), each next to other work.
    chosen = [references[0], references[2]]
    params = SamplingParams(max_new_tokens=4)
    engine = Engine.from_model(real_model, tokenizer, max_seqs=2, token_budget=5, max_len=MAX_LEN)
    tokens = [generated(r) for r in
              run_engine(engine, [r.prompt_ids for r in chosen], all_at_once([0, 1]), [params] * 2).values()]
    for stats in engine.stats:
        assert stats.run_s > 0 and stats.overhead_s > 0, stats
        phases = (stats.schedule_s, stats.prepare_s, stats.run_s, stats.sample_s, stats.postprocess_s)
        assert all(phase >= 0 for phase in phases), stats
        assert stats.end >= stats.start, stats
        step_tokens = sum(length for _, _, length in stats.chunks)
        assert stats.prefill_tokens + stats.decode_rows == step_tokens <= 5, stats
    assert sum(s.prefill_tokens for s in engine.stats) == sum(len(r.prompt_ids) for r in chosen)
    assert sum(s.decode_rows for s in engine.stats) == sum(len(t) - 1 for t in tokens)
    assert [len(t) for t in tokens] == [4, 4]


# --- stage 07: preemption and prefix caching ----------------------------------------------------
def tight_engine(model: LlamaModel, tokenizer: Tokenizer, decode: str = "gather") -> Engine:
    """Blocks of 4 tokens, 12 of them: the longest request (31 tokens, 8 blocks) fits alone, but
    four together do not, so the engine must preempt."""
    kv_bytes = 12 * kv_cache_bytes(model.config, 4, 1, model.embed_tokens.weight.dtype)
    return paged_engine(model, tokenizer, max_seqs=4, token_budget=16, kv_bytes=kv_bytes, block_size=4,
                        decode=decode)


@pytest.mark.parametrize("decode", ["gather", "paged"])
def test_preempted_and_resumed_equals_uninterrupted(real_model, tokenizer, references, decode):
    """Greedy and seeded sampling: a request recomputed after preemption continues exactly as if
    it had never stopped (its generator stays with the sampler)."""
    prompts = [r.prompt_ids for r in references]
    engine = tight_engine(real_model, tokenizer, decode)
    requests = run_engine(engine, prompts, all_at_once([0, 1, 2, 3]), [GREEDY] * 4)
    assert engine.scheduler.num_preemptions > 0, "the pool was large enough: nothing was preempted"
    for index, reference in enumerate(references):
        assert_tokens(generated(requests[index]), reference, f"preempting engine ({decode}), prompt {index}")
    assert engine.runner.allocator.used == 0
    sampled = tight_engine(real_model, tokenizer, decode)
    expected = [r.token_ids for r in generate_cached(real_model, tokenizer, prompts, SAMPLED)]
    got = run_engine(sampled, prompts, [(0, 3), (0, 2), (2, 1), (3, 0)], SAMPLED)
    assert sampled.scheduler.num_preemptions > 0
    assert [generated(got[i]) for i in range(4)] == expected


def test_prefix_cache_hit_equals_miss(real_model, tokenizer, references):
    """Prompts sharing a long prefix: with prefix caching the later ones reuse the first one's
    blocks, compute fewer prefill tokens, and still give exactly the tokens computed without it."""
    shared = tokenizer.encode("You answer questions about lighthouses, briefly and accurately. " * 3)
    prompts = [shared + r.prompt_ids for r in references]
    expected = [r.token_ids for r in generate_cached(real_model, tokenizer, prompts, GREEDY)]  # one padded batch
    runs = {}
    for caching in (False, True):
        engine = paged_engine(real_model, tokenizer, max_seqs=4, token_budget=256, block_size=16,
                              prefix_caching=caching)
        requests = run_engine(engine, prompts, [(0, 0), (1, 1), (1, 2), (2, 3)], [GREEDY] * 4)
        runs[caching] = (engine, [generated(requests[i]) for i in range(4)])
    for caching, (engine, tokens) in runs.items():
        assert tokens == expected, f"prefix_caching={caching}: {tokens} vs stage 04's {expected}"
    computed = {caching: sum(s.prefill_tokens for s in e.stats) for caching, (e, _) in runs.items()}
    saved = runs[True][0].runner.allocator.hit_tokens
    full_blocks = len(shared) // 16 * 16
    assert saved == 3 * full_blocks, (saved, len(shared))  # the three later requests, whole blocks only
    assert computed[False] - computed[True] == saved, computed
    assert runs[False][0].runner.allocator.hit_tokens == 0
