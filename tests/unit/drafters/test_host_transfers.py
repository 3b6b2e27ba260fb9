"""Every drafter drafts a step's sequences together: the host conversions of tensors inside one
`propose` call (`tolist`, `item`, `cpu`, `numpy`, `int()`, `float()`, `bool()` of a tensor; each a
device-to-host transfer and a sync on a GPU) do not grow with the number of sequences in the call.
Counted on the CPU, where the same calls run; with the engine driving the drafter as it serves."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_DRAFTERS, make_llm_engine

from specserve.engine.sampling_params import SamplingParams

CONVERSIONS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture
def counter(monkeypatch):
    """{"on": bool, "n": conversions counted while on}, with torch.Tensor's conversions wrapped."""
    state = {"on": False, "n": 0}
    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if state["on"]:
                state["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return state


def conversions_per_call(model_dir, drafter: str, prompts, counter, options: dict | None = None) -> dict[int, int]:
    """{sequences in a propose call: the most conversions any such call made}, serving `prompts`
    together (the fixed budget: every decoding sequence drafts its full tree each step)."""
    engine = make_llm_engine(model_dir, [drafter], {drafter: options or TINY_DRAFTERS[drafter]})
    impl = engine.drafters[drafter]
    propose, most = impl.propose, {}

    def counting(seqs, budgets):
        counter["on"], counter["n"] = True, 0
        try:
            return propose(seqs, budgets)
        finally:
            counter["on"] = False
            most[len(seqs)] = max(most.get(len(seqs), 0), counter["n"])

    impl.propose = counting
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return most


@pytest.mark.parametrize("drafter", list(TINY_DRAFTERS))
def test_host_conversions_do_not_grow_with_the_batch(tiny_llama_dir, drafter, counter):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (12,), generator=g).tolist() * 2 for _ in range(4)]
    alone = conversions_per_call(tiny_llama_dir, drafter, prompts[:1], counter)
    together = conversions_per_call(tiny_llama_dir, drafter, prompts, counter)
    assert 4 in together and 1 in alone
    assert together[4] <= max(alone.values()), (alone, together)
    # a drafter running a network brings its trees back in a few transfers per call
    assert together[4] <= 4


@pytest.mark.parametrize("drafter", ["eagle", "eagle3"])
def test_the_device_tree_reads_back_once_per_call(tiny_llama_dir, drafter, counter):
    """Grown on the device (drafters/device_tree.py, on by default on CUDA), the tree comes back in
    one transfer per call, where the host tree reads back each level."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (12,), generator=g).tolist() * 2 for _ in range(4)]
    host = conversions_per_call(tiny_llama_dir, drafter, prompts, counter)
    device = conversions_per_call(tiny_llama_dir, drafter, prompts, counter,
                                  {**TINY_DRAFTERS[drafter], "device_tree": True})
    assert 4 in device and max(device.values()) == 1 < max(host.values()), (host, device)
