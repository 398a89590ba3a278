"""Serving a causal LM: OpenAI-compatible completions and chat (plain and streamed), the KServe v2 generate
extension, errors in OpenAI's shape before any KV block is taken, logprobs, the official client, the CLI and a
generator beside encoders. Behaviour under load and faults is in test_serve_generation_load.py."""

from __future__ import annotations

import json

import pytest

from overdrive.generate import Decoder, SamplingParams
from overdrive.generate.continuous import ContinuousGenerator
from overdrive.serve.generation import GenerationServer, listening

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def lm():
    """pydoc-lm's tokenizer and a toy-shaped model trained for 2 steps (as test_generate_cli's fixture)."""
    from overdrive.workloads import pydoc_lm

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pydoc_lm, "STEPS", 2)
        patch.setattr(pydoc_lm, "SHAPE", {**pydoc_lm.SHAPE, "hidden_size": 32, "intermediate_size": 48,
                                          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1})
        return pydoc_lm.build_pydoc_lm(log=None)


def _server(lm, **settings) -> GenerationServer:
    gen = ContinuousGenerator(Decoder.from_hf(lm.model), lm.tokenizer, max_batch_size=4, block_size=8)
    return GenerationServer(gen, "pydoc-lm", **settings)


def _alone(server: GenerationServer, prompt: str, params: SamplingParams):
    """The request answered by a fresh generator of the same decoder, alone."""
    gen = ContinuousGenerator(server.gen.model, server.gen.tokenizer, max_batch_size=1)
    return gen.generate([prompt], params)[0]


def _events(text: str) -> list:
    lines = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completions_chat_and_kserve_answer_what_the_generator_answers_alone(lm):
    from starlette.testclient import TestClient

    server = _server(lm)
    eos = (lm.tokenizer.eos_token_id,)
    with TestClient(server.app) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "pydoc-lm"
        r = client.post("/v1/completions", json={"model": "pydoc-lm", "prompt": "A list is", "max_tokens": 12,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        alone = _alone(server, "A list is", SamplingParams(max_new_tokens=12, stop_token_ids=eos))
        assert body["choices"][0]["text"] == alone.text and body["choices"][0]["finish_reason"] == alone.finish_reason
        assert body["usage"] == {"prompt_tokens": alone.prompt_tokens, "completion_tokens": alone.completion_tokens,
                                 "total_tokens": alone.prompt_tokens + alone.completion_tokens}
        streamed = client.post("/v1/completions", json={"prompt": "A list is", "max_tokens": 12, "temperature": 0,
                                                        "stream": True, "stream_options": {"include_usage": True}})
        chunks = _events(streamed.text)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == alone.text
        assert chunks[-1]["usage"]["completion_tokens"] == alone.completion_tokens
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == alone.finish_reason

        messages = [{"role": "user", "content": "What is a tuple?"}]
        chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10, "temperature": 0})
        assert chat.status_code == 200 and chat.headers["x-overdrive-chat-template"].startswith("plain")
        chat_alone = _alone(server, "user: What is a tuple?\nassistant:",
                            SamplingParams(max_new_tokens=10, stop_token_ids=eos))
        assert chat.json()["choices"][0]["message"] == {"role": "assistant", "content": chat_alone.text}
        chat_stream = _events(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10,
                                                                        "temperature": 0, "stream": True}).text)
        assert chat_stream[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chat_stream) == chat_alone.text

        kserve = client.post("/v2/models/pydoc-lm/generate", json={"text_input": "A list is",
                                                                   "parameters": {"max_tokens": 12}})
        assert kserve.json()["text_output"] == alone.text  # greedy by default, as Triton's generate
        pieces = _events(client.post("/v2/models/pydoc-lm/generate_stream",
                                     json={"text_input": "A list is", "parameters": {"max_tokens": 12}}).text + "data: [DONE]\n\n")
        assert "".join(p["text_output"] for p in pieces) == alone.text
        n3 = client.post("/v1/completions", json={"prompt": "A list is", "max_tokens": 6, "n": 3, "seed": 4}).json()
        assert [c["index"] for c in n3["choices"]] == [0, 1, 2] and n3["usage"]["completion_tokens"] > 0
        metrics = client.get("/metrics").text
        assert "overdrive_time_to_first_token_seconds_count" in metrics and "overdrive_kv_blocks_in_use 0.0" in metrics
        assert "overdrive_prefix_cache_hit_rate" in metrics and "overdrive_kv_blocks_cached" in metrics


