"""Continuous batching over a paged KV cache: every request gets the tokens it gets alone (Hugging Face's greedy
tokens; its own seeded samples), while requests join and leave the running batch, are preempted and recomputed
when blocks run out; blocks all come back; bad requests are refused before they take any."""

from __future__ import annotations

import pytest
import torch

from overdrive.generate import Decoder, Generator, SamplingParams
from overdrive.generate.continuous import ContinuousGenerator
from overdrive.generate.paged import BlockPool
from tests.conftest import requires_cuda
from tests.test_generate import VOCAB, _hf, _hf_greedy, _prompts

pytest.importorskip("transformers")


def _lengths(n: int) -> list[SamplingParams]:
    """Answers of different lengths, so sequences leave the batch at different steps and others join."""
    return [SamplingParams(max_new_tokens=3 + (7 * i) % 11) for i in range(n)]


@pytest.mark.parametrize("kind", ["llama", "phi3-partial", "gpt2"])
def test_greedy_tokens_equal_hugging_face_while_requests_join_and_leave(kind):
    hf = _hf(kind)
    prompts, params = _prompts(10, seed=4), _lengths(10)
    gen = ContinuousGenerator(Decoder.from_hf(hf), max_batch_size=4, block_size=4)
    out = gen.generate(prompts, params)
    expected = _hf_greedy(hf, prompts, new=13)
    assert [c.token_ids for c in out] == [e[:q.max_new_tokens] for e, q in zip(expected, params)]
    assert all(c.finish_reason == "length" for c in out)
    assert gen.stats.peak_running == 4  # the batch was full ...
    assert gen.pool.num_free == gen.pool.capacity and not gen.has_unfinished  # ... and every block came back
    assert 0 < gen.stats.kv_waste < 0.5  # blocks of 4: at most 3 empty slots per sequence


