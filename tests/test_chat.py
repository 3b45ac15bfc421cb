"""``tiered chat`` (issue 26): an interactive chat — the chat template with the history, ``--system``, answers streamed,
Ctrl-C stopping an answer without leaving the chat, end of input leaving with status 0. Driven as a user would, in a
subprocess with its standard input piped; answers compared with stock transformers' greedy ``generate`` on the same
conversation (SmolLM2-135M, the demo's chat model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
N = 12


def _stock_answers(d: Path, turns: list[str], system: str | None) -> list[str]:
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    history: list[dict] = []
    out = []
    for t in turns:
        history.append({"role": "user", "content": t})
        msgs = ([{"role": "system", "content": system}] if system else []) + history
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False)
        a = tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True)
        history.append({"role": "assistant", "content": a})
        out.append(a)
    return out


def _chat(d: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "tiered.cli", "chat", str(d), "--device", "cpu", "--threads", "2",
                             "--max-new-tokens", str(N), *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def test_chat_keeps_the_history_and_the_system_message(smollm2: Path) -> None:
    turns = ["What is the capital of France?", "And of Italy?"]
    want = _stock_answers(smollm2, turns, "You are terse.")
    p = _chat(smollm2, "--system", "You are terse.")
    out, err = p.communicate("\n".join(turns) + "\n", timeout=300)
    assert p.returncode == 0, err
    assert out == "".join(a + "\n" for a in want), (out, want)


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(smollm2: Path) -> None:
    """SIGINT while an answer streams: that answer stops early, the next turn is answered, end of input leaves (0)."""
    p = _chat(smollm2, "--max-new-tokens", "400")
    try:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("Write a very long story about a ship at sea.\n")
        p.stdin.flush()
        first = p.stdout.read(1)  # the answer has started
        assert first
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        p.stdin.write("/reset\nWhat is the capital of France?\n")
        p.stdin.close()
        rest = p.stdout.read()
        err = p.stderr.read() if p.stderr else ""
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "(answer stopped)" in err
    lines = (first + rest).split("\n")
    want = _stock_answers(smollm2, ["What is the capital of France?"], None)[0]
    assert want in lines, (lines, want)
    assert len((first + rest).split()) < 400  # the story stopped well before 400 tokens


def test_a_turn_past_the_position_table_is_refused_and_the_chat_goes_on(smollm2: Path, tmp_path: Path) -> None:
    """A model with learned positions (GPT-2's ``n_positions``): once the history plus ``--max-new-tokens`` would pass
    the table, that turn is refused with a message (stock's embedding would raise IndexError) and the chat goes on;
    ``/reset`` makes room again."""
    import shutil

    d = tmp_path / "gpt2"
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=49152, n_positions=64, bos_token_id=1,
                                  eos_token_id=2)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2 / f, d / f)
    p = _chat(d, "--max-new-tokens", "30")
    out, err = p.communicate("Hello there\nTell me more please\n/reset\nHi\n", timeout=300)
    assert p.returncode == 0, err
    assert err.count("positions this model has") == 1 and "Traceback" not in err, err
    assert len([ln for ln in out.split("\n") if ln]) >= 2  # the first turn and the one after /reset were answered
