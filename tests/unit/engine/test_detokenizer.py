"""Incremental detokenisation on a real byte-level BPE: streamed text equals a full decode even when
characters' bytes span tokens, partial characters are never emitted, stop strings spanning tokens
are cut and never leak (not even a prefix), and held-back text comes out on flush."""

from __future__ import annotations

import pytest

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.sampling_params import SamplingParams

CORPUS = [
    "Hello world, this is a tiny corpus for the detokenizer tests.",
    "The quick brown fox jumps over the lazy dog.",
    "Le café est très bon, naïve résumé à Noël.",
    "Emoji time 😀😃🎉 and 👍🏽 thumbs",
    "東京は日本の首都です。北京",
    "Привет мир",
] * 3

TEXTS = [
    "Hi 😀😃 café 東京 naïve 👍🏽 done",
    "Noël à Привет 🎉🎉 東京は",
    "plain ascii text, with punctuation!",
    "ends mid emoji 😀😃",
]


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE trained here (about a second): emoji, CJK and accented characters
    keep tokens that hold only part of a character's bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, min_frequency=2, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1):
    """Feed ids `chunk` at a time. Returns (deltas, stop string or None)."""
    deltas = []
    for i in range(0, len(ids), chunk):
        delta, stop = detok.add_tokens(ids[i:i + chunk])
        deltas.append(delta)
        if stop is not None:
            return deltas, stop
    return deltas, None


def test_tokenizer_splits_characters_across_tokens(tokenizer):
    # Guard: the fixture really produces tokens holding partial characters.
    partial = [t for t in tokenizer.encode(TEXTS[0]) if "\ufffd" in tokenizer.decode([t])]
    assert len(partial) >= 3


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_concatenation_equals_full_decode(tokenizer, text, chunk):
    prompt = tokenizer.encode("Hello world 😀")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas, stop = stream(detok, ids, chunk)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)      # never a partial character
    streamed = "".join(deltas) + detok.flush()
    assert streamed == tokenizer.decode(ids) == text
    assert detok.output_text == text


def test_text_is_emitted_as_soon_as_characters_complete(tokenizer):
    """After each token: everything when the decoded text ends on a whole character, else a
    prefix of the text before the incomplete character (that token's text waits with it)."""
    ids = tokenizer.encode(TEXTS[0])
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    held = 0
    for n, t in enumerate(ids, 1):
        detok.add_tokens([t])
        full = tokenizer.decode(ids[:n])
        if full.endswith("\ufffd"):
            held += 1
            assert full.rstrip("\ufffd").startswith(detok.output_text)
        else:
            assert detok.output_text == full
    assert held >= 2 and detok.flush() == ""


def test_leading_space_kept_after_prompt(tokenizer):
    prompt = tokenizer.encode("Hello")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas, _ = stream(detok, tokenizer.encode(" world, this"))
    assert "".join(deltas) == " world, this"
    assert deltas[0].startswith(" ")


def test_flush_drops_a_trailing_incomplete_character(tokenizer):
    """Output cut mid-character (max_tokens, abort): the whole characters before it, no U+FFFD (as
    OpenAI's API); a full decode would end in U+FFFD there."""
    ids = tokenizer.encode("ok 😀😃")
    cut = next(n for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas, _ = stream(detok, ids[:cut])
    assert "\ufffd" not in "".join(deltas)
    full = tokenizer.decode(ids[:cut])
    assert full.endswith("\ufffd")
    assert "".join(deltas) + detok.flush() == full.rstrip("\ufffd") == "ok 😀"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hello world") + [end] + tokenizer.encode(" the fox")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    deltas, _ = stream(detok, ids)
    text = "".join(deltas) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip


def test_windows_stay_short(tokenizer):
    """Each token costs O(window), not O(sequence): decode never sees more than a few tokens."""
    seen = []

    class Recording:       # not `is_fast`: exercises the tokenizer.decode path
        def decode(self, ids, **kw):
            seen.append(len(ids))
            return tokenizer.decode(ids, **kw)

    ids = tokenizer.encode(" ".join(TEXTS) * 10)
    detok = IncrementalDetokenizer(Recording(), tokenizer.encode("Hello"), SamplingParams())
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids)
    assert len(ids) > 300 and max(seen) <= 8


# ---- stop strings ----------------------------------------------------------------------------

def stop_case(tokenizer, text: str, stop: str):
    """ids of text, and the token index range [first, last] the first occurrence of stop spans."""
    ids = tokenizer.encode(text)
    start = text.index(stop)
    ends = [len(tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)]
    first = next(n for n in range(len(ids)) if ends[n + 1] > start)
    last = next(n for n in range(len(ids)) if ends[n + 1] >= start + len(stop))
    return ids, start, first, last


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_three_tokens(tokenizer, include):
    text, stop = "the lazy fox xqzv jumps over", "xqzv"
    ids, start, first, last = stop_case(tokenizer, text, stop)
    assert last - first + 1 >= 3, "the stop string should span at least three tokens"
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"),
                                   SamplingParams(stop=[stop], include_stop_str_in_output=include))
    emitted = ""
    for n, t in enumerate(ids):
        delta, matched = detok.add_tokens([t])
        emitted += delta
        if n < last:
            assert matched is None
            assert stop[0] not in emitted[start:]          # not even a prefix of the stop string
            assert text.startswith(emitted) and len(emitted) <= start
        else:
            assert matched == stop
            break
    assert emitted == (text[:start + len(stop)] if include else text[:start])
    assert detok.output_text == emitted
    assert detok.add_tokens(tokenizer.encode(" more")) == ("", None)   # nothing after a match
    assert detok.flush() == ""