@pytest.mark.parametrize("body, status, param, message", [
    ({"prompt": [5] * 5000, "max_tokens": 16}, 400, None, "exceeds the model's"),
    ({"prompt": "A list", "model": "gpt-4"}, 404, "model", "no model 'gpt-4'"),
    ({"prompt": "A list", "temperature": -1}, 400, "temperature", "temperature must be"),
    ({"prompt": "A list", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be"),
    ({"prompt": "A list", "logprobs": 21}, 400, "logprobs", "logprobs must be an integer from 0 to 20"),
    ({"prompt": "A list", "top_logprobs": 2}, 400, "top_logprobs", "a chat completion's field"),
    ({"prompt": "A list", "echo": True}, 400, "echo", "not supported"),
    ({"prompt": "A list", "bogus": 1, "max_tokenz": 5}, 400, "bogus", "unrecognized request argument supplied: bogus, max_tokenz"),
    ({"prompt": ""}, 400, "prompt", "non-empty"),
    ({"prompt": "A list", "n": 0}, 400, "n", "n must be"),
    ({"prompt": "A list", "timeout": 0}, 400, "timeout", "timeout is in seconds"),
    ({"prompt": "A list", "timeout": True}, 400, "timeout", "timeout is in seconds"),
    ({"prompt": "A list", "timeout": "5"}, 400, "timeout", "timeout is in seconds"),
])
def test_bad_requests_get_openais_error_shape_before_taking_blocks(lm, body, status, param, message):
    from starlette.testclient import TestClient

    server = _server(lm)
    with TestClient(server.app) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == param and error["type"]
    assert server.gen.pool.num_free == server.gen.pool.capacity and not server.gen.has_unfinished


def test_an_oversized_or_too_deeply_nested_body_is_refused_in_openais_shape(lm):
    from starlette.testclient import TestClient

    from overdrive.serve.openai_protocol import MAX_REQUEST_BYTES

    server = _server(lm)
    with TestClient(server.app) as client:
        big = client.post("/v1/completions", content=b'{"prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}',
                          headers={"content-type": "application/json"})
        assert big.status_code == 413 and "at most" in big.json()["error"]["message"]
        chunked = client.post("/v1/completions", content=iter([b'{"prompt": "'] + [b"a" * (1 << 20)] * 5 + [b'"}']))
        assert chunked.status_code == 413 and "more than" in chunked.json()["error"]["message"]
        deep = client.post("/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000)
        assert deep.status_code == 400 and "nested too deep" in deep.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "A list", "max_tokens": 2}).status_code == 200


def test_the_official_openai_client_streams_a_completion_and_a_chat_completion(lm):
    openai = pytest.importorskip("openai")
    server = _server(lm)
    eos = (lm.tokenizer.eos_token_id,)
    with listening(server.app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == ["pydoc-lm"]
        stream = client.completions.create(model="pydoc-lm", prompt="A list is", max_tokens=10, temperature=0,
                                           stream=True)
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == _alone(server, "A list is", SamplingParams(max_new_tokens=10, stop_token_ids=eos)).text
        chat = client.chat.completions.create(model="pydoc-lm", messages=[{"role": "user", "content": "A dict?"}],
                                              max_tokens=8, temperature=0, stream=True)
        said = "".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices)
        assert said == _alone(server, "user: A dict?\nassistant:", SamplingParams(max_new_tokens=8, stop_token_ids=eos)).text
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model="pydoc-lm", prompt="A list", temperature=-2)
        plain = client.completions.create(model="pydoc-lm", prompt="A list is", max_tokens=6, temperature=0, logprobs=2)
        assert len(plain.choices[0].logprobs.token_logprobs) == 6 and plain.usage.completion_tokens == 6
        chat = client.chat.completions.create(model="pydoc-lm", messages=[{"role": "user", "content": "A dict?"}],
                                              max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
        assert [len(t.top_logprobs) for t in chat.choices[0].logprobs.content] == [2] * 4


def test_logprobs_are_the_models_and_a_stream_carries_the_same_as_a_whole_answer(lm):
    from starlette.testclient import TestClient

    server = _server(lm)
    eos = (lm.tokenizer.eos_token_id,)
    alone = _alone(server, "A list is", SamplingParams(max_new_tokens=8, stop_token_ids=eos, logprobs=3))
    body = {"prompt": "A list is", "max_tokens": 8, "temperature": 0, "logprobs": 3}
    with TestClient(server.app) as client:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        stream = _events(client.post("/v1/completions", json={**body, "stream": True}).text)
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "A dict?"}],
                                                         "max_tokens": 5, "temperature": 0, "logprobs": True})
        plain = client.post("/v1/completions", json={"prompt": "A list is", "max_tokens": 3}).json()
        one = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "A dict?"}],
                                                        "logprobs": 1})  # true or false only, as OpenAI's
        assert one.status_code == 400 and one.json()["error"]["param"] == "logprobs"
    assert whole["token_logprobs"] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-4)
    assert "".join(whole["tokens"]) == lm.tokenizer.decode(alone.token_ids)  # the stop token's string included
    for j, top in enumerate(whole["top_logprobs"]):  # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(whole["token_logprobs"][j], abs=1e-6) and len(top) <= 3
        assert all(v <= 0 for v in top.values())
    assert whole["text_offset"] == [sum(len(t) for t in whole["tokens"][:j]) for j in range(len(whole["tokens"]))]
    parts = [c["choices"][0]["logprobs"] for c in stream if c.get("choices") and c["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"]
    assert [x for p in parts for x in p["token_logprobs"]] == pytest.approx(whole["token_logprobs"], abs=1e-4)
    assert [x for p in parts for x in p["text_offset"]] == whole["text_offset"]
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == chat.json()["usage"]["completion_tokens"]
    assert all(e["top_logprobs"] == [] and e["bytes"] == list(e["token"].encode()) for e in content)
    assert plain["choices"][0]["logprobs"] is None


def test_serve_of_a_generation_plan_starts_the_generation_server_and_refuses_flags_it_would_ignore(
        lm, tmp_path, monkeypatch, capsys):
    from overdrive import cli
    from overdrive.generate.plan import GenerationPlan
    from overdrive.serve import runner
    from overdrive.workloads import generation

    monkeypatch.setattr(generation, "create_generation_workload", lambda spec, **kw: lm)
    started = {}

    def fake_run_server(server, *, host, port, access_log=False, on_started=None):
        started["server"] = server
        on_started(4321)
        return 0

    monkeypatch.setattr(runner, "run_server", fake_run_server)
    plan = tmp_path / "plan.json"
    GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=2, max_new_tokens=8,
                   steps=[{"name": "kv-int8"}]).save(plan)
    assert cli.main(["serve", str(plan), "--port", "0", "--warmup-s", "0"]) == 0
    said = capsys.readouterr().err
    assert "/v1/completions" in said and "continuous batching of up to 2 sequences" in said, said
    assert isinstance(started["server"], GenerationServer) and started["server"].gen.cache.keys[0].dtype.itemsize == 1
    for extra, message in ((["--grpc-port", "9000"], "--grpc-port 9000: not for a generation plan"),
                           (["--instances", "2"], "--instances 2: not for a generation plan"),
                           ([str(plan)], "2 generation plans given"),
                           (["tests.fixtures.user_models:build", "--model-name", "m"], "--model-name names one model")):
        assert cli.main(["serve", str(plan), *extra]) == 2
        assert message in capsys.readouterr().err
    for step in ({"name": "prompt-lookup"}, {"name": "draft-model", "layers": [0], "steps": 0}):
        speculative = tmp_path / "speculative.json"
        GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=1, max_new_tokens=8, steps=[step]).save(speculative)
        assert cli.main(["serve", str(speculative)]) == 2
        assert f"the plan uses {step['name']}, which verifies one sequence at a time" in capsys.readouterr().err


