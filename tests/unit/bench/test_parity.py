"""`specserve bench parity`: claims evaluated from synthetic rows (holds, does not hold, partly, not
measured), MCSD's α from accepted-length counts, the README block replaced between its markers,
and the whole command end to end on the tiny random Llama (untrained drafters: the figures are
checked for shape, never for which ordering holds)."""

from __future__ import annotations

import argparse
import json

import pytest

from specserve.bench import parity


def row(method, dataset="mt_bench", temperature=0.0, **figures):
    return {"method": method, "dataset": dataset, "temperature": temperature, "error": None, **figures}


def configs(*names):
    return {n: parity.CONFIGS[n] for n in names}


def claim(cid):
    return next(c for c in parity.CLAIMS if c.id == cid)


def test_ordering_claim_holds_does_not_hold_and_partly():
    ctc_vs_medusa = claim("ctc_vs_medusa")
    cfgs = configs("ctc", "medusa")
    good = [row("ctc", ds, tau=1.5, speedup=0.9) for ds in parity.GREEDY_DATASETS] + \
           [row("medusa", ds, tau=1.3) for ds in parity.GREEDY_DATASETS]
    rec, = parity.evaluate([ctc_vs_medusa], good, cfgs, {})
    assert rec["holds"] == "yes"
    assert rec["ours"].startswith("τ ctc / medusa (speedup): MT-Bench 1.50 / 1.30 (0.90× / –); HumanEval")
    assert rec["per_dataset"]["gsm8k"] == {"values": {"ctc": 1.5, "medusa": 1.3}, "holds": True,
                                           "speedup": {"ctc": 0.9, "medusa": None}}

    bad = [row("ctc", ds, tau=1.2) for ds in parity.GREEDY_DATASETS] + \
          [row("medusa", ds, tau=1.3) for ds in parity.GREEDY_DATASETS]
    assert parity.evaluate([ctc_vs_medusa], bad, cfgs, {})[0]["holds"] == "no"

    mixed = [row("ctc", "mt_bench", tau=1.2), row("ctc", "humaneval", tau=1.4), row("ctc", "gsm8k", tau=1.3),
             *[row("medusa", ds, tau=1.3) for ds in parity.GREEDY_DATASETS]]   # equal is not greater
    assert parity.evaluate([ctc_vs_medusa], mixed, cfgs, {})[0]["holds"] == "partly (1/3)"

    # a dataset without a figure is left out; none at all is "not measured"
    assert parity.evaluate([ctc_vs_medusa], good[:1] + good[3:4], cfgs, {})[0]["holds"] == "yes"
    assert parity.evaluate([ctc_vs_medusa], [], cfgs, {})[0]["holds"].startswith("not measured")


def test_unavailable_configuration_means_not_measured():
    recs = parity.evaluate([claim("falcon_csgd"), claim("mcsd_dynamic_vs_ti")], [row("falcon", tau=2.0)],
                           configs("falcon", "mcsd_ti"),
                           {"falcon_nocsgd": parity.CONFIGS["falcon_nocsgd"].missing,
                            "mcsd_dynamic": parity.CONFIGS["mcsd_dynamic"].missing})
    assert recs[0]["holds"].startswith("not measured (no csgd=false checkpoint; train with `specserve train falcon")
    assert recs[1]["holds"] == "not measured (dynamic MCSD not available)"
    assert recs[0]["ours"] == "" and recs[1]["per_dataset"] == {}
    rec, = parity.evaluate([claim("ctc_vs_medusa")], [], configs("ctc", "medusa"), {"ctc": "failed: boom"})
    assert rec["holds"] == "not measured (ctc: failed: boom)"


def test_caveat_when_dynamic_mcsd_runs_without_a_decision_model():
    from dataclasses import replace

    rows = [row("mcsd_dynamic", temperature=0.7, accepted_length_counts=[0, 0, 0, 1]),   # α 3/5
            row("mcsd_ti", temperature=0.7, accepted_length_counts=[0, 0, 1])]           # α 2/4
    cfgs = configs("mcsd_dynamic", "mcsd_ti")
    rec, = parity.evaluate([claim("mcsd_dynamic_vs_ti")], rows, cfgs, {})
    assert rec["holds"] == "yes" and "0.60 / 0.50" in rec["ours"]
    assert rec["caveats"] and "no decision model" in rec["ours"]
    cfgs["mcsd_dynamic"] = replace(cfgs["mcsd_dynamic"], options={**parity.DYNAMIC_MCSD_OPTIONS, "decision": "d"})
    rec, = parity.evaluate([claim("mcsd_dynamic_vs_ti")], rows, cfgs, {})
    assert rec["caveats"] == [] and "decision" not in rec["ours"]


