"""minivllm.scheduler without a model: SamplingParams validation, admission checks (RequestTooLong), preemption by
recomputation, and hypothesis runs with random arrivals, prompt and output lengths, pools, block sizes, budgets, caps
and aborts, with and without chunked prefill. A fake model step (as in the 03 notebook) writes each token's "K/V"
into a simulated pool through the block tables and checks, whenever a sequence samples, that its whole context reads
back intact: no block leaked, no request lost or starved, budget and cap never exceeded."""
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minivllm.paged_cache import BlockManager, check_block_invariants
from minivllm.scheduler import (RequestTooLong, SamplingError, SamplingParams, ScheduledBatch, Scheduler,
                                SchedulerConfig, Sequence, SequenceStatus)


# ---------------------------------------------------------------------------------------------------------------
# SamplingParams

def test_sampling_params_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids, p.ignore_eos) == (16, 0, [], [], False)
    assert (p.logprobs, p.seed, p.skip_special_tokens) == (None, None, True)
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="\n").stop == ["\n"] and SamplingParams(top_k=-1).top_k == 0
    assert p.validate() is p


@pytest.mark.parametrize("param,value", [
    ("n", 0), ("n", 1.5), ("n", 17), ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.1), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.5),
    ("presence_penalty", 2.1), ("frequency_penalty", -2.1), ("repetition_penalty", 0.0), ("repetition_penalty", 2.5),
    ("max_tokens", 0), ("max_tokens", True), ("min_tokens", -1), ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("logprobs", 21), ("logprobs", -1), ("seed", 1.5)])
def test_sampling_params_validation_names_the_parameter(param, value):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{param: value}).validate()
    assert e.value.param == param and param in str(e.value)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(SamplingError) as e:
        SamplingParams(max_tokens=4, min_tokens=5).validate()
    assert e.value.param == "min_tokens"
    SamplingParams(max_tokens=None, min_tokens=50).validate()


def test_sequence_bookkeeping():
    bm = BlockManager(4, 4)
    s = Sequence("r", [1, 2, 3], SamplingParams(), bm.new_table())
    assert (s.num_tokens, s.num_prompt_tokens, s.output_token_ids, s.status) == (3, 3, [], SequenceStatus.WAITING)
    s.token_ids.append(9)
    assert (s.num_tokens, s.num_output_tokens, s.output_token_ids) == (4, 1, [9])
    assert s.prompt_token_ids == [1, 2, 3]  # the prompt is not aliased by token_ids
    assert Sequence("r", [1], SamplingParams(), bm.new_table()).seq_id != s.seq_id


# ---------------------------------------------------------------------------------------------------------------
# Admission checks

def make(num_blocks=16, block_size=4, chunked=True, budget=64, cap=8, max_model_len=64, prefix=False):
    "chunked: True (mixed steps), 'separate' (chunks in steps of prompts alone, then decodes alone) or False."
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(cap, budget, max_model_len, bool(chunked), chunked == "separate"), bm), bm


def seq(bm, n, rid="r", base=100, **kw):
    "A request whose prompt is base, base+1, ...: prompts with the same base share their prefixes."
    return Sequence(rid, list(range(base, base + n)), SamplingParams(**kw), bm.new_table())


def test_requests_that_can_never_run_are_refused():
    with pytest.raises(ValueError, match="exceeds the pool"):  # a context longer than the pool is refused up front
        make(num_blocks=4, block_size=4, chunked=True, budget=8, max_model_len=64)
    sched, bm = make(num_blocks=4, block_size=4, chunked=True, budget=8, max_model_len=16)
    with pytest.raises(RequestTooLong, match="empty"):
        sched.add(seq(bm, 0))
    with pytest.raises(RequestTooLong, match="max_model_len"):
        sched.add(seq(bm, 16))                  # 16 prompt tokens leave no room for an output in 4 blocks of 4
    sched.add(seq(bm, 15))                      # chunked: longer than the budget is fine
    nc, bm2 = make(chunked=False, budget=64, max_model_len=64)
    with pytest.raises(RequestTooLong, match="max_model_len"):
        nc.add(seq(bm2, 64))
    nc.add(seq(bm2, 63))
    assert not sched.running and len(sched.waiting) == 1 and len(nc.waiting) == 1


