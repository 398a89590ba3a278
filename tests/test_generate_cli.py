"""`overdrive optimize / bench / run` on a causal LM, as a user runs them, with pydoc-lm's recipe at toy size (the
real model trains for minutes, once): the table and plan, a plan's figures per batch size, and a JSONL run whose
completions equal the plan's generator's own, in input order, with bad records filed and a resume that adds
nothing twice."""

from __future__ import annotations

import json

import pytest

from overdrive import cli
from overdrive.generate import SamplingParams
from overdrive.generate.plan import GenerationPlan, build_generator, is_generation_plan
from tests.conftest import requires_cuda


@pytest.fixture
def toy_pydoc_lm(monkeypatch):
    """pydoc-lm trained for 2 steps at a toy shape of 2 layers (not test_generate's, whose test reads its cache entry
    as new)."""
    from overdrive.workloads import pydoc_lm

    monkeypatch.setattr(pydoc_lm, "STEPS", 2)
    monkeypatch.setattr(pydoc_lm, "SHAPE", {**pydoc_lm.SHAPE, "hidden_size": 32, "intermediate_size": 48,
                                             "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1})
    return pydoc_lm.build_pydoc_lm(log=None)


def test_optimize_writes_a_generation_plan_with_every_row_judged_or_said_why_not(toy_pydoc_lm, tmp_path, capsys):
    code = cli.main(["optimize", "pydoc-lm", "--device", "cpu", "--techniques", "kv-int8,bf16,int4-weight",
                     "--max-new-tokens", "6", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    plan_path = tmp_path / "pydoc-lm" / "plan.json"
    assert is_generation_plan(plan_path)
    plan = GenerationPlan.load(plan_path)
    assert plan.batch_size == 1 and plan.max_new_tokens == 6 and set(plan.names) <= {"kv-int8", "bf16"}
    rows = {r["technique"]: r for r in json.loads((tmp_path / "pydoc-lm" / "results.json").read_text())["rows"]}
    for name in ("kv-int8", "bf16"):  # judged by the guard on real held-out prompts, then timed or refused
        fid = rows[name]["fidelity"]
        assert fid is None or (fid["prompts"] == 32 and fid["perplexity_reference"] > 1), rows[name]
        assert rows[name]["status"] in ("kept", "rejected") and (rows[name]["status"] == "kept" or rows[name]["reason"])
    assert rows["int4-weight"]["status"] == "untried" and rows["int4-weight"]["reason"]
    baseline = next(r for r in rows.values() if r["status"] == "baseline")
    assert baseline["tokens_per_s"] > 0  # the baseline's row has its own figure, as every other row
    assert "greedy changed" in printed and "overdrive bench pydoc-lm --plan" in printed
    report = (tmp_path / "pydoc-lm" / "report.md").read_text()  # the table with every reason in full, the plan
    assert "| technique | status |" in report and "overdrive optimize pydoc-lm" in report
    assert rows["int4-weight"]["reason"] in report.replace("\\|", "|") and "**plan: " in report
    assert "- batch 1: " in report
    assert cli.main(["optimize", "pydoc-lm", "--device", "cpu", "--out", str(tmp_path)]) == 2  # no silent overwrite
    assert "exists" in capsys.readouterr().err


def test_a_draft_model_is_derived_distilled_judged_and_timed_and_its_plan_rebuilds_it(toy_pydoc_lm):
    """draft-model through optimize on the 2-layer toy pydoc-lm: the draft keeps layer 0, is distilled on CPython's
    text toward the target, judged exact (no greedy token changed) and timed; a plan holding it rebuilds the same
    draft from the cache."""
    from overdrive.generate.tune import optimize_generation
    from overdrive.workloads.generation import create_generation_workload

    workload = create_generation_workload("pydoc-lm", log=None)
    # min_gain 0 keeps prompt-lookup whatever its speed; the draft then goes in its place only if it beats it
    result = optimize_generation(workload, techniques=["prompt-lookup", "draft-model"], new_tokens=6, guard_prompts=8,
                                 other_batch_size=None, draft_seconds=2, min_gain=0)
    row = next(r for r in result.rows if r.technique == "draft-model")
    assert next(r for r in result.rows if r.technique == "prompt-lookup").status == "kept"
    assert row.status in ("kept", "rejected") and (row.status == "kept" or "than the plan with prompt-lookup" in row.reason)
    assert row.status == "rejected" or row.gain.low >= 1.0, row.gain  # not a slower drafter in place of a faster one
    assert row.fidelity["prompts"] == 8 and row.fidelity["diverged_beyond_ties"] == 0, row.fidelity
    assert "keeps layers [0] of 2" in row.detail and "distilled" in row.detail and "drafts accepted" in row.detail
    assert "timed in place of prompt-lookup" in row.detail
    (step,) = row.steps  # one drafter: the draft in prompt-lookup's place
    assert step["name"] == "draft-model" and step["layers"] == [0] and step["steps"] >= 1
    rebuilt = build_generator(workload.model, workload.tokenizer, row.steps, device="cpu")
    assert rebuilt.speculative.facts["cached"] and rebuilt.speculative.facts["steps"] == step["steps"]
    assert rebuilt.speculative.facts["kl_after"] < rebuilt.speculative.facts["kl_before"]
    assert rebuilt.generate(workload.prompts[:2], SamplingParams(max_new_tokens=5)) == \
        build_generator(workload.model, workload.tokenizer, []).generate(workload.prompts[:2], SamplingParams(max_new_tokens=5))


def test_run_of_an_empty_file_is_refused_and_a_records_setting_is_named_as_it_wrote_it(toy_pydoc_lm, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=1, max_new_tokens=4, steps=[]).save(plan_path)
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    out = tmp_path / "out.jsonl"
    assert cli.main(["run", str(plan_path), "--input", str(tmp_path / "blank.jsonl"), "--output", str(out)]) == 2
    assert "holds no records" in capsys.readouterr().err and not out.exists()  # as `run` of any other plan
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "A list is", "max_tokens": -3}) + "\n")
    assert cli.main(["run", str(plan_path), "--input", str(tmp_path / "bad.jsonl"), "--output", str(out)]) == 0
    (error,) = [json.loads(line)["error"] for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert "max_tokens" in error and "max_new_tokens" not in error, error


def test_bench_times_a_plan_against_the_baseline_at_each_batch_size(toy_pydoc_lm, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=1, max_new_tokens=4, steps=[{"name": "kv-int8"}]).save(plan_path)
    code = cli.main(["bench", "pydoc-lm", "--plan", str(plan_path), "--device", "cpu", "--batch-sizes", "1,3",
                     "--new-tokens", "5", "--prompt-tokens", "12", "--out", str(tmp_path)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    results = json.loads((tmp_path / "pydoc-lm" / "bench.json").read_text())["results"]
    assert [(r["configuration"], r["batch_size"]) for r in results] == [
        ("baseline (eager fp32)", 1), ("kv-int8", 1), ("baseline (eager fp32)", 3), ("kv-int8", 3)]
    for r in results:
        assert r["tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 and 0 < r["itl_ms_p50"] <= r["itl_ms_p99"]
        assert r["roofline"]["share"] > 0 and r["weight_bytes"] > 0
    base, plan = results[2], results[3]
    assert plan["kv_cache_bytes"] < base["kv_cache_bytes"] / 2  # int8 with a scale per vector against fp32
    for r in results:  # the peak measured in one more pass, split: the cache allocated is the cache read per step
        m = r["memory"]
        assert m["peak"] == m["weights"] + m["kv_cache"] + m["other"] and m["kv_cache"] == r["kv_cache_bytes"], m
    assert plan["memory"]["kv_cache"] < base["memory"]["kv_cache"] / 2
    assert "peak memory: one more pass" in printed.out  # the column's note (its header wraps in a narrow table)
    assert plan["gain"]["rounds"] >= 4 and plan["gain"]["low"] <= plan["gain"]["ratio"] <= plan["gain"]["high"]


def test_bench_refuses_prompts_and_new_tokens_beyond_the_context_as_optimize_does(toy_pydoc_lm, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=1, max_new_tokens=4, steps=[]).save(plan_path)
    context = toy_pydoc_lm.model.config.max_position_embeddings
    code = cli.main(["bench", "pydoc-lm", "--plan", str(plan_path), "--device", "cpu", "--batch-sizes", "1",
                     "--new-tokens", str(context), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--new-tokens" in err and f"context of {context} positions" in err, err
    assert "Traceback" not in err


def test_run_writes_the_plans_own_completions_in_order_files_bad_records_and_resumes(toy_pydoc_lm, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=3, max_new_tokens=5, steps=[{"name": "kv-int8"}]).save(plan_path)
    records = [{"prompt": "A list is"}, "not json", {"prompt": "The dictionary", "max_tokens": 2, "id": "b"},
               {"prompt": ""}, {"prompt": "Return the", "temperature": 0.8, "seed": 3}, {"prompt": "x", "colour": 1},
               {"prompt": "An iterator"}, {"prompt": "When the"}, "", {"prompt": 123}, {"prompt": "Now", "stop": 5}]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    out = tmp_path / "completions.jsonl"
    assert cli.main(["run", str(plan_path), "--input", str(source), "--output", str(out), "--device", "cpu"]) == 0
    said = capsys.readouterr().out
    assert "5 of 10 prompts" in said  # the blank line is no record
    assert "continuous batching of up to 3 sequences" in said and "new graph" not in said  # eager: none compiled
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in lines] == [0, 2, 4, 6, 7] and lines[1]["id"] == "b"
    errors = [json.loads(x) for x in out.with_name("completions.errors.jsonl").read_text().splitlines()]
    assert [e["index"] for e in errors] == [1, 3, 5, 9, 10] and "unknown fields ['colour']" in errors[2]["error"]
    assert "must be a string, got int" in errors[3]["error"] and "stop must be a string or a list" in errors[4]["error"]
    gen = build_generator(toy_pydoc_lm.model, toy_pydoc_lm.tokenizer, [{"name": "kv-int8"}])
    for line in lines:  # each the plan's generator's own answer for that prompt alone (batch-invariant)
        record = records[line["index"]]
        params = SamplingParams(max_new_tokens=record.get("max_tokens", 5), temperature=record.get("temperature", 0.0),
                                seed=record.get("seed"), stop_token_ids=toy_pydoc_lm.tokenizer.eos_token_id)
        (alone,) = gen.generate([record["prompt"]], params)
        assert line["token_ids"] == alone.token_ids and line["text"] == alone.text
        assert line["completion_tokens"] == len(alone.token_ids) and line["finish_reason"] == alone.finish_reason
    full = out.read_text()
    out.write_text(full.splitlines(keepends=True)[0] + full.splitlines()[1][:10])  # cut off mid-line
    assert cli.main(["run", str(plan_path), "--input", str(source), "--output", str(out), "--device", "cpu"]) == 2
    assert cli.main(["run", str(plan_path), "--input", str(source), "--output", str(out), "--device", "cpu",
                     "--resume"]) == 0
    assert sorted(out.read_text().splitlines()) == sorted(full.splitlines())
    capsys.readouterr()
    # a resume against another input, or another default length, would mix two runs: refused by name
    source.write_text(source.read_text().replace("A list is", "A tuple is"))
    assert cli.main(["run", str(plan_path), "--input", str(source), "--output", str(out), "--device", "cpu",
                     "--resume"]) == 2
    assert "written with another input_sha256" in capsys.readouterr().err
    source.write_text(source.read_text().replace("A tuple is", "A list is"))
    assert cli.main(["run", str(plan_path), "--input", str(source), "--output", str(out), "--device", "cpu",
                     "--resume", "--max-new-tokens", "9"]) == 2
    assert "written with another max_new_tokens" in capsys.readouterr().err
    # --max-errors: the third bad record (index 5) stops the run, with what came before it written in order
    stopped = tmp_path / "stopped.jsonl"
    assert cli.main(["run", str(plan_path), "--input", str(source), "--output", str(stopped), "--device", "cpu",
                     "--max-errors", "2"]) == 1
    assert "3 records failed, more than --max-errors 2" in capsys.readouterr().err
    assert [json.loads(x)["index"] for x in stopped.read_text().splitlines()] == [0, 2, 4]


def test_run_says_when_the_decode_step_compiled_new_graphs_during_the_run(toy_pydoc_lm, tmp_path, capsys, monkeypatch):
    """A compiled plan meets running batch sizes the warm-up did not (the batch shrinks as the last prompts end):
    each new graph costs seconds inside the tokens/s printed, so the run says how many it compiled."""
    from overdrive.core import measure

    graphs = iter(range(100))
    monkeypatch.setattr(measure, "compiled_graphs", lambda: 3 * next(graphs))  # 3 more between the two reads
    plan_path = tmp_path / "plan.json"
    GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=2, max_new_tokens=3, steps=[]).save(plan_path)
    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps({"prompt": "A list is"}) + "\n")
    assert cli.main(["run", str(plan_path), "--input", str(source), "--output", str(tmp_path / "out.jsonl"),
                     "--device", "cpu"]) == 0
    assert "torch.compile compiled 3 new graph(s) of the decode step during the run" in capsys.readouterr().out


def test_run_of_a_prompt_lookup_plan_answers_one_prompt_at_a_time_with_the_same_greedy_tokens(toy_pydoc_lm, tmp_path,
                                                                                             capsys):
    source = tmp_path / "prompts.txt"
    source.write_text("A list is\nThe dictionary\nReturn the\n")
    answers = {}
    for name, steps in (("batched", []), ("lookup", [{"name": "prompt-lookup", "num_tokens": 3}])):
        plan_path = tmp_path / f"{name}.json"
        GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=2, max_new_tokens=12, steps=steps).save(plan_path)
        out = tmp_path / f"{name}.jsonl"
        assert cli.main(["run", str(plan_path), "--input", str(source), "--output", str(out), "--device", "cpu"]) == 0
        answers[name] = [json.loads(x)["token_ids"] for x in out.read_text().splitlines()]
        said = capsys.readouterr().out
        assert ("one prompt at a time (prompt-lookup)" if steps else "continuous batching of up to 2") in said
    assert answers["lookup"] == answers["batched"] and len(answers["batched"]) == 3


@pytest.mark.parametrize("argv, message", [
    (["optimize", "pydoc-lm", "--data", "x.txt"], "--data: not for a causal LM"),
    (["optimize", "minilm", "--max-new-tokens", "5"], "only for a causal LM"),
    (["bench", "pydoc-lm"], "bench it with the plan"),
    (["optimize", "pydoc-lm", "--techniques", "fp8-magic"], "not generation techniques"),
])
def test_flags_that_do_not_fit_a_causal_lm_are_refused_in_one_line(toy_pydoc_lm, argv, message, tmp_path, capsys):
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_candidate_that_fails_in_an_unforeseen_way_is_a_rejected_row_from_python(toy_pydoc_lm, monkeypatch):
    """optimize("pydoc-lm") from Python; a technique whose guard raises (here: a stand-in for Dynamo's recompile-limit
    error, which is not a RuntimeError) is reported as failed, and the others are still measured."""
    import overdrive
    from overdrive.generate import fidelity

    class Unforeseen(Exception):
        pass

    judge = fidelity.judge_generation

    def flaky(reference, candidate, *args, **kwargs):
        if candidate.cache_dtype == __import__("torch").int8:
            raise Unforeseen("recompile limit")
        return judge(reference, candidate, *args, **kwargs)

    monkeypatch.setattr(fidelity, "judge_generation", flaky)
    result = overdrive.optimize("pydoc-lm", device="cpu", techniques=["kv-int8", "bf16"], max_new_tokens=4)
    rows = {r.technique: r for r in result.rows}
    assert rows["kv-int8"].status == "rejected" and "Unforeseen: recompile limit" in rows["kv-int8"].reason
    assert rows["bf16"].fidelity is not None and "kv-int8" not in result.plan.names
    with pytest.raises(overdrive.ConfigError, match="--data|data"):
        overdrive.optimize("pydoc-lm", data="x.txt")


def test_bf16_on_top_of_a_kept_fp16_weight_is_a_row_that_says_they_do_not_compose(toy_pydoc_lm, monkeypatch):
    """FBGEMM's packed fp16 layers take float32 activations: bf16 after them is said so, not a 'failed' traceback.
    (fp16-weight is made the fastest form and every step a clear gain, so that it is kept at toy size; offered
    whatever this CPU's row-count probe says.)"""
    import overdrive
    from overdrive.core.gain import Gain
    from overdrive.generate import quantize, tune

    monkeypatch.setattr(quantize, "_FP16_ROWS", [None])

    monkeypatch.setattr(tune, "pick_form", lambda shapes, rows, forms, compiled: ("fp16-weight", {
        "float32": 2.0, "fp16-weight": 1.0}))
    monkeypatch.setattr(tune, "compare", lambda *a, **k: Gain(ratio=2.0, low=1.9, high=2.1, rounds=4))
    result = overdrive.optimize("pydoc-lm", device="cpu", techniques=["fp16-weight", "bf16"], max_new_tokens=4)
    rows = {r.technique: r for r in result.rows}
    assert rows["fp16-weight"].status == "kept"
    assert rows["bf16"].status == "untried" and "does not compose with the kept fp16-weight" in rows["bf16"].reason


def test_min_gain_0_tries_a_weight_form_even_where_its_layers_time_slower(toy_pydoc_lm):
    """--min-gain 0 keeps every step within budget whatever its speed: the weight form is searched and judged, not
    left untried for its kernel timings."""
    import overdrive

    result = overdrive.optimize("pydoc-lm", device="cpu", techniques=["int8-weight"], max_new_tokens=4, min_gain=0)
    row = {r.technique: r for r in result.rows}["int8-weight"]
    assert row.status in ("kept", "rejected") and row.fidelity is not None, row


def test_a_busy_step_is_decided_on_its_interval_and_a_slower_plan_gets_advice_that_fits_its_batch_size(
        toy_pydoc_lm, monkeypatch):
    """A step timed on a busy machine is kept when its interval's low end clears --min-gain, with a warning that
    its figures are uncertain, as a one-pass technique is (it was rejected whatever its interval, so --min-gain 0
    kept nothing when busy). The plan then measures slower than the baseline at its own batch size and at 8,
    however wide its interval: at 8 the advice is to optimize at 8; at its own size, not that circular advice."""
    import overdrive
    from overdrive.core.gain import Gain
    from overdrive.generate import tune

    def compare(*args, **kwargs):  # the plan's headline passes min_rounds; a step's comparison does not
        return Gain(ratio=0.6, low=0.3, high=0.9, rounds=4) if "min_rounds" in kwargs else \
            Gain(ratio=1.5, low=1.2, high=1.9, rounds=4, busy=True, preempted_rounds=3)

    monkeypatch.setattr(tune, "compare", compare)
    result = overdrive.optimize("pydoc-lm", device="cpu", techniques=["kv-int8"], max_new_tokens=4)
    assert {r.technique: r for r in result.rows}["kv-int8"].status == "kept"
    assert any(w.startswith("kv-int8: the machine was busy") for w in result.warnings), result.warnings
    slower = [w for w in result.warnings if "the plan is slower than the baseline" in w]
    assert len(slower) == 2 and "optimize again on a quieter machine" in slower[0], result.warnings
    assert "for batches of 8, optimize at that batch size" in slower[1]


@requires_cuda
def test_optimize_bench_and_run_a_generation_plan_on_cuda(toy_pydoc_lm, tmp_path, capsys):
    """The whole generation path on a GPU: the compiled decode step (CUDA graphs), bf16 and the int8 KV cache judged
    against fp32 on the GPU, the plan benched and run there, and the run's tokens equal to the plan's own."""
    assert cli.main(["optimize", "pydoc-lm", "--device", "cuda", "--techniques",
                     "compile-decode,kv-int8,bf16,int4-weight", "--max-new-tokens", "6", "--out", str(tmp_path)]) == 0, \
        capsys.readouterr().err
    plan_path = tmp_path / "pydoc-lm" / "plan.json"
    plan = GenerationPlan.load(plan_path)
    rows = {r["technique"]: r for r in json.loads((tmp_path / "pydoc-lm" / "results.json").read_text())["rows"]}
    assert rows["compile-decode"]["fidelity"]["diverged_beyond_ties"] == 0, rows["compile-decode"]
    assert rows["int4-weight"]["status"] == "untried" and "CPU one" in rows["int4-weight"]["reason"]
    assert cli.main(["bench", "pydoc-lm", "--plan", str(plan_path), "--device", "cuda", "--batch-sizes", "1,4",
                     "--out", str(tmp_path)]) == 0
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps({"prompt": p}) for p in ("A list is", "The dictionary", "Return the")))
    out = tmp_path / "out.jsonl"
    assert cli.main(["run", str(plan_path), "--input", str(source), "--output", str(out), "--device", "cuda"]) == 0
    gen = build_generator(toy_pydoc_lm.model, toy_pydoc_lm.tokenizer, plan.steps, device="cuda")
    params = SamplingParams(max_new_tokens=plan.max_new_tokens, stop_token_ids=toy_pydoc_lm.tokenizer.eos_token_id)
    expected = [gen.generate([p], params)[0].token_ids for p in ("A list is", "The dictionary", "Return the")]  # batch 1
    assert [json.loads(x)["token_ids"] for x in out.read_text().splitlines()] == expected


@pytest.mark.parametrize("change, message", [
    ({"steps": ["kv-int8"]}, "a list of objects"), ({"batch_size": 0}, "batch_size is a positive integer"),
    ({"max_new_tokens": "8"}, "max_new_tokens is a positive integer"), ({"steps": [{"name": "bogus"}]}, "unknown"),
    ({"kind": "embedding"}, "not a generation plan")])
def test_a_hand_edited_generation_plan_is_refused_by_name(change, message):
    from overdrive.core.errors import ConfigError

    plan = {**GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=1, max_new_tokens=4).to_dict(), **change}
    with pytest.raises(ConfigError, match=message):
        GenerationPlan.from_dict(plan)