def test_parallelspec_faster_at_about_equal_tau():
    c, cfgs = claim("parallelspec_vs_eagle"), configs("parallelspec", "eagle")

    def rows(ps_tok, ps_tau, e_tok=10.0, e_tau=2.0):
        return [row("parallelspec", "gsm8k", tok_s=ps_tok, tau=ps_tau), row("eagle", "gsm8k", tok_s=e_tok, tau=e_tau)]

    assert parity.evaluate([c], rows(11.0, 1.9), cfgs, {})[0]["holds"] == "yes"       # 5 % lower τ: about equal
    slow = parity.evaluate([c], rows(9.0, 2.0), cfgs, {})[0]
    assert slow["holds"] == "no" and slow["per_dataset"]["gsm8k"]["faster"] is False
    far = parity.evaluate([c], rows(11.0, 2.0 * (1 - parity.TAU_TOLERANCE) - 0.01), cfgs, {})[0]
    assert far["holds"] == "no" and far["per_dataset"]["gsm8k"]["tau_within_tolerance"] is False
    assert "11.0 vs 10.0 tok/s" in parity.evaluate([c], rows(11.0, 1.9), cfgs, {})[0]["ours"]


def test_mcsd_alpha_is_longest_accepted_over_gamma():
    cfg = parity.CONFIGS["mcsd_static"]            # γ = 4
    # 4 steps accepting 0, 1, 2 and 4 drafts: mean 1.75 -> 1.75 / 4
    assert parity.metric({"accepted_length_counts": [1, 1, 1, 0, 1], "error": None}, cfg, "mcsd_alpha") == \
        pytest.approx(1.75 / 4)
    assert parity.metric({"accepted_length_counts": [], "error": None}, cfg, "mcsd_alpha") is None
    assert parity.metric(None, cfg, "tau") is None
    c = claim("mcsd_alpha")
    cfgs = configs("mcsd_ti", "mcsd_static", "mcsd_sps")
    rows = [row("mcsd_ti", temperature=0.7, accepted_length_counts=[0, 0, 2]),       # α 0.5
            row("mcsd_static", temperature=0.7, accepted_length_counts=[1, 1]),      # α 0.125
            row("mcsd_sps", temperature=0.7, accepted_length_counts=[3, 1])]         # α 0.0625
    rec, = parity.evaluate([c], rows, cfgs, {})
    assert rec["holds"] == "yes" and "0.50 / 0.12 / 0.06" in rec["ours"]
    rows[2]["accepted_length_counts"] = [0, 2]                                       # SpS α 0.25 > static
    assert parity.evaluate([c], rows, cfgs, {})[0]["holds"] == "no"


def test_every_claim_names_known_configurations():
    assert len(set(parity.CLAIM_IDS)) == len(parity.CLAIMS)
    for c in parity.CLAIMS:
        assert c.configs and all(n in parity.CONFIGS for n in c.configs), c.id
        assert c.paper and c.source and c.text
    assert all(parity.CONFIGS[n].gamma for n in ("mcsd_sps", "mcsd_static", "mcsd_ti", "mcsd_dynamic"))