def test_without_chunking_the_budget_must_hold_a_whole_sequence():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(chunked=False, budget=32, max_model_len=64)


# ---------------------------------------------------------------------------------------------------------------
# A fake model step (the 03 notebook's fake_run, with a simulated KV pool)

class FakeModel:
    """Runs scheduled batches like the engine: writes each new token's "K/V" into its slot (what real K/V depend on:
    the token and every token before it), checks the whole context when a sequence samples, publishes full blocks
    to the prefix cache."""
    def __init__(self, sched: Scheduler, max_out: dict[int, int], max_model_len: int):
        self.sched, self.bm, self.max_out, self.max_model_len = sched, sched.block_manager, max_out, max_model_len
        self.pool: dict[int, tuple] = {}
        self.steps = self.preempted = 0

    @staticmethod
    def token(s: Sequence) -> int:
        "The 'sampled' token: a function of the sequence and its position only (so recomputation must agree)."
        return 1000 + (s.seq_id * 7919 + s.num_tokens * 31) % 997

    def run(self, b: ScheduledBatch, was_running: set[int]) -> list[Sequence]:
        cfg, sched, bm = self.sched.config, self.sched, self.bm
        self.steps += 1; self.preempted += len(b.preempted)
        # limits
        assert b.num_tokens <= cfg.max_num_batched_tokens, (b.num_tokens, cfg.max_num_batched_tokens)
        assert len(b.items) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
        assert len({id(s) for s, _ in b.items}) == len(b.items), "a sequence twice in one step"
        kinds = [n > 1 or s.num_computed == 0 for s, n in b.items]     # prefill rows, by their shape
        assert kinds == [i < b.num_prefill for i in range(len(b.items))], "prefill rows first, as many as num_prefill"
        if not cfg.enable_chunked_prefill:
            prefill = [id(s) not in was_running and n == s.num_tokens - s.num_computed for s, n in b.items]
            decode = [id(s) in was_running and n == 1 and s.num_computed == s.num_tokens - 1 for s, n in b.items]
            assert all(prefill) or all(decode), "without chunking a step is all whole prefills or all decodes"
        if cfg.separate_prefill:  # a decode of a running sequence never shares a step with a prompt's tokens
            decode = [id(s) in was_running and n == 1 and s.num_computed == s.num_tokens - 1 for s, n in b.items]
            assert all(decode) or not any(decode), "separate steps: all decodes or none"
        if not bm.enable_prefix_caching:
            assert all(s.num_computed == 0 for s, _ in b.items if id(s) not in was_running)
        for s, n in b.items:
            assert s.status == SequenceStatus.RUNNING and s in sched.running
            assert 1 <= n <= s.num_tokens - s.num_computed
            assert s.block_table.num_tokens == s.num_computed + n, "slots reserved must match the work"
        for s in b.preempted:
            assert s.status == SequenceStatus.WAITING and s.num_computed == 0 and not s.block_table.blocks
        # memory
        scheduled = {id(s) for s, _ in b.items}
        for s in sched.running:
            if id(s) not in scheduled: assert s.block_table.num_tokens == s.num_computed
        for s in sched.waiting:
            assert s.num_computed == 0 and not s.block_table.blocks and s.block_table.num_tokens == 0
        check_block_invariants(bm, [s.block_table for s in sched.running])
        # the step: write, then every sequence that has computed all its tokens reads its context and samples
        sampled = []
        for s, n in b.items:
            for p in range(s.num_computed, s.num_computed + n):
                self.pool[s.block_table.slot(p)] = tuple(s.token_ids[:p + 1])
            s.num_computed += n
            bm.register_full_blocks(s.block_table, s.token_ids, s.num_computed)
            if s.num_computed == s.num_tokens:
                ctx = [self.pool.get(s.block_table.slot(p)) for p in range(s.num_tokens)]
                assert ctx == [tuple(s.token_ids[:p + 1]) for p in range(s.num_tokens)], "context overwritten"
                s.token_ids.append(self.token(s))
                sampled.append(s)
                if s.num_output_tokens >= self.max_out[s.seq_id] or s.num_tokens >= self.max_model_len:
                    sched.finish(s, "length")
                    assert not s.block_table.blocks
        return sampled