def test_held_back_prefix_is_released_when_it_does_not_complete(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["xqzv"]))
    deltas, stop = stream(detok, tokenizer.encode("fox xqz"))
    assert stop is None and "".join(deltas) == "fox "               # "xqz" might start the stop string
    delta, stop = detok.add_tokens(tokenizer.encode("a"))
    assert stop is None and delta == "xqza"                          # it did not: released
    assert detok.flush() == ""


def test_flush_returns_held_back_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["xqzv", "world peace"]))
    deltas, stop = stream(detok, tokenizer.encode("Hello world"))
    assert stop is None and "".join(deltas) == "Hello "
    assert detok.flush() == "world"
    assert detok.output_text == "Hello world"


def test_text_unrelated_to_stop_strings_is_not_held(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["a very long stop string"]))
    deltas, _ = stream(detok, tokenizer.encode("The quick brown fox"))
    assert "".join(deltas) == "The quick brown fox"


@pytest.mark.parametrize("stops", [["world", "lo w"], ["lo w", "world"]])
def test_earliest_stop_string_wins(tokenizer, stops):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops))
    deltas, stop = stream(detok, tokenizer.encode("Hello world, this is"))
    assert stop == "lo w" and "".join(deltas) == "Hel"


@pytest.mark.parametrize("chunk", [1, 100])
def test_overlapping_stops_resolve_the_same_whatever_the_chunking(tokenizer, chunk):
    # "ic" completes before "quick" does, so it wins whether the text arrives token by token or at once.
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["quick", "ui"]))
    deltas, stop = stream(detok, tokenizer.encode("The quick brown"), chunk)
    assert stop == "ui" and "".join(deltas) == "The q"


def test_stop_string_made_of_multibyte_characters(tokenizer):
    text = "Hi 😀😃 café 東京 naïve"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["😃 caf"], include_stop_str_in_output=True))
    deltas, stop = stream(detok, tokenizer.encode(text))
    assert stop == "😃 caf" and "".join(deltas) == "Hi 😀😃 caf"
    assert all("\ufffd" not in d for d in deltas)


def test_stop_at_the_very_start(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"), SamplingParams(stop=["The"]))
    deltas, stop = stream(detok, tokenizer.encode("The quick"))
    assert stop == "The" and "".join(deltas) == "" and detok.output_text == ""


def test_flush_never_emits_a_stop_string(tokenizer):
    # The stop string arrives in the same token as an incomplete character, then the sequence ends
    # (e.g. max_tokens) before the character completes: flush still cuts at the stop string.
    ids = tokenizer.encode("Hi 😀😃")
    cut = next(n for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    text = tokenizer.decode(ids[:cut])
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["😀"]))
    deltas, stop = stream(detok, ids[:cut])
    if stop is None:
        deltas.append(detok.flush())
    assert "".join(deltas) == text[:text.index("😀")]


# ---- the real SmolLM2 tokenizer --------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_tokenizer_streaming():
    try:
        from specserve.engine.loader import load_model
        tokenizer = load_model("default").tokenizer
    except Exception as e:  # the loader or the GGUF may be missing here
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           return_dict=False)
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    for text in TEXTS + ["Héllo wörld, 你好世界 🤗🚀 ok"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        deltas, _ = stream(detok, ids)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) + detok.flush() == tokenizer.decode(ids) == text
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("The answer is STOP here", add_special_tokens=False) + [end]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=["STOP"]))
    deltas, stop = stream(detok, ids)
    assert stop == "STOP" and "".join(deltas) == "The answer is "


@pytest.mark.slow
@pytest.mark.parametrize("text", ["Héllo wörld, 你好世界 🤗🚀 ok", "東京は日本の首都です。👍🏽", "naïve café 😀😃🎉"])
def test_smollm2_output_cut_mid_character_ends_without_replacement_char(default_model, text):
    """The real SmolLM2 byte-level BPE: for every cut of the token ids that splits a character (max_tokens
    or an abort there), the streamed text plus flush is the full decode minus the incomplete
    character, and no U+FFFD is ever emitted."""
    tokenizer = default_model.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say something", add_special_tokens=False)
    cuts = [n for n in range(1, len(ids) + 1) if tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert len(cuts) >= 2      # the text does split characters across tokens
    for n in cuts:
        detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        deltas, _ = stream(detok, ids[:n])
        deltas.append(detok.flush())
        assert all("\ufffd" not in d for d in deltas), (n, deltas)
        assert "".join(deltas) == tokenizer.decode(ids[:n]).rstrip("\ufffd")
        assert text.startswith("".join(deltas))