def test_dynamic_mcsd_is_not_run_without_its_options(monkeypatch):
    """Options a drafter does not declare make a configuration unavailable, never a start-up error."""
    from specserve.drafters.base import drafter_options, drafter_class

    args = argparse.Namespace(datasets=None, falcon_nocsgd=None, mcsd_decision=None)
    ready, missing = parity.resolve_configs([claim("mcsd_dynamic_vs_ti"), claim("falcon_csgd")], args, {})
    assert {"mcsd_ti", "falcon"} <= set(ready) <= {"mcsd_ti", "falcon", "mcsd_dynamic"}
    assert ready["mcsd_ti"].options["target_init_width"] == 2
    assert missing["falcon_nocsgd"] == parity.CONFIGS["falcon_nocsgd"].missing
    if "decision" in drafter_options(drafter_class("student")):
        assert ready["mcsd_dynamic"].options == parity.DYNAMIC_MCSD_OPTIONS
    else:
        assert missing["mcsd_dynamic"] == "dynamic MCSD not available"
    # a drafter declaring the options runs it, with the decision model when one is given
    from specserve.drafters import base

    def student_with_decision(ctx, *, k_config="chain:4", target_init_width=1, decision=None):
        raise AssertionError("never built here")

    monkeypatch.setitem(base._REGISTRY, "student", student_with_decision)
    args.mcsd_decision = "ckpt/decision"
    ready, missing = parity.resolve_configs([claim("mcsd_dynamic_vs_ti")], args, {})
    assert not missing and ready["mcsd_dynamic"].options == {**parity.DYNAMIC_MCSD_OPTIONS,
                                                             "decision": "ckpt/decision"}
    args = argparse.Namespace(datasets=["x.jsonl"], falcon_nocsgd="ckpt/nocsgd", mcsd_decision=None)
    ready, missing = parity.resolve_configs([claim("falcon_csgd")], args, {"falcon": {"draft_vocab": 0}})
    assert ready["falcon_nocsgd"].options == {"draft_vocab": 0, "checkpoint": "ckpt/nocsgd"}
    assert ready["falcon"].datasets == ("x.jsonl",) and not missing


def test_groups_share_temperature_and_budget():
    groups = parity.groups_of(configs("ctc", "medusa", "mcsd_sps", "mcsd_ti"))
    assert {k: [c.name for c in v] for k, v in groups.items()} == {
        (0.0, parity.GREEDY_BUDGET): ["ctc", "medusa"], (0.7, parity.MCSD_BUDGET): ["mcsd_sps", "mcsd_ti"]}


def test_aliases_are_registered_for_the_run_only():
    from specserve.drafters.base import available_drafters, drafter_class

    with parity.aliases(list(configs("falcon", "falcon_topk").values())):
        assert "falcon_topk" in available_drafters() and drafter_class("falcon_topk") is drafter_class("falcon")
    assert "falcon_topk" not in available_drafters()


def test_readme_block_is_replaced_idempotently(tmp_path):
    result = {"meta": {"command_line": "specserve bench parity", "date": "2026-11-24", "model": "m",
                       "num_prompts": 1, "max_tokens": 8},
              "claims": [{"claim": "A > B", "paper": "2 vs 1", "source": "T1", "ours": "1.1 / 1.0", "holds": "yes"}]}
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n\n{parity.MARK_START}\nold table\n{parity.MARK_END}\n\nafter\n")
    assert parity.update_readme(readme, result)
    once = readme.read_text()
    assert "old table" not in once and "| A > B | 2 vs 1 (T1) | 1.1 / 1.0 | **yes** |" in once
    assert once.startswith("# x\n\nbefore\n\n" + parity.MARK_START) and once.endswith(parity.MARK_END + "\n\nafter\n")
    assert parity.update_readme(readme, result) and readme.read_text() == once
    result["claims"][0]["holds"] = "no"
    assert parity.update_readme(readme, result)
    assert readme.read_text().count(parity.MARK_START) == 1 and "| **no** |" in readme.read_text()
    assert parity.replace_block(parity.README.read_text(), "X") is not None   # the project README has its markers
    readme.write_text("no markers\n")
    assert not parity.update_readme(readme, result) and readme.read_text() == "no markers\n"