def test_a_request_alone_and_in_a_busy_batch_gives_the_same_tokens_greedy_and_sampled():
    decoder = Decoder.from_hf(_hf())
    prompts = _prompts(9, seed=6)
    params = [SamplingParams(max_new_tokens=4 + i, temperature=0.0 if i % 3 == 0 else 0.9, top_p=0.95, seed=50 + i)
              for i in range(9)]
    busy = ContinuousGenerator(decoder, max_batch_size=5, block_size=8).generate(prompts, params)
    static = Generator(decoder, max_batch_size=1)
    alone = [static.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert [c.token_ids for c in busy] == alone
    assert len({tuple(t) for t in alone}) == 9


def test_preempted_sequences_are_recomputed_and_keep_their_tokens():
    decoder = Decoder.from_hf(_hf())
    prompts = _prompts(6, seed=8)
    params = [SamplingParams(max_new_tokens=20, temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)]
    roomy = ContinuousGenerator(decoder, max_batch_size=6, block_size=4)
    expected = [c.token_ids for c in roomy.generate(prompts, params)]
    assert roomy.stats.preemptions == 0
    # 9 usable blocks of 4 slots: two sequences of up to 31 tokens cannot both hold all theirs at once.
    tight = ContinuousGenerator(decoder, max_batch_size=6, block_size=4, num_blocks=10)
    assert [c.token_ids for c in tight.generate(prompts, params)] == expected
    assert tight.stats.preemptions > 0
    assert tight.pool.num_free == tight.pool.capacity


def test_the_compiled_decode_step_gives_the_eager_tokens():
    decoder = Decoder.from_hf(_hf())
    prompts, params = _prompts(7, seed=9), _lengths(7)
    eager = ContinuousGenerator(decoder, max_batch_size=3, block_size=8).generate(prompts, params)
    compiled = ContinuousGenerator(decoder, max_batch_size=3, block_size=8, compile=True).generate(prompts, params)
    assert [c.token_ids for c in compiled] == [c.token_ids for c in eager]


def test_an_offline_batch_padded_to_its_compiled_graph_compiles_nothing_as_it_shrinks_and_keeps_its_tokens():
    """`pad_to_compiled` (what `overdrive run` sets): once a batch of 4 has compiled its step, the same prompts with
    answers of different lengths (the batch shrinking 4 → 1) run padded to that graph, compiling none, and each
    request keeps the tokens it gets alone (padding rows and masked slots change nothing in a row)."""
    from overdrive.core.measure import compiled_graphs

    decoder = Decoder.from_hf(_hf())
    prompts, params = _prompts(4, seed=11), _lengths(4)
    gen = ContinuousGenerator(decoder, max_batch_size=4, block_size=8, compile=True, pad_to_compiled=True)
    gen.generate(prompts, [SamplingParams(max_new_tokens=2)] * 4)  # the warm-up: a batch of 4
    before = compiled_graphs()
    padded = gen.generate(prompts, params)
    assert compiled_graphs() == before and {shape[0] for shape in gen._shapes} == {4}
    eager = ContinuousGenerator(decoder, max_batch_size=4, block_size=8).generate(prompts, params)
    assert [c.token_ids for c in padded] == [c.token_ids for c in eager]
    assert len({len(c.token_ids) for c in padded}) > 1  # the batch did shrink


def test_a_compiled_step_in_a_servers_engine_thread_may_build_more_than_dynamos_default_8_graphs(monkeypatch):
    """A server steps the generator in a thread of its own; torch ≥ 2.13 keeps a config value set by the user per
    thread, so a recompile limit raised in the main thread left the engine thread at 8 graphs, and the ninth shape
    (prompts of 69+ tokens at 32 streams) failed every request in the step."""
    import threading

    import overdrive.generate.engine as engine

    compile_ = torch.compile  # Dynamo's graphs without Inductor's code: the limit is Dynamo's, the test seconds
    monkeypatch.setattr(engine.torch, "compile", lambda model, **kw: compile_(model, backend="eager", dynamic=False,
                                                                             fullgraph=True))
    decoder = Decoder.from_hf(_hf())
    g = torch.Generator().manual_seed(30)
    prompts = [torch.randint(1, VOCAB, (3 + 4 * i,), generator=g).tolist() for i in range(12)]
    params = [SamplingParams(max_new_tokens=3)] * len(prompts)
    eager = ContinuousGenerator(decoder, max_batch_size=1, block_size=4).generate(prompts, params)
    compiled = ContinuousGenerator(decoder, max_batch_size=1, block_size=4, compile=True)
    compiled.SLOT_ROUNDING = 4  # a graph per 4 slots: one request at a time, 12 prompts of 3 to 47 tokens meet 12
    result = {}

    def engine_thread():
        try:
            result["out"] = compiled.generate(prompts, params)
        except Exception as exc:  # noqa: BLE001 — reported below
            result["error"] = exc

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    assert [c.token_ids for c in result["out"]] == [c.token_ids for c in eager]


def test_an_int8_paged_cache_gives_the_int8_contiguous_caches_tokens():
    decoder = Decoder.from_hf(_hf())
    prompts, params = _prompts(6, seed=10), _lengths(6)
    paged = ContinuousGenerator(decoder, max_batch_size=3, block_size=4, cache_dtype=torch.int8)
    contiguous = Generator(decoder, max_batch_size=1, cache_dtype=torch.int8)
    assert [c.token_ids for c in paged.generate(prompts, params)] == \
        [contiguous.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert paged.cache.keys[0].dtype == torch.int8


def test_stop_tokens_end_a_request_early_and_step_reports_each_token():
    decoder = Decoder.from_hf(_hf())
    prompt = _prompts(1, seed=11)[0]
    free = ContinuousGenerator(decoder, max_batch_size=2).generate([prompt], SamplingParams(max_new_tokens=8))[0]
    stop = free.token_ids[3]
    gen = ContinuousGenerator(decoder, max_batch_size=2)
    first = gen.submit(prompt, SamplingParams(max_new_tokens=8, stop_token_ids=stop))
    second = gen.submit(prompt, SamplingParams(max_new_tokens=8))
    events = []
    while gen.has_unfinished:
        events += gen.step()
    ended = {e.request_id: e.finished for e in events if e.finished is not None}
    assert ended[first].token_ids == free.token_ids[:free.token_ids.index(stop) + 1]
    assert ended[first].finish_reason == "stop" and ended[second].finish_reason == "length"
    assert [e.token_id for e in events if e.request_id == second] == free.token_ids


def test_a_request_alone_gets_its_first_token_from_the_step_that_prefilled_it_and_others_keep_decoding(monkeypatch):
    """Time to first token is the prefill's: with nothing running, the step that prefills a request returns its first
    token without a decode step after it; with a request running, a joiner's step still decodes the running one."""
    decoder = Decoder.from_hf(_hf())
    prompts = _prompts(2, seed=12)
    gen = ContinuousGenerator(decoder, max_batch_size=2)
    decodes = []
    decode = gen._decode_running
    monkeypatch.setattr(gen, "_decode_running", lambda events: (decodes.append(len(gen.running)), decode(events)))
    alone = gen.submit(prompts[0], SamplingParams(max_new_tokens=6))
    assert [e.request_id for e in gen.step()] == [alone] and decodes == []  # prefill only: its first token
    assert [e.request_id for e in gen.step()] == [alone] and decodes == [1]
    joiner = gen.submit(prompts[1], SamplingParams(max_new_tokens=6))
    assert sorted(e.request_id for e in gen.step()) == [alone, joiner, joiner] and decodes == [1, 2]  # all decoded
    while gen.has_unfinished:
        gen.step()
    expected = _hf_greedy(_hf(), prompts, new=6)
    assert [c.token_ids for c in gen.generate(prompts, SamplingParams(max_new_tokens=6))] == expected


def test_requests_that_cannot_fit_are_refused_before_taking_blocks():
    decoder = Decoder.from_hf(_hf())  # 128 positions
    gen = ContinuousGenerator(decoder, max_batch_size=2, block_size=4, num_blocks=5)  # 16 slots in all
    with pytest.raises(ValueError, match="exceeds the model's 128 positions"):
        gen.submit([1] * 100, SamplingParams(max_new_tokens=40))
    with pytest.raises(ValueError, match="needs 5 KV blocks; the pool holds 4"):
        gen.submit([1] * 10, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="out of|vocabulary|must be in"):
        gen.generate([[1, 2], [10**6]], SamplingParams(max_new_tokens=2))
    assert not gen.has_unfinished and gen.pool.num_free == 4  # the refused batch left nothing queued
    gen.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="still running"):
        gen.generate([[1, 2]])


@pytest.mark.parametrize("bad", [dict(block_size=0), dict(block_size=-1), dict(block_size=2.5), dict(max_batch_size=0),
                                 dict(max_prefill_tokens=0), dict(block_size=True)])
def test_settings_that_cannot_work_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an integer ≥ 1"):
        ContinuousGenerator(Decoder.from_hf(_hf()), **bad)


def test_the_block_pool_refuses_a_double_free():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {1, 2} and pool.num_free == 1
    pool.free([a])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a])
    with pytest.raises(ValueError, match="not of this pool"):
        pool.free([0])