def expected_output(s: Sequence, max_out: int, max_model_len: int) -> list[int]:
    "What the fake model generates for s, run alone with all the memory it wants."
    t = Sequence(s.request_id, s.prompt_token_ids, s.params, None, seq_id=s.seq_id)
    while t.num_output_tokens < max_out and t.num_tokens < max_model_len: t.token_ids.append(FakeModel.token(t))
    return t.output_token_ids


def drive(sched, bm, arrivals, max_out, max_model_len, aborts=(), max_steps=20000):
    "Run to completion: arrivals (step, seq), aborts (step, seq). Fails on a livelock or a step limit."
    fake = FakeModel(sched, max_out, max_model_len)
    pending = sorted(arrivals, key=lambda a: a[0])
    aborts = sorted(aborts, key=lambda a: a[0])
    step = 0
    while pending or sched.has_unfinished:
        while pending and pending[0][0] <= step: sched.add(pending.pop(0)[1])
        while aborts and aborts[0][0] <= step:
            s = aborts.pop(0)[1]
            if s.status != SequenceStatus.FINISHED and (s in sched.running or s in sched.waiting):
                sched.finish(s, "abort")
                assert not s.block_table.blocks and s not in sched.running and s not in sched.waiting
        was_running = {id(s) for s in sched.running}
        b = sched.schedule()
        if b.items: fake.run(b, was_running)
        else: assert not sched.has_unfinished, f"livelock: nothing scheduled, {sched.waiting}, {sched.running}"
        step += 1
        assert step < max_steps
    return fake


# ---------------------------------------------------------------------------------------------------------------
# The notebook's two runs, checked

@pytest.mark.parametrize("chunked,budget", [(False, 48), (True, 8), ("separate", 8)])
def test_four_prompts_in_a_small_pool(chunked, budget):
    sched, bm = make(num_blocks=14, block_size=4, chunked=chunked, budget=budget, max_model_len=48)
    seqs = [seq(bm, 10, f"r{i}") for i in range(4)]
    fake = drive(sched, bm, [(0, s) for s in seqs], {s.seq_id: 14 for s in seqs}, 48)
    assert [s.output_token_ids for s in seqs] == [expected_output(s, 14, 48) for s in seqs]
    assert all(s.finish_reason == "length" for s in seqs)
    assert bm.num_free_blocks == 14
    assert sched.num_preemptions > 0 and fake.preempted == sched.num_preemptions
    print(f"chunked={chunked}: {fake.steps} steps, {sched.num_preemptions} preemptions, every block back")


def test_preemption_takes_the_most_recently_admitted_and_queues_it_first():
    sched, bm = make(num_blocks=6, block_size=2, chunked=False, budget=64, max_model_len=12)
    a, b = seq(bm, 3, "a"), seq(bm, 3, "b")
    sched.add(a); sched.add(b)
    batch = sched.schedule()                   # both admitted: 2 blocks each, b leaving 1 of headroom for a
    assert [s for s, _ in batch.items] == [a, b] and bm.num_free_blocks == 2
    for s, n in batch.items: s.num_computed += n; s.token_ids.append(1)
    batch = sched.schedule()                   # decode position 3: still in 2 blocks
    for s, n in batch.items: s.num_computed += n; s.token_ids.append(1)
    batch = sched.schedule()                   # position 4: a third block each, the last 2 free ones
    for s, n in batch.items: s.num_computed += n; s.token_ids.append(1)
    assert bm.num_free_blocks == 0
    for s, n in sched.schedule().items: s.num_computed += n; s.token_ids.append(1)  # position 5 fits
    batch = sched.schedule()                   # position 6: a needs a block -> b (admitted last) is preempted
    assert batch.preempted == [b] and [s for s, _ in batch.items] == [a]
    assert b.status == SequenceStatus.WAITING and b.num_computed == 0 and b.num_preemptions == 1
    assert list(sched.waiting) == [b] and sched.num_preemptions == 1
    assert b.token_ids[3:] == [1, 1, 1, 1] and b.num_tokens == 7  # its output is kept, to be recomputed
    check_block_invariants(bm, [a.block_table])


