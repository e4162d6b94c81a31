"""The embedded engine's prefix cache and prompt forks: what is reused, and that reusing it changes nothing."""

import threading

import pytest
import torch

from rlx.rollout.engines.embedded.prefix import PrefixCache


def kv(ids, layers=2):
    """Fake KV whose values are the ids, so a slice shows which tokens it covers."""
    t = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    return [(t.clone(), -t.clone()) for _ in range(layers)]


def test_longest_prefix_leaving_one_token_to_run():
    c = PrefixCache(1000)
    c.insert([1, 2, 3, 4], kv([1, 2, 3, 4]))
    c.insert([1, 2, 9], kv([1, 2, 9]))
    n, got = c.match([1, 2, 3, 4, 5, 6])
    assert n == 4 and got[0][0].flatten().tolist() == [1, 2, 3, 4] and got[1][1].flatten().tolist() == [-1, -2, -3, -4]
    assert c.match([1, 2, 3, 4])[0] == 3  # the whole request cached: its last token still runs
    assert c.match([1, 2, 9, 9])[0] == 3 and c.match([1, 7])[0] == 1
    assert c.match([5, 6]) is None and c.match([1]) is None and PrefixCache(10).match([1, 2]) is None


def test_an_extended_sequence_replaces_its_prefix_and_held_ones_are_not_added_twice():
    c = PrefixCache(1000)
    c.insert([1, 2, 3], kv([1, 2, 3]))
    c.insert([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))  # the next turn's conversation
    assert list(c.entries) == [(1, 2, 3, 4, 5)] and c.tokens == 5
    c.insert([1, 2, 3], kv([1, 2, 3]))  # inside a held one
    c.insert([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))
    assert list(c.entries) == [(1, 2, 3, 4, 5)] and c.tokens == 5


def test_least_recently_used_entries_go_past_the_budget_and_their_nodes_with_them():
    c = PrefixCache(10)
    c.insert([1, 2, 3, 4], kv([1, 2, 3, 4]))
    c.insert([1, 2, 7, 8], kv([1, 2, 7, 8]))
    c.match([1, 2, 3, 4, 0])  # uses the first: the second is now the oldest
    c.insert([5, 6, 7], kv([5, 6, 7]))  # 11 tokens > 10
    assert list(c.entries) == [(1, 2, 3, 4), (5, 6, 7)] and c.tokens == 7
    assert c.match([1, 2, 7, 8, 9])[0] == 2  # the shared [1, 2] now leads to the first entry
    c.insert([8, 9, 10], kv([8, 9, 10]))  # 10 tokens: none goes
    c.match([5, 6, 7, 0])
    c.insert([11], kv([11]))  # 11 tokens: the least recently used goes, [1, 2, 3, 4], and the nodes only it held
    assert list(c.entries) == [(8, 9, 10), (5, 6, 7), (11,)] and c.tokens == 7
    assert c.match([1, 2, 3]) is None and c.root.children.keys() == {5, 8, 11}
    c.insert(list(range(11)), kv(list(range(11))))  # longer than the whole budget: not kept
    assert list(c.entries) == [(8, 9, 10), (5, 6, 7), (11,)]
    c.clear()
    assert len(c) == 0 and c.tokens == 0 and c.match([5, 6, 7]) is None


def nodes(c):
    todo, n = [c.root], 0
    while todo:
        node = todo.pop()
        n += 1
        todo += node.children.values()
    return n


def test_sequences_that_share_a_prefix_add_a_node_each_not_one_per_token():
    """A radix tree: 64 answers of 20 ids after one 30-id prompt are the prompt's edge and one edge each (the
    first answer's insert splits the prompt's edge once); a lookup that leaves an edge midway still finds its
    prefix."""
    c = PrefixCache(10_000)
    prompt = list(range(100, 130))
    for i in range(64):
        seq = prompt + [1000 + i] + list(range(19))
        c.insert(seq, kv(seq))
    assert len(c) == 64 and nodes(c) == 1 + 1 + 64  # the root, the prompt, an answer each
    n, got = c.match(prompt + [1005, 0, 1, 2, 77, 78])
    assert n == 34 and got[0][0].flatten().tolist() == prompt + [1005, 0, 1, 2]
    assert c.match(prompt[:12] + [5, 5])[0] == 12  # leaves the prompt's edge midway


