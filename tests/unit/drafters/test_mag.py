"""The Max-Gram drafter: the matcher on hand-worked arrays (and against a brute-force oracle), the
bigram table against hand counts and its cache, and greedy losslessness through the engine."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from helpers import make_llm_engine, run_requests

from specserve.drafters import mag
from specserve.drafters.base import make_drafter
from specserve.drafters.mag import (NO_NEXT_TOKEN, bigram_chain, bigram_table, load_bigram_table, max_gram,
                                    max_gram_match)
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import NO_PARENT

# ----------------------------------------------------------------------------- matcher


def brute_force_match(tokens: list[int], leftmost: bool) -> tuple[int, int] | None:
    """(end, length) of the longest suffix with an earlier occurrence (ending before n-1), by definition."""
    n = len(tokens)
    for k in range(n - 1, 0, -1):
        ends = [e for e in range(k - 1, n - 1) if tokens[e - k + 1:e + 1] == tokens[n - k:]]
        if ends:
            return (ends[0] if leftmost else ends[-1]), k
    return None


def test_longest_suffix_wins_over_a_shorter_leftmost_one():
    #        0  1  2  3  4  5  6  7  8  9 10
    toks = [5, 3, 4, 3, 1, 4, 3, 8, 1, 4, 3]
    # `4 3` occurs ending at 3 and 6, `1 4 3` only ending at 6, `3 1 4 3` nowhere
    assert max_gram_match(np.array(toks)) == (6, 3)
    # what followed: 8 1 4 3, then (shift p = 4) the same again
    assert max_gram(np.array(toks), 6) == [8, 1, 4, 3, 8, 1]


def test_leftmost_or_most_recent_occurrence():
    toks = np.array([1, 2, 7, 1, 2, 8, 1, 2])
    assert max_gram_match(toks) == (1, 2)
    assert max_gram_match(toks, leftmost=False) == (4, 2)
    assert max_gram(toks, 4) == [7, 1, 2, 8]
    assert max_gram(toks, 4, leftmost=False) == [8, 1, 2, 8]   # p = 3: loops over `8 1 2`


def test_no_match():
    assert max_gram_match(np.array([1, 2, 3])) is None          # 3 occurs only as the suffix itself
    assert max_gram_match(np.array([4])) is None
    assert max_gram(np.array([1, 2, 3]), 5) == []
    assert max_gram(np.array([1, 2, 1]), 0) == []


def test_match_at_the_end_has_no_continuation_of_its_own_and_loops():
    # `4` occurred at 1, right before the suffix: the only thing that "followed" is the suffix itself
    toks = np.array([9, 4, 4])
    assert max_gram_match(toks) == (1, 1)
    assert max_gram(toks, 3) == [4, 4, 4]
    # the worked example of the docstring: copy `x a b c y b c`, then its own start again
    a, b, c, x, y = 1, 2, 3, 4, 5
    toks = np.array([a, b, c, x, a, b, c, y, b, c])
    assert max_gram_match(toks) == (2, 2) and max_gram_match(toks, leftmost=False) == (6, 2)
    assert max_gram(toks, 10) == [x, a, b, c, y, b, c, x, a, b]


def test_max_match_caps_the_suffix_length():
    toks = np.zeros(200, dtype=np.int32)
    assert max_gram_match(toks, max_match=None) == (198, 199)     # the whole prefix is the longest match
    assert max_gram_match(toks, max_match=5) == (4, 5)            # leftmost 5-token occurrence
    assert max_gram_match(toks, leftmost=False, max_match=5) == (198, 5)
    assert max_gram(toks, 3, max_match=5) == [0, 0, 0]


def test_matcher_equals_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 25))]
        for leftmost in (True, False):
            assert max_gram_match(np.array(toks), leftmost, max_match=None) == brute_force_match(toks, leftmost), toks


def seq(seq_id: int, token_ids: list[int]):
    return SimpleNamespace(seq_id=seq_id, token_ids=token_ids)


def test_drafter_chains_cut_to_budget_and_buffers_dropped():
    d = make_drafter("mag", bigram=False, max_tokens=4)
    s1, s2 = seq(1, [1, 2, 3, 1, 2]), seq(2, [7, 8, 9])
    t1, t2, t3 = d.propose([s1, s2, s1], [10, 10, 2])
    assert t1.tokens == [2, 3, 1, 2, 3] and t1.parents == [NO_PARENT, 0, 1, 2, 3] and t1.draft_probs is None
    assert t2 is None                                              # no match, no fallback
    assert t3.tokens == [2, 3, 1]                                  # budget 2
    assert d.propose([s1], [0]) == [None]
    s1.token_ids += [3, 1]                                         # the buffer catches up incrementally
    assert d.propose([s1], [3])[0].tokens == [1, 2, 3, 1]
    d.finish(s1)
    d.finish(s2)
    assert not d._buffers


def test_context_is_the_length_class_of_the_match():
    d = make_drafter("mag", bigram=False)
    assert d.context_of(seq(1, [7, 8, 9])) == 0                      # no match: the bigram would draft
    assert d.context_of(seq(2, [1, 2, 3, 1, 2])) == 2
    assert d.context_of(seq(3, [5, 1, 2, 3, 9, 1, 2, 3])) == 3
    assert d.context_of(seq(4, list(range(6)) + [9] + list(range(6)))) == 4     # 6 matched: class 4 (4-7)
    assert d.context_of(seq(5, list(range(20)) + [99] + list(range(20)))) == 8  # 8 or more
    for k in range(1, 30):                                                  # classes agree with the matcher
        toks = list(range(k)) + [99] + list(range(k))
        length = max_gram_match(np.array(toks))[1]
        assert length == k and d.context_of(seq(6, toks)) == (k if k < 4 else 4 if k < 8 else 8)


# ----------------------------------------------------------------------------- bigram table


def test_bigram_table_by_hand():
    # (1,2) x2, (2,1) x2, (1,3) x2 (tie with (1,2): the smaller id wins), (3,5) x1, 9 is out of range
    table = bigram_table([[1, 2, 1, 2, 1, 3], [1, 3, 5], [4], [5, 9]], vocab_size=6)
    assert table.tolist() == [-1, 2, 1, 5, -1, -1] and table.dtype == np.int32
    assert bigram_chain(table, 3, 5) == [5]                        # 5 has no successor
    assert bigram_chain(table, 1, 5) == [2, 1, 2, 1, 2]
    assert bigram_chain(table, 100, 5) == [] and bigram_chain(None, 1, 5) == []


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


CORPUS = ["the quick brown fox jumps over the lazy dog", "Paris is the capital of France",
          "the capital of France is Paris"]


def hand_table(tokenizer, docs: list[str], vocab_size: int) -> list[int]:
    counts = Counter(p for d in docs for ids in [tokenizer.encode(d, add_special_tokens=False)]
                     for p in zip(ids, ids[1:]))
    table = [NO_NEXT_TOKEN] * vocab_size
    for (a, b), n in sorted(counts.items()):
        if table[a] == NO_NEXT_TOKEN or n > counts[(a, table[a])]:
            table[a] = b
    return table


def test_bigram_table_from_corpus_equals_hand_counts_and_is_cached(tiny_tokenizer, tmp_path, monkeypatch):
    txt = tmp_path / "corpus.txt"
    txt.write_text("\n\n".join(CORPUS))
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text(json.dumps({"id": "a", "turns": CORPUS[:2], "output": CORPUS[2]}) + "\n")
    cache = tmp_path / "cache"
    expected = hand_table(tiny_tokenizer, CORPUS, 320)

    table = load_bigram_table(tiny_tokenizer, 320, txt, cache)
    assert table.tolist() == expected
    assert len(list((cache / "mag").glob("bigram-*.npy"))) == 1

    def no_build(*a, **k):
        raise AssertionError("should have read the cache")
    with monkeypatch.context() as mp:
        mp.setattr(mag, "bigram_table", no_build)
        assert load_bigram_table(tiny_tokenizer, 320, txt, cache).tolist() == expected

    # same documents in another file: another key, same table
    assert load_bigram_table(tiny_tokenizer, 320, jsonl, cache).tolist() == expected
    assert len(list((cache / "mag").glob("bigram-*.npy"))) == 2
    assert not list((cache / "mag").glob("*.tmp"))

    blocked = tmp_path / "blocked"
    blocked.write_text("")                                         # a file where the cache folder should be
    assert load_bigram_table(tiny_tokenizer, 320, txt, blocked).tolist() == expected


def test_default_corpus_and_missing_corpus(tiny_tokenizer, tmp_path, monkeypatch, caplog):
    (tmp_path / "train_prompts.jsonl").write_text(
        "\n".join(json.dumps({"id": str(i), "turns": [t], "output": None}) for i, t in enumerate(CORPUS)))
    monkeypatch.setenv("SPECSERVE_DATA", str(tmp_path))
    assert load_bigram_table(tiny_tokenizer, 320, cache_dir=tmp_path / "c").tolist() == \
        hand_table(tiny_tokenizer, CORPUS, 320)

    monkeypatch.setenv("SPECSERVE_DATA", str(tmp_path / "nowhere"))
    with caplog.at_level(logging.WARNING, logger="specserve"):
        assert load_bigram_table(tiny_tokenizer, 320) is None
        d = make_drafter("mag", tokenizer=tiny_tokenizer, corpus=str(tmp_path / "missing.txt"))
        assert d.propose([seq(0, [5, 6, 7])], [4]) == [None]       # runs without the fallback
    assert "not found" in caplog.text


def test_bigram_fallback_only_without_a_match(tiny_tokenizer, tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_text("\n\n".join(CORPUS))
    d = make_drafter("mag", tokenizer=tiny_tokenizer, corpus=str(txt), max_tokens=3, cache_dir=str(tmp_path))
    table = d.bigram
    the = tiny_tokenizer.encode("the", add_special_tokens=False)[-1]
    assert table[the] != NO_NEXT_TOKEN
    (tree,) = d.propose([seq(0, [3, 4, the])], [5])                # `the` never occurred before
    assert tree.tokens == [the, *bigram_chain(table, the, 3)]
    (tree,) = d.propose([seq(1, [the, 4, the])], [5])              # a match: no bigram
    assert tree.tokens == [the, 4, the, 4]
    assert make_drafter("mag", tokenizer=tiny_tokenizer, corpus=str(txt), bigram=False).bigram is None


# ----------------------------------------------------------------------------- through the engine


def test_mag_is_lossless_through_the_engine(tiny_llama_dir, tmp_path):
    g = torch.Generator().manual_seed(3)
    prompts = []
    for n_rep, n_seg, n_tail in [(3, 5, 2), (2, 9, 0), (4, 3, 5), (1, 7, 1), (2, 12, 3), (5, 2, 0)]:
        seg = torch.randint(3, 320, (n_seg,), generator=g).tolist()
        prompts.append(seg * n_rep + torch.randint(3, 320, (n_tail,), generator=g).tolist())
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run_requests(make_llm_engine(tiny_llama_dir), prompts, params)

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(CORPUS))
    engine = make_llm_engine(tiny_llama_dir, ["mag"], {"mag": {"corpus": str(corpus)}})
    assert run_requests(engine, prompts, params) == plain
    stats = engine.get_stats().drafters["mag"]
    assert stats.num_steps > 0 and stats.num_accepted_tokens > 0 and stats.num_fallbacks == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.drafters["mag"]._buffers                      # finish() dropped every buffer


@pytest.mark.slow
def test_mag_is_lossless_on_smollm2(default_model, tmp_path):
    from specserve.bench.datasets import data_dir
    tok = default_model.tokenizer
    questions = ["What is the capital of France? Answer in one sentence.",
                 "List the days of the week, separated by commas.",
                 "Repeat after me: the cat sat on the mat, the cat sat on the mat."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False, tokenize=True)
               for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kw = dict(max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=256)
    plain = run_requests(make_llm_engine("default", loaded=default_model, **kw), prompts, params)
    small = data_dir() / "mt_bench.jsonl"     # a small real corpus keeps the table build short
    options = {"mag": {"corpus": str(small), "cache_dir": str(tmp_path)}} if small.is_file() else {}
    engine = make_llm_engine("default", ["mag"], options, loaded=default_model, **kw)
    assert run_requests(engine, prompts, params) == plain
    stats = engine.get_stats().drafters["mag"]
    assert stats.num_steps > 0 and stats.num_fallbacks == 0