def test_prefill_leaves_a_block_of_headroom_per_running_sequence():
    sched, bm = make(num_blocks=5, block_size=4, chunked=False, budget=64, max_model_len=20)
    a, b = seq(bm, 8, "a"), seq(bm, 8, "b")
    sched.add(a); sched.add(b)
    batch = sched.schedule()                   # a: 2 blocks; b would need 2 + 1 headroom for a: 3 free -> fits
    assert [s for s, _ in batch.items] == [a, b]
    sched2, bm2 = make(num_blocks=4, block_size=4, chunked=False, budget=64, max_model_len=16)
    a, b = seq(bm2, 8, "a"), seq(bm2, 8, "b")
    sched2.add(a); sched2.add(b)
    batch = sched2.schedule()                  # b needs 2 + 1 headroom, only 2 free: waits
    assert [s for s, _ in batch.items] == [a] and list(sched2.waiting) == [b]


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decodes_flowing():
    sched, bm = make(num_blocks=64, block_size=4, chunked=True, budget=8, max_model_len=64)
    short, long_ = seq(bm, 3, "short"), seq(bm, 30, "long")
    sched.add(short)
    b = sched.schedule(); assert b.items == [(short, 3)]
    short.num_computed += 3; short.token_ids.append(1)
    sched.add(long_)
    chunks = []
    while sum(chunks) < 30:
        b = sched.schedule()
        assert b.num_tokens <= 8 and (short, 1) in b.items         # the decode rides along every step
        assert b.items[-1] == (short, 1)                            # decode rows last
        for s, n in b.items:
            s.num_computed += n
            if s is long_: chunks.append(n)
            if s.num_computed == s.num_tokens: s.token_ids.append(1)
    assert chunks == [7, 7, 7, 7, 2] and sum(chunks) == 30


def test_finish_frees_waiting_and_running_sequences():
    sched, bm = make(num_blocks=8, block_size=4, chunked=True, budget=6, max_model_len=32)
    a, b, c = seq(bm, 10, "a"), seq(bm, 5, "b"), seq(bm, 5, "c")
    for s in (a, b, c): sched.add(s)
    sched.schedule()                           # a gets a 6-token chunk (2 blocks), b and c wait
    assert a.block_table.blocks and list(sched.waiting) == [b, c]
    sched.finish(a, "abort")                   # abort mid-prefill
    sched.finish(c, "abort")                   # abort while waiting
    assert bm.num_free_blocks == 8 and list(sched.waiting) == [b] and not sched.running
    assert (a.status, a.finish_reason, c.finish_reason) == (SequenceStatus.FINISHED, "abort", "abort")


# ---------------------------------------------------------------------------------------------------------------
# Hypothesis: random arrivals, lengths, pools, budgets, caps, aborts

