"""The drafter registry and its option parsing (what --drafter-option and the benchmarks take)."""

from __future__ import annotations

import pytest

from specserve.drafters.base import available_drafters, make_drafter, parse_drafter_options


def test_builtin_drafters_are_registered():
    assert {"ngram", "mag", "draft_model"} <= set(available_drafters())


def test_unknown_drafter_lists_the_available_ones():
    with pytest.raises(ValueError, match="available: .*ngram"):
        make_drafter("no_such_drafter")


def test_drafter_options_parse_typed_values():
    opts = parse_drafter_options(["draft_model.draft_layers=4", "draft_model.k_config=4,2,2,1",
                                  "ngram.max_ngram=3", "x.flag=true", "x.ratio=0.5", "x.path=none", "x.max-len=2"])
    assert opts == {"draft_model": {"draft_layers": 4, "k_config": "4,2,2,1"}, "ngram": {"max_ngram": 3},
                    "x": {"flag": True, "ratio": 0.5, "path": None, "max_len": 2}}
    for bad in ("draft_layers=4", "ngram.max_ngram", ".x=1"):
        with pytest.raises(ValueError, match="DRAFTER.KEY=VALUE"):
            parse_drafter_options([bad])