def test_a_request_that_fails_while_joining_gives_its_blocks_back(monkeypatch):
    gen = ContinuousGenerator(Decoder.from_hf(_hf()), max_batch_size=2, block_size=4)
    monkeypatch.setattr(gen, "_choose", lambda logits, seqs: (_ for _ in ()).throw(RuntimeError("boom")))
    gen.submit(_prompts(1)[0], SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="boom"):
        gen.step()
    assert gen.pool.num_free == gen.pool.capacity


def test_static_scheduling_admits_a_batch_only_when_the_last_has_ended_and_gives_the_same_tokens():
    decoder = Decoder.from_hf(_hf())
    prompts, params = _prompts(7, seed=12), _lengths(7)
    continuous = ContinuousGenerator(decoder, max_batch_size=3, block_size=4)
    static = ContinuousGenerator(decoder, max_batch_size=3, block_size=4, scheduling="static")
    assert [c.token_ids for c in static.generate(prompts, params)] == \
        [c.token_ids for c in continuous.generate(prompts, params)]
    assert static.stats.steps > continuous.stats.steps  # rows that ended early waited for their batch's longest
    with pytest.raises(ValueError, match="scheduling"):
        ContinuousGenerator(decoder, scheduling="dynamic")


def _chunk_log(gen: ContinuousGenerator, monkeypatch) -> list[list[tuple[int, int]]]:
    """Each prefill forward of `gen` as [(request id, tokens it prefilled)]."""
    log = []
    real = gen._prefill
    monkeypatch.setattr(gen, "_prefill", lambda chunks: log.append([(s.request_id, len(c)) for s, c in chunks])
                        or real(chunks))
    return log