@st.composite
def workloads(draw, chunked: bool):
    block_size = draw(st.integers(1, 8), label="block_size")
    max_model_len = draw(st.integers(4, 64), label="max_model_len")
    # the engine keeps max_model_len within what the pool holds (see test_pool_smaller_than_max_model_len)
    num_blocks = -(-max_model_len // block_size) + draw(st.sampled_from([0, 0, 0, 1, 2, 4, 10]), label="extra_blocks")
    budget = (draw(st.integers(1, 48), label="budget") if chunked
              else max_model_len + draw(st.integers(0, 32), label="extra_budget"))
    cap = draw(st.integers(1, 6), label="cap")
    n = draw(st.integers(1, 10), label="requests")
    reqs = [(draw(st.integers(0, 30), label="arrival"), draw(st.integers(0, max_model_len + 4), label="prompt"),
             draw(st.integers(1, 40), label="max_out"), draw(st.one_of(st.none(), st.integers(0, 60)), label="abort_at"),
             draw(st.sampled_from([100, 100, 200]), label="prompt_family")) for _ in range(n)]
    return block_size, max_model_len, num_blocks, budget, cap, reqs


def run_workload(chunked, prefix, block_size, max_model_len, num_blocks, budget, cap, reqs):
    sched, bm = make(num_blocks, block_size, chunked, budget, cap, max_model_len, prefix)
    arrivals, aborts, max_out, accepted = [], [], {}, []
    for i, (t, plen, mo, abort_at, family) in enumerate(reqs):
        s = seq(bm, plen, f"r{i}", base=family)
        fits = 1 <= plen < max_model_len and (chunked or plen <= budget)
        try:
            sched.check_prompt(plen)
        except RequestTooLong:
            assert not fits, f"a {plen}-token prompt that fits was refused"
            with pytest.raises(RequestTooLong): sched.add(s)        # add() refuses it the same way
            continue
        assert fits, f"a {plen}-token prompt that can never run was accepted"
        arrivals.append((t, s)); max_out[s.seq_id] = mo; accepted.append((s, mo))
        if abort_at is not None: aborts.append((abort_at, s))
    fake = drive(sched, bm, arrivals, max_out, max_model_len, aborts)
    aborted = [s for s, _ in accepted if s.finish_reason == "abort"]
    for s, mo in accepted:  # no request lost: each one finished, by length with exactly its tokens, or aborted
        assert s.status == SequenceStatus.FINISHED
        if s.finish_reason != "abort": assert s.output_token_ids == expected_output(s, mo, max_model_len)
    assert bm.num_free_blocks == num_blocks and all(r == 0 for r in bm.allocator.ref_counts)
    assert not sched.running and not sched.waiting
    return fake, len(accepted), len(aborted), bm.prefix_hits


def run_and_label(chunked, prefix, w):
    "run_workload, labelling what hypothesis drew (see --hypothesis-show-statistics)."
    fake, _, _, hits = run_workload(chunked, prefix, *w)
    event(f"preemptions: {'none' if not fake.preempted else '1-4' if fake.preempted < 5 else '5+'}")
    if prefix: event(f"prefix cache hits: {'none' if not hits else 'some'}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads(chunked=True))
@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_random_workloads_chunked(prefix, w):
    run_and_label(True, prefix, w)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads(chunked=True))
@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_random_workloads_separate_steps(prefix, w):
    run_and_label("separate", prefix, w)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads(chunked=False))
def test_random_workloads_without_chunking(w):
    run_and_label(False, False, w)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads(chunked=False))
def test_random_workloads_without_chunking_prefix_cache(w):
    run_and_label(False, True, w)


def test_prefix_hit_of_all_but_one_token_then_a_prefill_without_chunking():
    sched, bm = make(num_blocks=16, block_size=4, chunked=False, budget=64, max_model_len=64, prefix=True)
    first = seq(bm, 9, "first")
    drive(sched, bm, [(0, first)], {first.seq_id: 1}, 64)           # publishes its 2 full blocks
    again, other = seq(bm, 9, "again"), seq(bm, 6, "other", base=300)  # 8 of 9 cached: 1 token left
    sched.add(again); sched.add(other)
    b = sched.schedule()
    assert sorted((s.request_id, n, s.num_computed) for s, n in b.items) == [("again", 1, 8), ("other", 6, 0)]
    # the 1-token rest of the cache hit is a decode row, after the one prefill row
    assert b.num_prefill == 1 and [s.request_id for s, _ in b.items] == ["other", "again"], b.items


@pytest.mark.parametrize("chunked,prefix", [
    (True, False), (True, True), (False, False), (False, True), ("separate", False), ("separate", True)])