@pytest.fixture(scope="module")
def engine_parts(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


def generate(scheduler, reqs):
    left, done = [len(reqs)], threading.Event()

    def finished(_r):  # in the scheduler's thread: never block it
        left[0] -= 1
        if not left[0]:
            done.set()

    for r in reqs:
        r.on_done = finished
    scheduler.call(lambda: setattr(scheduler, "paused", True))  # all admitted before the next prefill
    for r in reqs:
        scheduler.submit(r)
    scheduler.call(lambda: setattr(scheduler, "paused", False))
    assert done.wait(60)
    scheduler.call(lambda: None)  # the step that finished them has ended (its prefix-cache inserts come after on_done)
    for r in reqs:
        assert r.finish_reason["type"] == "length", r.finish_reason
    return reqs


def forward_logprobs(model, prompt, output):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0]
    logp = torch.log_softmax(logits, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[pos, torch.tensor(output)].tolist()


def test_samples_of_one_prompt_fork_its_prefill_and_a_second_turn_prefills_only_its_new_tokens(engine_parts):
    """Four samples of a prompt are prefilled once; three more arriving later run one forward from the cache; the
    second turn of a conversation (its first turn's prompt
    and answer, then new tokens) reuses the first turn's KV; a weight update forgets it. Every log-prob still
    equals a plain forward pass of the whole sequence."""
    from rlx.rollout.engines.embedded.scheduler import Request, SamplingParams, Scheduler

    model, tok = engine_parts
    s = Scheduler(model, tok, prefix_cache_tokens=4096, seed=1)
    s.start()
    try:
        prompt = [1, 264, 263, 201, 284, 324, 7, 8]
        params = dict(max_new_tokens=6, temperature=1.0, ignore_eos=True)
        group = generate(s, [Request(list(prompt), SamplingParams(**params)) for _ in range(4)])
        assert s.prefill_batches == 1 and [r.cached_tokens for r in group] == [0, 8, 8, 8]
        for r in group:
            assert r.logprobs == pytest.approx(forward_logprobs(model, prompt, r.output_ids), abs=1e-4)

        late = generate(s, [Request(list(prompt), SamplingParams(**params)) for _ in range(3)])
        assert [r.cached_tokens for r in late] == [7, 8, 8] and s.prefill_batches == 2  # one forward from the cache
        for r in late:
            assert r.logprobs == pytest.approx(forward_logprobs(model, prompt, r.output_ids), abs=1e-4)

        first = group[0]
        turn2 = prompt + first.output_ids + [300, 301, 302]
        (r2,) = generate(s, [Request(list(turn2), SamplingParams(**params))])
        assert r2.cached_tokens == len(prompt) + len(first.output_ids) - 1  # all the KV the first turn computed
        assert r2.logprobs == pytest.approx(forward_logprobs(model, turn2, r2.output_ids), abs=1e-4)
        assert s.prompt_tokens == 7 * 8 + len(turn2) and s.cached_tokens == 3 * 8 + 23 + r2.cached_tokens

        s.call(s.clear_prefix_cache)  # what a weight update does
        (r3,) = generate(s, [Request(list(turn2), SamplingParams(**params))])
        assert r3.cached_tokens == 0
    finally:
        s.shutdown()


def test_prompts_that_hit_the_cache_share_one_forward_with_those_that_miss(engine_parts):
    """RL prompts share a chat template's head, so nearly every prompt hits the cache for a few ids. Prompts of
    ragged lengths, some with a cached prefix, one without, two samples of one of them, are prefilled in one
    forward (a row runs again the cached ids it must to line up with the longest uncached part), and every
    log-prob equals a plain forward pass of the whole sequence."""
    from rlx.rollout.engines.embedded.scheduler import Request, SamplingParams, Scheduler

    model, tok = engine_parts
    s = Scheduler(model, tok, prefix_cache_tokens=4096, seed=3)
    s.start()
    try:
        params = dict(max_new_tokens=5, temperature=1.0, ignore_eos=True)
        head = [1, 264, 263, 201, 284, 324, 7, 8, 9, 10]
        generate(s, [Request(head + [11], SamplingParams(**params))])
        before = s.prefill_batches
        prompts = [head + [40, 41, 42], head + [50], head[:4] + [60, 61, 62, 63, 64], [70, 71, 72, 73]]
        reqs = [Request(list(p), SamplingParams(**params)) for p in prompts] + [Request(list(prompts[0]),
                                                                                         SamplingParams(**params))]
        generate(s, reqs)
        assert s.prefill_batches == before + 1
        # the longest uncached part is 5 ids (the third prompt's): the first prompt runs its last 5 and takes
        # 8 cached ids, the second its last 5 (6 cached), the third 4 cached, the fourth none; its copy forks
        assert [r.cached_tokens for r in reqs] == [8, 6, 4, 0, 13]
        for r in reqs:
            assert r.logprobs == pytest.approx(forward_logprobs(model, r.input_ids, r.output_ids), abs=1e-4)
    finally:
        s.shutdown()


def test_prompts_whose_uncached_parts_differ_a_lot_take_separate_forwards():
    from rlx.rollout.engines.embedded.scheduler import Request, SamplingParams, _chunks, _Prompt

    def prompt(n, cached=0):
        return _Prompt([Request(list(range(n)), SamplingParams())], cached)

    same = [prompt(10), prompt(9, 1), prompt(12, 3), prompt(8)]
    assert _chunks(same) == [same]  # arrival order kept
    long, short = prompt(100), [prompt(20, 10) for _ in range(3)]
    chunks = _chunks([short[0], long, short[1], short[2]])
    assert chunks == [[long], short]  # with one short prompt, 200 ids computed for 110 needed


def test_without_the_cache_nothing_is_reused_but_forks(engine_parts):
    from rlx.rollout.engines.embedded.scheduler import Request, SamplingParams, Scheduler

    model, tok = engine_parts
    s = Scheduler(model, tok, prefix_cache_tokens=0)
    s.start()
    try:
        params = dict(max_new_tokens=3, ignore_eos=True)
        (a,) = generate(s, [Request([5, 6, 7, 8], SamplingParams(**params))])
        (b,) = generate(s, [Request([5, 6, 7, 8] + a.output_ids, SamplingParams(**params))])
        assert b.cached_tokens == 0 and s.prefix is None
    finally:
        s.shutdown()


def test_a_memory_budget_holds_as_many_tokens_as_the_models_kv_fits(engine_parts):
    """By default the budget is memory: sized at the first entry from the KV's own bytes (the tiny model: 2 layers
    x keys and values x 2 heads x 16 dims x 4 bytes = 512 bytes a token), and then evicts by tokens as before."""
    from rlx.rollout.engines.embedded.scheduler import Request, SamplingParams, Scheduler

    model, tok = engine_parts
    c = model.config
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    assert per_token == 512
    s = Scheduler(model, tok, prefix_cache_bytes=20 * per_token + 100)
    s.start()
    try:
        params = dict(max_new_tokens=2, ignore_eos=True)
        generate(s, [Request(list(range(3, 15)), SamplingParams(**params))])
        assert s.prefix.max_tokens == 20 and 0 < s.prefix.tokens <= 20
        generate(s, [Request(list(range(30, 45)), SamplingParams(**params))])  # 15 + 2 more: the first goes
        assert 0 < s.prefix.tokens <= 20 and s.prefix.entries and all(k[0] == 30 for k in s.prefix.entries)
    finally:
        s.shutdown()


def test_the_trie_agrees_with_a_plain_search_through_many_inserts_and_evictions():
    """Random sequences over a small alphabet (so they share prefixes), a budget that keeps evicting: every match
    is the longest prefix any held sequence shares with the request, and its KV holds exactly those ids."""
    import random

    rng = random.Random(0)
    c = PrefixCache(60)
    for _ in range(3000):
        seq = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.5:
            c.insert(seq, kv(seq))
        else:
            want = max((next((i for i, (a, b) in enumerate(zip(k, seq)) if a != b), min(len(k), len(seq)))
                        for k in c.entries), default=0)
            want = min(want, len(seq) - 1)
            got = c.match(seq)
            if want <= 0:
                assert got is None, (seq, list(c.entries))
            else:
                assert got is not None and got[0] == want, (seq, got and got[0], want)
                assert got[1][0][0].flatten().tolist() == seq[:want]
        assert c.tokens == sum(len(k) for k in c.entries) <= 60


def test_a_model_error_during_prefill_fails_the_requests_being_prefilled(engine_parts):
    """They were taken off the queue but not yet running: they must finish with the error (an HTTP 500 abort, as
    SGLang reports one), not wait forever; the engine then serves the next request."""
    from rlx.rollout.engines.embedded.scheduler import Request, SamplingParams, Scheduler

    model, tok = engine_parts
    s = Scheduler(model, tok, prefix_cache_tokens=0)
    real, calls = s.model, []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise IndexError("list index out of range")
        return real(*args, **kwargs)

    s.model = broken
    s.start()
    try:
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        reqs = [Request([5, 6, 7], params), Request([5, 6, 9], params)]
        done = threading.Event()
        left = [len(reqs)]

        def finished(_r):
            left[0] -= 1
            if not left[0]:
                done.set()

        for r in reqs:
            r.on_done = finished
        s.call(lambda: setattr(s, "paused", True))
        for r in reqs:
            s.submit(r)
        s.call(lambda: setattr(s, "paused", False))
        assert done.wait(30), "a request being prefilled when the model failed was never finished"
        for r in reqs:
            assert r.finish_reason["status_code"] == 500 and "IndexError" in r.finish_reason["message"]
        generate(s, [Request([5, 6, 7], params)])  # the engine goes on
    finally:
        s.shutdown()