def test_a_generator_beside_encoders_in_one_server(lm, tmp_path, monkeypatch, capsys):
    """`overdrive serve GEN_PLAN ENCODER`: one app answers the generator's OpenAI and KServe generate endpoints and the
    encoder's v2 infer, health is both, /metrics holds both registries in one valid exposition, and a drain stops both."""
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from overdrive import cli
    from overdrive.generate.plan import GenerationPlan
    from overdrive.serve import runner
    from overdrive.serve.combined import CombinedServer
    from overdrive.workloads import generation

    monkeypatch.setattr(generation, "create_generation_workload", lambda spec, **kw: lm)
    started = {}

    def fake_run_server(server, *, host, port, access_log=False, on_started=None):
        started["server"] = server
        on_started(4321)
        return 0

    monkeypatch.setattr(runner, "run_server", fake_run_server)
    plan = tmp_path / "plan.json"
    GenerationPlan(workload="pydoc-lm", device="cpu", batch_size=2, max_new_tokens=8, steps=[]).save(plan)
    assert cli.main(["serve", str(plan), "tests.fixtures.user_models:build", "--port", "0", "--warmup-s", "0",
                     "--max-batch-size", "4"]) == 0
    said = capsys.readouterr().err
    assert "/v2/models/user_models/infer" in said and "/v1/completions" in said, said
    server = started["server"]
    assert isinstance(server, CombinedServer)
    x = [[0.5] * 16, [-1.0] * 16]
    with TestClient(server.app) as client:
        assert client.get("/v2/health/ready").status_code == 200
        completion = client.post("/v1/completions", json={"prompt": "A list is", "max_tokens": 4, "temperature": 0})
        alone = _alone(server.generator, "A list is", SamplingParams(max_new_tokens=4,
                                                                     stop_token_ids=(lm.tokenizer.eos_token_id,)))
        assert completion.json()["choices"][0]["text"] == alone.text
        kserve = client.post("/v2/models/pydoc-lm/generate", json={"text_input": "A list is",
                                                                   "parameters": {"max_tokens": 4}})
        assert kserve.json()["text_output"] == alone.text
        infer = client.post("/v2/models/user_models/infer", json={"inputs": [
            {"name": "input", "shape": [2, 16], "datatype": "FP32", "data": sum(x, [])}]})
        assert infer.status_code == 200, infer.text
        assert len(infer.json()["outputs"][0]["data"]) == 8
        assert client.get("/v2/models/pydoc-lm/ready").status_code == 200
        assert client.get("/v2/models/user_models/ready").status_code == 200
        assert client.post("/v2/models/nope/infer", json={"inputs": []}).status_code == 404
        assert client.post("/v1/completions", json={"prompt": "A", "model": "user_models"}).status_code == 404
        metrics = client.get("/metrics").text
        names = {f.name for f in text_string_to_metric_families(metrics)}  # parses: no family twice
        assert {"overdrive_generation_requests", "overdrive_requests", "nv_inference_count"} <= names
        client.portal.call(server.drain)  # on the app's own event loop
        assert client.get("/v2/health/ready").status_code == 503
        assert client.post("/v1/completions", json={"prompt": "A list is"}).status_code == 503
        assert client.post("/v2/models/user_models/infer", json={"inputs": [
            {"name": "input", "shape": [1, 16], "datatype": "FP32", "data": x[0]}]}).status_code == 503