def test_a_busy_workload_preempts_and_recovers(chunked, prefix):
    "A fixed heavy case, so that preemption under load is exercised on every run (hypothesis may draw light ones)."
    import random
    rng = random.Random(1)
    reqs = [(rng.randint(0, 10), rng.randint(1, 40), rng.randint(5, 20), None, rng.choice([100, 200]))
            for _ in range(12)]
    sched_fake, n, _, _ = run_workload(chunked, prefix, 4, 64, 20, 24 if chunked else 64, 6, reqs)
    print(f"chunked={chunked}, prefix caching={prefix}: {n} requests, {sched_fake.steps} steps, "
          f"{sched_fake.preempted} preemptions")
    assert sched_fake.preempted > 0


def test_prefix_cache_hits_skip_computed_blocks():
    sched, bm = make(num_blocks=32, block_size=4, chunked=True, budget=64, max_model_len=64, prefix=True)
    a = seq(bm, 10, "a")
    drive(sched, bm, [(0, a)], {a.seq_id: 3}, 64)
    b = seq(bm, 14, "b")                        # shares a's first 10 prompt tokens: 2 full blocks are cached
    sched.add(b)
    batch = sched.schedule()
    assert batch.items == [(b, 6)] and b.num_computed == 8 and b.num_cached_tokens == 8
    assert bm.prefix_hits == 8


def step(sched):
    "One scheduled step with a fake model: every sequence that samples gets token 1; (request, new tokens) pairs."
    batch = sched.schedule()
    sched.update(batch, [(s, 1) for s in batch.sampling])
    return sorted((s.request_id, n) for s, n in batch.items)


@pytest.mark.parametrize("chunked", [True, False])
def test_requests_sharing_a_prefix_that_arrive_together_compute_it_once(chunked):
    sched, bm = make(num_blocks=32, block_size=4, chunked=chunked, budget=64, max_model_len=64, prefix=True)
    a, b, c = (Sequence(r, list(range(8)) + [50 + i] * (2 + i), SamplingParams(max_tokens=2), bm.new_table())
               for i, r in enumerate("abc"))  # the same 2 full blocks, then 2, 3 and 4 tokens of their own
    other = seq(bm, 6, "other", base=300, max_tokens=2)  # shares nothing: not held up behind b and c
    for s in (a, b, c, other): sched.add(s)
    assert step(sched) == [("a", 10), ("other", 6)]   # b and c wait for the blocks a is computing
    assert list(sched.waiting) == [b, c]
    prefix_blocks = a.block_table.blocks[:2]
    batch_two = step(sched)                          # a's blocks are published: b and c find 8 tokens cached
    assert ("b", 3) in batch_two and ("c", 4) in batch_two
    assert b.num_cached_tokens == c.num_cached_tokens == 8 and bm.prefix_hits == 16
    assert b.block_table.blocks[:2] == c.block_table.blocks[:2] == prefix_blocks  # one copy of the prefix's K/V
    while sched.has_unfinished: step(sched)
    assert [s.output_token_ids for s in (a, b, c, other)] == [[1, 1]] * 4
    assert bm.num_free_blocks == 32


def test_a_long_shared_prefix_is_waited_for_across_chunks():
    "The first request's prefix takes three chunks: the second waits for all of it, then computes its tail only."
    sched, bm = make(num_blocks=32, block_size=4, chunked=True, budget=8, max_model_len=64, prefix=True)
    a, b = (Sequence(r, list(range(20)) + [t], SamplingParams(max_tokens=1), bm.new_table())
            for r, t in (("a", 90), ("b", 91)))
    sched.add(a); sched.add(b)
    assert step(sched) == [("a", 8)] and step(sched) == [("a", 8)]  # b waits; the budget is a's
    assert step(sched) == [("a", 5)]
    assert step(sched) == [("b", 1)] and b.num_cached_tokens == 20  # 5 blocks shared, 1 token of its own
    assert not sched.has_unfinished and bm.num_free_blocks == 32


def test_without_prefix_caching_nobody_waits():
    sched, bm = make(num_blocks=32, block_size=4, chunked=True, budget=64, max_model_len=64, prefix=False)
    a, b = seq(bm, 10, "a"), seq(bm, 10, "b")
    sched.add(a); sched.add(b)
    assert step(sched) == [("a", 10), ("b", 10)]