@pytest.mark.parametrize("argv", [["bench", "digits-cnn", "--plan", "PLAN", "--out", "OUT"],
                                  ["export", "PLAN", "--format", "onnx", "--out", "OUT"]], ids=["bench", "export"])
def test_a_generation_plan_given_where_a_one_pass_plan_goes_is_named_for_what_it_is(argv, tmp_path):
    """Not "plan version None is not 1" after the model was built."""
    from tests.fixtures.cli import cli_in_process

    plan = tmp_path / "plan.json"
    GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=1, max_new_tokens=4).save(plan)
    result = cli_in_process(*[{"PLAN": str(plan), "OUT": str(tmp_path / "out")}.get(word, word) for word in argv])
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "is a plan for generating text with 'pydoc-lm'" in result.stderr
    assert f"overdrive bench pydoc-lm --plan {plan}" in result.stderr


def test_run_reads_a_record_holding_a_line_separator_as_one_line(tmp_path):
    """str.splitlines would cut the record at U+2028 and shift every later index."""
    from overdrive.cli.generate_run import _read_prompts

    source = tmp_path / "p.jsonl"
    source.write_text(json.dumps({"prompt": "sep\u2028arator"}, ensure_ascii=False) + "\r\n\n" + '{"prompt": "b"}\n',
                      encoding="utf-8")
    assert list(_read_prompts(source, "prompt")) == [(0, {"prompt": "sep\u2028arator"}), (2, {"prompt": "b"})]