def test_parity_end_to_end_on_the_tiny_model(tiny_llama_dir, tmp_path, capsys):
    rows = [{"id": 1, "category": "qa", "turns": ["What is the capital of France? Paris is the capital"]}]
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "parity"
    untrained = [f"{d}.random_init=true" for d in ("ctc", "medusa", "falcon", "eagle", "parallelspec", "student")]
    argv = ["--model", str(tiny_llama_dir), "--datasets", str(data), "--num-prompts", "1", "--max-tokens", "6",
            "--out", str(out), "--no-readme", "--mcsd-decision", "none",   # no decision model ships for it
            "--drafter-option", 'cascade.level_options={"student": {"random_init": true}}',
            *[x for o in untrained for x in ("--drafter-option", o)]]
    rc = parity.main(argv)
    assert rc == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert [c["id"] for c in result["claims"]] == parity.CLAIM_IDS       # every claim has a row
    by_id = {c["id"]: c for c in result["claims"]}
    assert by_id["falcon_csgd"]["holds"].startswith("not measured (no csgd=false checkpoint")
    assert by_id["falcon_csgd_tree_vs_neither"]["holds"].startswith("not measured")
    measured = [c for c in result["claims"] if not c["holds"].startswith("not measured")]
    assert {c["id"] for c in measured} >= {"ctc_vs_medusa", "falcon_tree_vs_topk", "falcon_tree_vs_chain",
                                           "parallelspec_vs_eagle", "cascade_vs_sps", "cascade_vs_mag",
                                           "mcsd_alpha"}
    from specserve.drafters.base import drafter_class, drafter_options
    if "decision" in drafter_options(drafter_class("student")):    # this version has dynamic MCSD: a fork runs
        assert by_id["mcsd_dynamic_vs_ti"] in measured and "no decision model" in by_id["mcsd_dynamic_vs_ti"]["ours"]
    else:
        assert by_id["mcsd_dynamic_vs_ti"]["holds"] == "not measured (dynamic MCSD not available)"
    for c in measured:
        assert c["holds"] in ("yes", "no") and c["ours"] and set(c["per_dataset"]) == {"tiny"}, c
    # two engine runs: greedy at 8 nodes, T = 0.7 at the MCSD budget; every configuration has its row
    assert [(r["temperature"], r["budget"]) for r in result["runs"]] == [(0.0, parity.GREEDY_BUDGET),
                                                                        (0.7, parity.MCSD_BUDGET)]
    assert all(r["exit_status"] == 0 and "error" not in r for r in result["runs"])
    # sampled runs sample as the papers do (no seeds: drafts from q, target-initialised roots for TI)
    assert ["--unseeded" in r["invocation"].split() for r in result["runs"]] == [False, True]
    methods = {(r["method"], r["temperature"]) for r in result["results"]}
    for name, cfg in result["configs"].items():
        assert (name, cfg["temperature"]) in methods
    assert result["configs"]["falcon_topk"]["options"] == {"tree": "topk", "random_init": True}
    alpha = by_id["mcsd_alpha"]["per_dataset"]["tiny"]["values"]
    assert all(0.0 <= a <= 1.0 for a in alpha.values())
    assert result["num_greedy_mismatches"] == 0
    table = out.with_suffix(".md").read_text()
    assert "| claim | paper | ours | holds |" in table and "0.47 > 0.29 > 0.17" in table
    assert table in capsys.readouterr().out
    from specserve.drafters.base import available_drafters
    assert "falcon_topk" not in available_drafters()


def test_a_configuration_that_fails_to_load_sinks_only_its_claims(tiny_llama_dir, tmp_path):
    data = tmp_path / "tiny.jsonl"
    data.write_text(json.dumps({"id": 1, "category": "qa", "turns": ["Hello world! Hello"]}) + "\n")
    out = tmp_path / "parity"
    rc = parity.main(["--model", str(tiny_llama_dir), "--datasets", str(data), "--num-prompts", "1",
                      "--max-tokens", "4", "--out", str(out), "--no-readme",
                      "--claims", "ctc_vs_medusa", "cascade_vs_mag",
                      "--drafter-option", f"ctc.checkpoint={tmp_path / 'no_such_checkpoint'}",
                      "--drafter-option", "medusa.random_init=true",
                      "--drafter-option", 'cascade.level_options={"student": {"random_init": true}}'])
    assert rc == 0
    result = json.loads(out.with_suffix(".json").read_text())
    by_id = {c["id"]: c for c in result["claims"]}
    assert by_id["ctc_vs_medusa"]["holds"].startswith("not measured (ctc: failed: ")
    assert by_id["cascade_vs_mag"]["holds"] in ("yes", "no")
    runs = result["runs"]
    assert runs[0]["retried_alone"] and "error" in runs[0]
    assert [r["configs"] for r in runs[1:]] == [[n] for n in runs[0]["configs"]]
    assert [("error" in r) for r in runs[1:]] == [n == "ctc" for n in runs[0]["configs"]]
    assert result["unavailable"]["ctc"].startswith("failed: ")