def test_requests_joining_together_are_prefilled_in_one_forward_within_the_budget(monkeypatch):
    decoder = Decoder.from_hf(_hf())
    prompts, params = _prompts(8, seed=13), _lengths(8)
    expected = [c.token_ids for c in ContinuousGenerator(decoder, max_batch_size=1).generate(prompts, params)]
    gen = ContinuousGenerator(decoder, max_batch_size=8, max_prefill_tokens=20)
    log = _chunk_log(gen, monkeypatch)
    assert [c.token_ids for c in gen.generate(prompts, params)] == expected  # left padding changes no token
    assert max(len(forward) for forward in log) > 1  # several joined in one forward ...
    assert all(sum(n for _, n in forward) <= 20 for forward in log)  # ... within the step's budget
    for i, prompt in enumerate(prompts):  # every prompt token prefilled once, in chunks if the budget cut it
        assert sum(n for forward in log for r, n in forward if r == i) == len(prompt)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode_and_gives_hugging_faces_tokens(
        kind, monkeypatch):
    """Chunked prefill (Sarathi): a 40-token prompt joins a running batch under a budget of 8 tokens a step; its
    chunks sit at their own positions (gpt2's learned position embeddings read them), and the running sequences get
    a token at every step meanwhile."""
    hf = _hf(kind)
    g = torch.Generator().manual_seed(21)
    long = torch.randint(1, 90, (40,), generator=g).tolist()
    prompts = _prompts(3, seed=22) + [long]
    params = [SamplingParams(max_new_tokens=12)] * 3 + [SamplingParams(max_new_tokens=6)]
    gen = ContinuousGenerator(Decoder.from_hf(hf), max_batch_size=4, block_size=4, max_prefill_tokens=8)
    log = _chunk_log(gen, monkeypatch)
    for p, q in zip(prompts[:3], params):
        gen.submit(p, q)
    done, produced = {}, []
    while len(gen.running) < 3:
        gen.step()
    gen.submit(long, params[3])
    while gen.has_unfinished:
        events = gen.step()
        produced.append({e.request_id for e in events})
        done.update((e.request_id, e.finished.token_ids) for e in events if e.finished is not None)
    long_chunks = [n for forward in log for r, n in forward if r == 3]
    assert long_chunks == [8, 8, 8, 8, 8]
    assert all({0, 1, 2} <= ids for ids in produced[:4])  # the long prompt's chunks stalled nobody's next token
    expected = _hf_greedy(hf, prompts, new=12)
    assert [done[i] for i in range(4)] == [e[:q.max_new_tokens] for e, q in zip(expected, params)]
    assert gen.pool.num_free == gen.pool.capacity


def test_a_cancelled_request_partway_through_its_prefill_gives_its_blocks_back():
    gen = ContinuousGenerator(Decoder.from_hf(_hf()), max_batch_size=2, block_size=4, max_prefill_tokens=4)
    rid = gen.submit(list(range(1, 30)), SamplingParams(max_new_tokens=3))
    gen.step()
    assert [s.request_id for s in gen.prefilling] == [rid] and gen.pool.num_free < gen.pool.capacity
    assert gen.cancel(rid) and not gen.has_unfinished and gen.pool.num_free == gen.pool.capacity


# -- prefix caching -----------------------------------------------------------------------------------------------

def test_the_prefix_cache_matches_exact_prefixes_only_and_forgets_what_it_evicts():
    pool = BlockPool(4)  # 3 usable blocks
    a, b = pool.allocate(), pool.allocate()
    after_a = pool.register(a, -1, (1, 2, 3, 4))
    pool.register(b, after_a, (5, 6, 7, 8))
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [a, b]
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7], 4) == [a]  # whole blocks only
    assert pool.lookup([1, 2, 3, 4, 9, 6, 7, 8], 4) == [a] and pool.lookup([5, 6, 7, 8], 4) == []  # by position
    pool.free([a])
    pool.free([b])  # nobody holds them: kept, a the least recently released
    assert pool.num_free == 3 and pool.num_cached == 2
    assert pool.unheld([a, b]) == 2
    c = pool.allocate()  # the free block first ...
    assert c not in (a, b) and pool.num_cached == 2
    assert pool.allocate() == a  # ... then the least recently used cached one, its registration dropped
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7, 8], 4) == []
    # the same tokens again in block a: a new content, so b (computed after the old one) is not its successor
    pool.register(a, -1, (1, 2, 3, 4))
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7, 8], 4) == [a]
    pool.free([a, c])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a])


def test_a_block_computed_twice_is_registered_once_and_the_copy_is_freed():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    first = pool.register(a, -1, (1, 2))
    assert pool.register(b, -1, (1, 2)) == first  # the same content: a's id, and b stays unregistered
    pool.free([b])
    assert pool.num_cached == 0 and pool.num_free == 2
    pool.acquire(pool.lookup([1, 2, 3], 2))
    pool.free([a])
    pool.free([a])  # two holders, two frees
    assert pool.num_cached == 1 and pool.num_free == 3


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_shared_prompt_prefix_is_computed_once_and_gives_hugging_faces_tokens(kind, monkeypatch):
    hf = _hf(kind)
    g = torch.Generator().manual_seed(21)
    system = torch.randint(1, VOCAB, (21,), generator=g).tolist()  # 5 whole blocks of 4 and one token
    prompts = [system + torch.randint(1, VOCAB, (2 + i,), generator=g).tolist() for i in range(5)] + [system]
    params = _lengths(len(prompts))
    gen = ContinuousGenerator(Decoder.from_hf(hf), max_batch_size=3, block_size=4)
    prefilled = []
    prefill = gen._prefill
    monkeypatch.setattr(gen, "_prefill", lambda chunks: prefilled.extend(len(c) for _, c in chunks) or prefill(chunks))
    first = gen.generate(prompts[:1], params[:1])
    rest = gen.generate(prompts[1:], params[1:])
    expected = _hf_greedy(hf, prompts, new=13)
    assert [c.token_ids for c in first + rest] == [e[:q.max_new_tokens] for e, q in zip(expected, params)]
    # the later requests took the 5 blocks the first one computed (the system prompt alone: 5 blocks, its last token)
    assert prefilled == [len(prompts[0])] + [len(p) - 20 for p in prompts[1:]]
    assert gen.stats.prefix_hits == 20 * (len(prompts) - 1)
    assert gen.stats.prefix_queries == sum(map(len, prompts))
    assert gen.pool.num_free == gen.pool.capacity and gen.pool.num_cached > 0