def test_a_tiny_temperature_is_greedy_and_a_failed_step_ends_streams_with_an_error_and_frees_blocks(lm, monkeypatch):
    from starlette.testclient import TestClient

    server = _server(lm)
    with TestClient(server.app) as client:
        tiny = client.post("/v1/completions", json={"prompt": "A list is", "max_tokens": 8, "temperature": 1e-45})
        greedy = client.post("/v1/completions", json={"prompt": "A list is", "max_tokens": 8, "temperature": 0})
        assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
        assert 'overdrive_generation_requests_total{outcome="length"} 2.0' in client.get("/metrics").text  # not "cancelled"
        real_choose = server.gen._choose
        calls = {"n": 0}

        def failing_once(logits, seqs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("a kernel failed")
            return real_choose(logits, seqs)

        monkeypatch.setattr(server.gen, "_choose", failing_once)
        streamed = client.post("/v1/completions", json={"prompt": "A list is", "max_tokens": 20, "stream": True})
        assert "generation failed: a kernel failed" in streamed.text and "[DONE]" not in streamed.text
        after = client.post("/v1/completions", json={"prompt": "A list is", "max_tokens": 8, "temperature": 0})
        assert after.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]  # the engine goes on
    assert server.gen.pool.num_free == server.gen.pool.capacity and not server.gen.has_unfinished


@pytest.mark.parametrize("body, expected", [
    ({"prompt": "A list", "max_tokens": None, "n": None}, 200),
    ({"prompt": "\ud800 a list"}, 400),
    ({"prompt": "A list", "seed": 2**70}, 400),
    ({"prompt": "A list", "stream": "yes"}, 400),
    ({"prompt": "A list", "frequency_penalty": 0.5}, 400),
    ({"prompt": "A list", "frequency_penalty": 0}, 200),
])
def test_fields_at_their_defaults_are_taken_and_values_it_cannot_follow_are_400(lm, body, expected):
    from starlette.testclient import TestClient

    server = _server(lm)
    with TestClient(server.app) as client:
        r = client.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == expected, r.text
        if expected == 400:
            assert r.json()["error"]["message"]
        r = client.post("/v2/models/pydoc-lm/generate", json={"text_input": "A list", "parameters": {"bogus": 1}})
        assert r.status_code == 400 and "unknown parameters ['bogus']" in r.json()["error"]["message"]


def test_a_chat_template_writes_its_own_special_tokens_and_encoding_adds_none(lm):
    import copy

    from starlette.testclient import TestClient

    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(lm.tokenizer)
    eos = tok.eos_token  # as a BOS too: encoding with special tokens now prepends one, as Llama's tokenizer does
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{eos} $A", special_tokens=[(eos, tok.eos_token_id)])
    tok.bos_token = eos
    assert tok("x")["input_ids"][0] == tok.eos_token_id
    tok.chat_template = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    gen = ContinuousGenerator(Decoder.from_hf(lm.model), tok, max_batch_size=2)
    server = GenerationServer(gen, "pydoc-lm")
    messages = [{"role": "user", "content": "What is a tuple?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with TestClient(server.app) as client:
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.headers["x-overdrive-chat-template"] == "the tokenizer's"
    assert r.json()["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])