@pytest.mark.parametrize("chunked", [True, False])
def test_pool_smaller_than_max_model_len(chunked):
    "Either the configuration is refused up front, or the request is refused by add(), or it finishes."
    bm = BlockManager(4, 4)                    # 16 token slots
    try:
        sched = Scheduler(SchedulerConfig(4, 64, 64, chunked), bm)
        s = seq(bm, 10)
        sched.check_prompt(s.num_prompt_tokens)           # what add() checks (drive() adds it)
    except (ValueError, RequestTooLong):
        return
    drive(sched, bm, [(0, s)], {s.seq_id: 20}, 64, max_steps=200)
    assert s.finish_reason == "length"


# ---------------------------------------------------------------------------------------------------------------
# The scheduler owns the lifecycle: update() counts, appends, forks and stops on tokens

def test_batch_classifies_rows_once():
    sched, bm = make(num_blocks=32, block_size=4, chunked=True, budget=12, prefix=False)
    a, b = seq(bm, 6, "a"), seq(bm, 20, "b", base=500)
    sched.add(a); sched.add(b)
    batch = sched.schedule()                       # a whole (6), b cut to a 6-token chunk
    assert batch.items == [(a, 6), (b, 6)] and batch.num_prefill == 2 and batch.sampling == [a]
    sched.update(batch, [(a, 7)])
    assert (a.num_computed, a.token_ids[-1], b.num_computed, b.num_tokens) == (6, 7, 6, 20)
    batch = sched.schedule()                       # a decodes; b's next chunk is a prefill row, first
    assert batch.items == [(b, 11), (a, 1)] and batch.num_prefill == 1 and batch.sampling == [a]


def test_token_stop_rules():
    sched, bm = make(max_model_len=12)
    sched.eos_token_ids = [2]
    s = seq(bm, 4, max_tokens=5, min_tokens=2, stop_token_ids=[9])
    sched.add(s)
    def step(tok):
        batch = sched.schedule()
        sched.update(batch, [(x, tok) for x in batch.sampling])
        return s.finish_reason, s.stop_reason
    assert step(2) == (None, None)                 # eos before min_tokens: ignored
    assert step(9) == ("stop", 9)                  # a stop token after min_tokens: its id is the stop reason
    s2 = seq(bm, 4, max_tokens=2)
    sched.add(s2)
    for tok in (5, 6):
        b = sched.schedule(); sched.update(b, [(x, tok) for x in b.sampling])
    assert (s2.finish_reason, s2.output_token_ids) == ("length", [5, 6]) and bm.num_free_blocks == bm.num_blocks


def test_forks_share_the_prompt_and_copy_on_write():
    sched, bm = make(num_blocks=32, block_size=4, prefix=False)
    first, *others = [Sequence("r", list(range(10)), SamplingParams(max_tokens=3), bm.new_table(), i) for i in range(4)]
    first.forks = others
    sched.add(first)
    batch = sched.schedule()
    assert batch.sampling == [first] and not any(o.status == SequenceStatus.RUNNING for o in others)
    sched.update(batch, [(s, 100 + s.index) for s in [first, *others]])
    assert bm.num_blocks - bm.num_free_blocks == 3 and len(sched.running) == 4
    assert all(s.block_table.blocks == first.block_table.blocks and s.num_computed == 10 for s in others)
    assert [s.output_token_ids for s in [first, *others]] == [[100], [101], [102], [103]]
    batch = sched.schedule()                       # each writes position 10 into the shared third block
    assert bm.num_blocks - bm.num_free_blocks == 3 + 3 and len(bm.take_copies()) == 3
    check_block_invariants(bm, [s.block_table for s in [first, *others]])
    for s in [first, *others]:
        sched.finish(s, "abort")
    assert bm.num_free_blocks == bm.num_blocks


def test_a_request_whose_forks_exceed_the_cap_is_refused():
    sched, bm = make(cap=2)
    s = seq(bm, 4)
    s.forks = [seq(bm, 4), seq(bm, 4)]
    with pytest.raises(RequestTooLong, match="max_num_seqs"):
        sched.add(s)