def test_prefix_caching_off_computes_every_prompt_and_gives_the_same_tokens():
    decoder = Decoder.from_hf(_hf())
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14, 15]] * 3 + _prompts(3, seed=22)
    params = [SamplingParams(max_new_tokens=6, temperature=0.9, seed=s) for s in range(6)]
    on = ContinuousGenerator(decoder, max_batch_size=2, block_size=4)
    off = ContinuousGenerator(decoder, max_batch_size=2, block_size=4, prefix_caching=False)
    alone = Generator(decoder, max_batch_size=1)
    expected = [alone.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert [c.token_ids for c in on.generate(prompts, params)] == expected
    assert [c.token_ids for c in off.generate(prompts, params)] == expected
    assert on.stats.prefix_hits == 8 and off.stats.prefix_hits == 0  # the third copy: the first's blocks, ended


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_logprobs_are_the_models_log_softmax_in_a_busy_batch_and_in_a_static_one(kind):
    hf = _hf(kind)
    decoder = Decoder.from_hf(hf)
    prompts = _prompts(5, seed=31)
    params = [SamplingParams(max_new_tokens=6, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=3) for i in range(5)]
    busy = ContinuousGenerator(decoder, max_batch_size=3, block_size=4).generate(prompts, params)
    static = Generator(decoder, max_batch_size=2).generate(prompts, params)
    for p, c, s in zip(prompts, busy, static):
        assert c.token_ids == s.token_ids and [e.token_id for e in c.logprobs] == c.token_ids
        with torch.no_grad():  # the model's distribution at each new token's step, the whole sequence at once
            reference = torch.log_softmax(hf(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1].float(), -1)
        got = torch.tensor([e.logprob for e in c.logprobs])
        torch.testing.assert_close(got, reference[torch.arange(len(c.token_ids)), c.token_ids], atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor([e.logprob for e in s.logprobs]), got, atol=1e-4, rtol=0)
        for j, e in enumerate(c.logprobs):
            top = reference[j].topk(3)
            assert [t for t, _ in e.top] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in e.top]), top.values, atol=1e-4, rtol=0)
    assert ContinuousGenerator(decoder).generate(prompts[:1], SamplingParams(max_new_tokens=2))[0].logprobs is None
    with pytest.raises(ValueError, match="logprobs must be from 0 to 20"):
        SamplingParams(logprobs=21)


@requires_cuda
def test_on_cuda_requests_joining_and_leaving_get_hugging_faces_tokens_and_their_alone_samples():
    """The paged pool, block tables and the step's index tensors on a CUDA device (`make gpu-check
    ONLY=serve-generate`): greedy tokens equal Hugging Face's on the CPU, seeded samples in a busy batch equal the
    same request alone, and every block comes back."""
    hf = _hf()
    prompts, params = _prompts(10, seed=4), _lengths(10)
    expected = _hf_greedy(hf, prompts, new=13)
    decoder = Decoder.from_hf(hf.to("cuda"))
    gen = ContinuousGenerator(decoder, max_batch_size=4, block_size=4)
    assert gen.cache.keys[0].device.type == "cuda"
    assert [c.token_ids for c in gen.generate(prompts, params)] == [e[:q.max_new_tokens] for e, q in zip(expected, params)]
    assert gen.pool.num_free == gen.pool.capacity
    sampled = [SamplingParams(max_new_tokens=4 + i, temperature=0.9, top_p=0.95, seed=50 + i) for i in range(6)]
    busy = [c.token_ids for c in gen.generate(prompts[:6], sampled)]
    alone = [ContinuousGenerator(decoder, max_batch_size=1, block_size=4).generate([p], q)[0].token_ids
             for p, q in zip(prompts[:6], sampled)]
    assert busy == alone
