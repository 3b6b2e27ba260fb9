"""Composite drafters: trees whose nodes say which part proposed them (`TokenTree.sources`). The
engine credits each draft node to its part and each accepted token to the part of the accepted
node, per drafter (`DrafterStats.parts`, Prometheus `..._part_tokens_total{drafter,part}`) and per
request (the response's `speculative.parts`). The counts are checked against a count made here
from the trees the drafter proposed and the tokens plain decoding produces (the server side:
tests/e2e/test_drafter_parts_server.py)."""

from __future__ import annotations

from helpers import make_llm_engine, two_part_drafter

from specserve.drafters.base import Drafter, register
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import NO_PARENT, TokenTree

MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46], [9, 10, 9, 10, 9, 10, 9],
           [70, 71, 72, 70, 71, 73, 70, 71]]


COMPOSITE = two_part_drafter()


def count_parts(proposed, continuation: dict[tuple[int, ...], list[int]]) -> dict[tuple[int, ...], dict]:
    """Per prompt, {part: [drafted, accepted]} counted from the proposed trees: under greedy
    verification the accepted path follows, from the root, the child whose token is the next
    token of plain greedy decoding (`continuation`: prompt + enough generated tokens)."""
    out: dict[tuple[int, ...], dict] = {}
    for prompt, length, tree in proposed:
        tally = out.setdefault(prompt, {})
        tokens = continuation[prompt]
        for i in range(1, tree.num_nodes):
            tally.setdefault(tree.part_of(i), [0, 0])[0] += 1
        node, pos = 0, length
        while True:
            nxt = [c for c in range(1, tree.num_nodes) if tree.parents[c] == node and tree.tokens[c] == tokens[pos]]
            if not nxt:
                break
            node, pos = nxt[0], pos + 1
            tally[tree.part_of(node)][1] += 1
    return out


def test_per_part_counts_equal_an_independent_count(tiny_llama_dir):
    # plain decoding, long enough to follow every tree past the last token a request keeps
    longer = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 12, ignore_eos=True)
    plain_engine = make_llm_engine(tiny_llama_dir, [])
    for i, p in enumerate(PROMPTS):
        plain_engine.add_request(f"r{i}", p, longer)
    plain: dict[str, list[int]] = {}
    while plain_engine.has_unfinished_requests():
        for out in plain_engine.step():
            for d in out.outputs:
                plain.setdefault(out.request_id, []).extend(d.token_ids)

    engine = make_llm_engine(tiny_llama_dir, [COMPOSITE, "ngram"])
    stats0 = engine.get_stats().drafters[COMPOSITE]
    assert set(stats0.parts) == {"ngram", "echo"} and all(p.num_draft_tokens == 0 for p in stats0.parts.values())
    got: dict[str, list[int]] = {}
    spec: dict[str, object] = {}
    pending = list(enumerate(PROMPTS))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:       # staggered: prefills, plain decodes and trees share steps
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(out.request_id, []).extend(d.token_ids)
            if out.finished:
                spec[out.request_id] = out.spec
        step += 1
    # lossless: greedy output identical to plain decoding
    assert got == {r: toks[:MAX_TOKENS] for r, toks in plain.items()}

    drafter = engine.drafters[COMPOSITE]
    want = count_parts(drafter.proposed, {tuple(p): p + plain[f"r{i}"] for i, p in enumerate(PROMPTS)})
    stats = engine.get_stats().drafters[COMPOSITE]
    total = {name: [0, 0] for name in ("ngram", "echo")}
    for i, p in enumerate(PROMPTS):
        parts = spec[f"r{i}"].parts
        mine = {name: [ps.num_draft_tokens, ps.num_accepted_tokens] for name, ps in parts.items()}
        nonzero = {name: v for name, v in mine.items() if v != [0, 0]}
        assert nonzero == {name: v for name, v in want[tuple(p)].items() if v != [0, 0]}, f"request r{i}"
        assert sum(v[0] for v in mine.values()) == spec[f"r{i}"].num_draft_tokens
        assert sum(v[1] for v in mine.values()) == spec[f"r{i}"].num_accepted_tokens
        for name, (d, a) in nonzero.items():
            total[name][0] += d
            total[name][1] += a
    assert {n: [p.num_draft_tokens, p.num_accepted_tokens] for n, p in stats.parts.items()} == total
    assert sum(p.num_draft_tokens for p in stats.parts.values()) == stats.num_draft_tokens
    assert sum(p.num_accepted_tokens for p in stats.parts.values()) == stats.num_accepted_tokens
    # both parts proposed and both had tokens accepted (the test sees both sides of the credit)
    assert all(d > 0 and a > 0 for d, a in total.values()), total
    assert stats.num_fallbacks == 0
    # a drafter whose trees carry no sources has no parts
    assert engine.get_stats().drafters["ngram"].parts == {}


def test_snapshot_parts_do_not_move(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir, [COMPOSITE])
    engine.add_request("a", PROMPTS[0], GREEDY)
    for _ in range(6):
        engine.step()
    snap = engine.get_stats().drafters[COMPOSITE]
    before = {n: (p.num_draft_tokens, p.num_accepted_tokens) for n, p in snap.parts.items()}
    while engine.has_unfinished_requests():
        engine.step()
    assert {n: (p.num_draft_tokens, p.num_accepted_tokens) for n, p in snap.parts.items()} == before
    assert engine.get_stats().drafters[COMPOSITE].num_draft_tokens > snap.num_draft_tokens


def test_malformed_sources_fall_back_to_plain_decoding(tiny_llama_dir):
    @register("test_parts_broken")
    class Broken(Drafter):
        def propose(self, seqs, budgets):
            trees = []
            for seq in seqs:
                tree = TokenTree([seq.token_ids[-1], 3], [NO_PARENT, 0], sources=[0, 0], source_names=("a",))
                tree.sources = [0]          # changed after construction: the engine checks again
                trees.append(tree)
            return trees

    plain = make_llm_engine(tiny_llama_dir, [])
    plain.add_request("a", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    want: list[int] = []
    while plain.has_unfinished_requests():
        for out in plain.step():
            want += [t for d in out.outputs for t in d.token_ids]
    engine = make_llm_engine(tiny_llama_dir, ["test_parts_broken"])
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    got: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += [t for d in out.outputs for t in d.token_ids]
    assert got == want
    st = engine.get_stats().drafters["test_parts_broken"]
    assert st.num_fallbacks > 0 and st.num_steps == 0 and st.parts == {}
