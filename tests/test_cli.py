"""``tiered generate`` / ``inspect`` for people, and numbers that agree (issue 10, capabilities 3 and 4).

The CLI runs in subprocesses (``python -m tiered.cli``) on the tiny Llama of ``models.py`` with a
word-level tokenizer built here, offline; generated text is compared with stock ``transformers``'
``generate`` decoded by the same tokenizer. Usage errors are checked on a model directory whose
shard is garbage: a check that came after reading a weight would fail with a HeaderError (exit 1)
instead of the usage error (exit 2) these tests expect. (The shards' headers are checked torch-free just before
the tokenizer loads, or after an ``--ids`` prompt's checks: usage errors that need the loaded tokenizer are
tested on valid shards.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import models
import pytest
import torch
import transformers
from conftest import Checkpoints, streaming_ring_gb

import tiered
import tiered.api  # the package imports it lazily
import tiered.machine  # patched below
import tiered.policy
import tiered.reader
from tiered.cli import flags_for_options, main
from tiered.hostmem import page_up
from tiered.rows import row_eligible
from tiered.stats import GB, GiB, Stats, gb, gib, sig3, size

ROOT = Path(__file__).resolve().parents[1]
NEW = 10  # tokens generated per run
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
ZERO_GB = re.compile(r"(?<![\d.])0(?:\.0*)? GB")  # a zero figure of bytes or GB/s
WORDS = "the a of to and in is it you that he was for on are with as I his they be at one have this from or had by"


def save_tokenizer(d: Path, *, chat_template: str | None) -> None:
    """A word-level tokenizer over the tiny models' 256 ids (specials 0-2 as LlamaConfig's defaults), saved
    the way a Hub model ships one (tokenizer.json, tokenizer_config.json[, chat_template.jinja])."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "user": 3, "assistant": 4, ":": 5}
    for w in WORDS.split():
        vocab.setdefault(w, len(vocab))
    while len(vocab) < 256:
        vocab[f"w{len(vocab)}"] = len(vocab)
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(d)


def with_garbage_shard(src: Path, dst: Path) -> Path:
    """``src``'s config.json (and tokenizer files) with one ``model.safetensors`` of random bytes."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    (dst / "model.safetensors").write_bytes(os.urandom(4096))
    return dst


@pytest.fixture(scope="module")
def dirs(ckpts: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = ckpts["llama"]
    assert not any((base / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    root = tmp_path_factory.mktemp("cli")
    chat = Path(shutil.copytree(base, root / "chat"))
    save_tokenizer(chat, chat_template=CHAT_TEMPLATE)
    plain = Path(shutil.copytree(base, root / "plain"))
    save_tokenizer(plain, chat_template=None)
    return {
        "notok": base,
        "chat": chat,
        "plain": plain,
        "garbage_notok": with_garbage_shard(base, root / "garbage_notok"),
        "garbage_chat": with_garbage_shard(chat, root / "garbage_chat"),
        "garbage_plain": with_garbage_shard(plain, root / "garbage_plain"),
    }


@pytest.fixture(scope="module")
def facts(dirs: dict[str, Path]) -> dict:
    """What the plan says about the model (units, bytes) and a ring that streams it."""
    with tiered.load(dirs["notok"], device="cpu", ring_gb=1) as m:
        plan = m._tiered.plan
        ring_units = [u for u in plan.units if not row_eligible(u)]  # the embedding reads rows instead
        return {"ring_gb": streaming_ring_gb(m), "units": len(plan.units), "model_bytes": plan.weight_bytes,
                "src_bytes": sum(u.src_bytes for u in plan.units), "ring_units": len(ring_units),
                "ring_src_bytes": sum(u.src_bytes for u in ring_units)}


def cli(*args: object, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "tiered.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


_REFS: dict[Path, tuple] = {}


def reference(d: Path, prompt: str, *, chat: bool = False, ids: list[int] | None = None, system: str | None = None,
              **gen) -> tuple[str, list[int]]:
    """Stock transformers: (decoded new text, new ids) for ``prompt`` (or ``ids``; with ``chat``, after ``system``)."""
    if d not in _REFS:
        tok = transformers.AutoTokenizer.from_pretrained(d) if (d / "tokenizer.json").exists() else None
        _REFS[d] = (tok, transformers.AutoModelForCausalLM.from_pretrained(d).eval())
    tok, model = _REFS[d]
    if ids is not None:
        enc = {"input_ids": torch.tensor([ids])}
    elif chat:
        msgs = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}]
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    else:
        enc = tok(prompt, return_tensors="pt")
    seed = gen.pop("seed", None)
    if seed is not None:
        transformers.set_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=NEW, **gen)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    return (tok.decode(new, skip_special_tokens=True) if tok is not None else ""), new


def summary_figure(stderr: str, pattern: str) -> float:
    m = re.search(pattern, stderr)
    assert m, (pattern, stderr)
    return float(m.group(1))


# ---------------------------------------------------------------------------------------------- help


@pytest.mark.parametrize("cmd", ["generate", "inspect", "reshard"])
def test_help_of_each_command_has_a_description_and_examples(cmd: str) -> None:
    r = cli(cmd, "--help")
    assert r.returncode == 0, r.stderr
    assert "examples:" in r.stdout and f"tiered {cmd} " in r.stdout.split("examples:")[1], r.stdout
    if cmd == "generate":
        for flag in ("--prompt", "--chat", "--ids", "--max-new-tokens", "--do-sample", "--temperature", "--top-p",
                     "--top-k", "--seed", "--ring-gb", "--device", "--dtype", "--gpu-gb", "--prefetch", "--threads",
                     "--io"):
            line = next((ln for ln in r.stdout.splitlines() if ln.strip().startswith(flag + " ")
                         or ln.strip() == flag), None)
            assert line is not None, (flag, r.stdout)
        assert "GiB (2**30 bytes)" in r.stdout and "GB (1e9 bytes)" in r.stdout


def test_top_level_help_lists_the_commands() -> None:
    r = cli("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("generate", "inspect", "reshard", "examples:"))


# ---------------------------------------------------------------------------------------------- usage errors

BAD_OPTIONS = [
    (["--ring-gb", "0"], "--ring-gb"),
    (["--ring-gb", "-1"], "--ring-gb"),
    (["--ring-gb", "nan"], "--ring-gb"),
    (["--ring-gb", "lots"], "--ring-gb"),
    (["--gpu-gb", "-1"], "--gpu-gb"),
    (["--prefetch", "-1"], "--prefetch"),
    (["--threads", "0"], "--threads"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--io", "fast"], "--io"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:x"], "--device"),
    (["--dtype", "int8"], "--dtype"),
    (["--do-sample", "--temperature", "0"], "--temperature"),
    (["--do-sample", "--temperature", "-0.5"], "--temperature"),
    (["--do-sample", "--top-p", "0"], "--top-p"),
    (["--do-sample", "--top-p", "1.5"], "--top-p"),
    (["--do-sample", "--top-k", "-1"], "--top-k"),
    (["--do-sample", "--seed", "-3"], "--seed"),
    (["--temperature", "0.7"], "--do-sample"),  # sampling options without sampling
    (["--top-p", "0.9"], "--do-sample"),
    (["--seed", "1"], "--do-sample"),
    (["--chat"], "--chat"),  # with --ids, below
]


@pytest.mark.parametrize(("args", "flag"), BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_option_is_a_usage_error_naming_its_flag(args: list[str], flag: str, dirs: dict[str, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2, the flag named (never the Python option name), before the (garbage) shard is read."""
    with pytest.raises(SystemExit) as e:
        main(["generate", str(dirs["garbage_chat"]), "--ids", "--prompt", "1 2 3", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "tiered generate: error:" in err and flag in err, err
    assert not re.search(r"\b(ring_gb|gpu_gb|max_new_tokens|top_p|top_k)\b", err), err


@pytest.mark.parametrize(("args", "flag"), [(["--ring-gb", "0"], "--ring-gb"), (["--do-sample", "--top-p", "2"], "--top-p")])
def test_usage_error_exit_status_of_the_process(args: list[str], flag: str, dirs: dict[str, Path]) -> None:
    r = cli("generate", dirs["garbage_chat"], "--prompt", "the", *args)
    assert r.returncode == 2 and flag in r.stderr and r.stdout == "", r.stderr


def test_the_garbage_shard_is_an_error_once_reached(dirs: dict[str, Path]) -> None:
    """What makes the usage-error tests mean something: with good options the garbage shard fails (exit 1)."""
    r = cli("generate", dirs["garbage_chat"], "--ids", "--prompt", "1 2 3", "--device", "cpu")
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("tiered: error:") and "model.safetensors" in r.stderr, r.stderr


def test_text_prompt_without_tokenizer_says_pass_ids(dirs: dict[str, Path]) -> None:
    r = cli("generate", dirs["garbage_notok"], "--prompt", "the dog is in the house")
    assert r.returncode == 2, r.stderr
    assert "no tokenizer" in r.stderr and "--ids" in r.stderr, r.stderr


def test_chat_without_a_template_names_chat(dirs: dict[str, Path]) -> None:
    r = cli("generate", dirs["garbage_plain"], "--chat", "--prompt", "the dog")
    assert r.returncode == 2, r.stderr
    assert "--chat" in r.stderr and "chat template" in r.stderr, r.stderr


def test_chat_template_check_uses_the_loaded_tokenizer(tmp_path: Path, dirs: dict[str, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A tokenizer_config.json that names an empty template: the tokenizer itself has none. (Valid shards: a bad
    shard is reported first, before the tokenizer loads: test_a_bad_or_truncated_shard_is_reported_before_torch_loads.)"""
    d = Path(shutil.copytree(dirs["plain"], tmp_path / "m"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ""
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["generate", str(d), "--chat", "--prompt", "the dog"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--chat" in err, err


@pytest.mark.parametrize("what", ["missing", "file", "no_config", "hub_id"])
def test_model_dir_errors(what: str, tmp_path: Path, dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    path = {"missing": str(tmp_path / "nope"), "file": str(dirs["garbage_chat"] / "model.safetensors"),
            "no_config": str(tmp_path), "hub_id": "someone/some-model"}[what]
    for cmd in ("generate", "inspect"):
        with pytest.raises(SystemExit) as e:
            main([cmd, path])
        err = capsys.readouterr().err
        assert e.value.code == 2, err
        want = {"missing": "no such directory", "file": "is a file, not a directory", "no_config": "no config.json",
                "hub_id": "Hub id"}[what]
        assert f"tiered {cmd}: error: MODEL_DIR" in err and want in err, err


def test_ids_are_checked_against_the_vocabulary(dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    for prompt, want in (("1 2 9999", "[0, 256)"), ("one two", "token ids such as"), ("", "no token ids")):
        with pytest.raises(SystemExit) as e:
            main(["generate", str(dirs["garbage_notok"]), "--ids", "--prompt", prompt])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--ids" in err and want in err, err


def test_past_the_position_table_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2's learned positions end at n_positions: a prompt plus new tokens past it is a usage error (exit 2,
    before any weight is read: the shard here is garbage), not an IndexError traceback."""
    d = tmp_path / "g"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                               "n_positions": 16, "vocab_size": 64}))
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(SystemExit) as e:
        main(["generate", str(d), "--ids", "--prompt", " ".join(["5"] * 10), "--max-new-tokens", "7"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--max-new-tokens (7)" in err and "16 positions" in err, err


def test_option_errors_raised_by_load_speak_in_flags(dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """tiered.load's own checks (ring smaller than a unit: known only from the plan) come back as usage errors."""
    with pytest.raises(SystemExit) as e:
        main(["generate", str(dirs["notok"]), "--ids", "--prompt", "1 2 3", "--device", "cpu", "--ring-gb", "1e-6",
              "--io", "pread"])  # (with mmap, the CPU computes on the file mapping and needs no ring for a unit)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "--ring-gb 1e-06" in err and re.search(r"pass --ring-gb >= [0-9.]+", err) and "ring_gb" not in err, err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            main(["generate", str(dirs["notok"]), "--ids", "--prompt", "1 2 3", "--device", "cuda"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--device 'cuda'" in err and "CUDA is not available" in err, err


def test_flags_for_options() -> None:
    assert flags_for_options("unit 'x' needs 0.002 GiB but ring_gb=1e-06; pass ring_gb >= 0.002") == \
        "unit 'x' needs 0.002 GiB but --ring-gb 1e-06; pass --ring-gb >= 0.002"
    assert flags_for_options("device='cuda' but CUDA is not available; pass device='cpu'") == \
        "--device 'cuda' but CUDA is not available; pass --device 'cpu'"
    assert flags_for_options("threads must be an integer >= 1 (reader threads)") == \
        "--threads must be an integer >= 1 (reader threads)"
    assert flags_for_options("model.io_proj is fine; the dtype plan") == "model.io_proj is fine; the dtype plan"


# A fresh interpreter that loads tiered.cli without running tiered/__init__.py (which imports tiered.api, hence
# torch) and with a stand-in for tiered.reshard (another module's imports): what cli.py itself imports to print
# help and usage errors, and how long each takes once the interpreter is up.
# Runs each argv of the JSON list in sys.argv[-1] through tiered.cli.main; prints each exit status and seconds, then
# which heavy modules got imported (the last line of stdout).
_DRIVE = r"""
from tiered.cli import main
out = []
for argv in json.loads(sys.argv[-1]):
    t0 = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out.append([argv, code, time.perf_counter() - t0])
heavy = sorted(m for m in ("torch", "transformers", "numpy", "safetensors") if m in sys.modules)
print(json.dumps({"runs": out, "heavy": heavy}))
"""
_STANDALONE = r"""
import json, sys, time, types
pkg = types.ModuleType("tiered"); pkg.__path__ = [sys.argv[1]]; sys.modules["tiered"] = pkg
fake = types.ModuleType("tiered.reshard")
fake.add_parser = lambda sub: sub.add_parser("reshard")
sys.modules["tiered.reshard"] = fake
""" + _DRIVE


def test_help_and_usage_errors_import_no_torch(dirs: dict[str, Path]) -> None:
    g, n, p = str(dirs["garbage_chat"]), str(dirs["garbage_notok"]), str(dirs["garbage_plain"])
    cases = [["--help"], ["generate", "--help"], ["inspect", "--help"],
             ["generate", g, "--ring-gb", "0"], ["generate", g, "--do-sample", "--top-p", "1.5"],
             ["generate", g, "--temperature", "0.5"], ["generate", g, "--device", "tpu"],
             ["generate", n, "--prompt", "the dog"],  # no tokenizer: pass --ids
             ["generate", p, "--chat"],  # no chat template file
             ["generate", g, "--ids", "--prompt", "1 x"], ["generate", g + "-missing"], ["inspect", g + "-missing"],
             ["inspect", g, "--dtype", "int4"]]
    r = subprocess.run([sys.executable, "-c", _STANDALONE, str(ROOT / "tiered"), json.dumps(cases)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for argv, code, _secs in res["runs"]:
        assert code == (0 if argv[-1] == "--help" else 2), (argv, code, r.stderr)
    assert res["heavy"] == [], res


def test_a_bad_or_truncated_shard_is_reported_before_torch_loads(dirs: dict[str, Path], tmp_path: Path) -> None:
    """generate and chat read every weight file's header torch-free (tiered.header.check_shard) after the usage checks:
    a garbage shard or one cut short is a runtime error (exit 1) naming the file, with no torch imported."""
    cut = Path(shutil.copytree(dirs["chat"], tmp_path / "cut"))
    shard = sorted(cut.glob("*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size - 100)
    g = str(dirs["garbage_chat"])
    cases = [["generate", g, "--prompt", "hi"], ["generate", str(cut), "--prompt", "hi"],
             ["generate", str(cut), "--ids", "--prompt", "1 2"], ["chat", str(cut)]]
    r = subprocess.run([sys.executable, "-c", _STANDALONE, str(ROOT / "tiered"), json.dumps(cases)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert [code for _, code, _ in res["runs"]] == [1, 1, 1, 1], (res, r.stderr)
    assert res["heavy"] == [], res
    assert r.stderr.count(str(shard)) == 3 and "model.safetensors" in r.stderr


def test_tiered_help_imports_no_torch_end_to_end() -> None:
    r = subprocess.run([sys.executable, "-c", "import sys; from tiered.cli import main\ntry: main(['--help'])\n"
                        "except SystemExit: pass\nprint('torch' in sys.modules)"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.stdout.strip().splitlines()[-1] == "False", r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------- generation


def test_greedy_text_equals_transformers_streamed(dirs: dict[str, Path], facts: dict) -> None:
    d = dirs["chat"]
    prompt = "I was at one"
    t0 = time.perf_counter()
    r = cli("generate", d, "--prompt", prompt, "--max-new-tokens", NEW, "--ring-gb", facts["ring_gb"], "--device", "cpu")
    assert r.returncode == 0, r.stderr
    want, new = reference(d, prompt, do_sample=False)
    assert want.strip() and len(set(new)) > 2, want  # a real continuation, not one repeated token
    assert r.stdout == want + "\n", (r.stdout, want)
    other = cli("generate", d, "--prompt", "of to and", "--max-new-tokens", NEW, "--ring-gb", facts["ring_gb"],
                "--device", "cpu")
    assert other.returncode == 0 and other.stdout == reference(d, "of to and", do_sample=False)[0] + "\n"
    assert other.stdout != r.stdout  # the prompt matters
    # stderr: what streamed, in GB; memory in GiB; per token = exactly the streamed units (no idle prefetch)
    err = r.stderr
    assert f"{len(new)} tokens in " in err and "tokens/s" in err, err
    n_units = facts["ring_units"]
    per_token = summary_figure(err, r"streamed [0-9.]+ GB \(([0-9.]+) GB/token")
    units_gb = summary_figure(err, rf"the {n_units} streamed units are ([0-9.]+) GB")
    rows = re.search(r"plus ([0-9.]+) (GB|MB|kB|B) of embedding rows in all", err)  # small: in the unit it reaches
    assert rows, err
    rows_gb = float(rows[1]) * {"GB": 1e9, "MB": 1e6, "kB": 1e3, "B": 1}[rows[2]] / GB
    total = summary_figure(err, r"streamed ([0-9.]+) GB \(")
    assert units_gb == pytest.approx(facts["ring_src_bytes"] / GB, rel=1e-2), (units_gb, facts)
    # every pass: the ring units, plus the rows its ids look up (the prompt's, then one per token)
    assert total == pytest.approx(len(new) * units_gb + rows_gb, rel=1e-2), err
    assert per_token == pytest.approx(total / len(new), rel=1e-2), err
    assert 0 < rows_gb < facts["src_bytes"] - facts["ring_src_bytes"], err  # rows, not the table
    # CPU zero copy: every streamed unit computes on the mapping; the row-read embedding is not counted among them
    assert f"; all {n_units} compute on the file mapping (zero copy)" in err, err
    model_gib = summary_figure(err, r"model ([0-9.]+) GiB")
    assert model_gib == pytest.approx(facts["model_bytes"] / 2**30, rel=1e-2), err
    assert not ZERO_GB.search(err) and "resident" not in err.splitlines()[1], err
    assert "capped" not in err, err  # this ring is smaller than the model: used as given
    assert time.perf_counter() - t0 < 300


def test_generate_summary_counts_a_linear_unit_computed_in_pieces_of_rows(tmp_path: Path) -> None:
    """A head larger than the ring computes in pieces of rows on the file mapping (CPU zero copy): it is not one of the
    streamed units the summary lists, so the summary names it with its bytes, and the figures add up to the bytes per
    token (before: "the N streamed units are X GB" and a per-token figure larger by the head, unexplained). Small byte
    counts are printed in kB/MB, not "0.0000092 GB"."""
    from tiered.cli import _summary

    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    d = models.save_model(transformers.LlamaForCausalLM(cfg), tmp_path / "m", seed=3, dtype=torch.float32,
                          max_shard_size=None)
    with tiered.load(d, device="cpu", ring_gb=(512 << 10) / GiB) as m, torch.no_grad():
        p = m._tiered.placement
        head = [m._tiered.plan.units[i] for i in p.linear_pieces]
        assert [u.name for u in head] == ["lm_head"], p.linear_pieces
        before = tiered.stats(m).snapshot()
        m(torch.randint(0, 4096, (1, 5), generator=torch.Generator().manual_seed(4)))
        after = tiered.stats(m).snapshot()
        line = _summary(d, m, before, after, n_new=1, load_s=0.1, gen_s=0.1)[1]
    assert f"plus 1 linear unit larger than the ring ({gb(head[0].src_bytes)}) computed in pieces of rows" in line, line
    units = summary_figure(line, r"the \d+ streamed units are ([0-9.]+) GB")
    rows = re.search(r"plus ([0-9.]+) (kB|B) of embedding rows in all", line)  # 5 rows of 256 bytes: kB, not GB
    assert rows and "e-" not in line, line
    per_token = summary_figure(line, r"\(([0-9.]+) GB/token")
    assert per_token == pytest.approx(units + head[0].src_bytes / GB, rel=2e-2), line


def test_chat_text_equals_transformers_resident(dirs: dict[str, Path], facts: dict) -> None:
    d = dirs["chat"]
    r = cli("generate", d, "--chat", "--prompt", "you and I", "--max-new-tokens", NEW, "--ring-gb", 1, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    want, _ = reference(d, "you and I", chat=True, do_sample=False)
    assert r.stdout == want + "\n", (r.stdout, want)
    assert want != reference(d, "you and I", do_sample=False)[0]  # the template changed the input
    err = r.stderr
    assert f"all {facts['units']} units resident in the ring" in err and "nothing streamed per token" in err, err
    assert not ZERO_GB.search(err), err  # no "streamed 0.00 GB at 0.00 GB/s"
    assert "(--ring-gb 1 capped: the whole model fits in less)" in err, err  # a tiny model: the ring was capped


def _counted(text: str) -> list[tuple[int, str]]:
    """Every ``N unit(s)`` / ``N embedding(s)`` count in ``text``: (N, noun as written)."""
    return [(int(m[1]), m[2]) for m in re.finditer(r"(?<![\d.])(\d+) (units?|embeddings?)\b", text)]


@pytest.mark.parametrize("case", ["one_streamed", "llama", "gpt2"])
def test_generate_summary_counts_agree_and_are_grammatical(case: str, ckpts: Checkpoints,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`tiered generate`'s lines after the text: each count is the placement's (the units streamed through the ring,
    those of them on the file mapping, the embeddings read by row), says what it counts (no "of them" after the
    embeddings' clause) and agrees with its noun in number ("1 unit is", "2 units are"). ``one_streamed``: a host
    tier holds every streamed unit but one; ``gpt2``: two embeddings read by row (wte, wpe)."""
    d = ckpts["gpt2" if case == "gpt2" else "llama"]
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        ring = streaming_ring_gb(probe)
    opts: dict = {"ring_gb": ring}
    if case == "one_streamed":  # a host tier of every streamed unit's slot but the smallest
        with tiered.load(d, device="cpu", ring_gb=ring) as m:
            p = tiered.stats(m).placement
            slots = sorted(page_up(m._tiered.plan.units[i].nbytes) for i in p.streamed)
        opts["host_gb"] = (sum(slots) - slots[0]) / GiB
    with tiered.load(d, device="cpu", **opts) as m:
        p = tiered.stats(m).placement
        ring_units, mapped, rows = set(p.streamed) - set(p.host), set(p.mapped), len(p.rows)
    n, on_map = len(ring_units), len(ring_units & mapped)
    assert (n == 1) == (case == "one_streamed") and on_map and rows == (2 if case == "gpt2" else 1), (p, case)
    main(["generate", str(d), "--ids", "--prompt", "1 2 3", "--max-new-tokens", "2", "--device", "cpu",
          *[f for k, v in opts.items() for f in ("--" + k.replace("_", "-"), repr(v))]])
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if " tokens in " in ln)
    said = re.search(r"the (\d+) streamed (unit is|units are) ", line)
    assert said and int(said[1]) == n and (said[2] == "unit is") == (n == 1), line
    said = re.search(r"; (it computes|all (\d+) compute|(\d+) of the (\d+) (computes?)) on the file mapping", line)
    assert said, line
    got = (1, 1) if said[1] == "it computes" else (int(said[2]),) * 2 if said[2] else (int(said[3]), int(said[4]))
    assert got == (on_map, n), line
    assert said[5] is None or (said[5] == "computes") == (on_map == 1), line
    said = re.search(r"\((\d+) (embeddings?) read by row\)", line)
    assert said and int(said[1]) == rows, line
    assert "of them" not in line, line
    stats_line = next(ln for ln in err.splitlines() if ln.startswith("[tiered] read "))
    said = re.search(r"(\d+) units? (computes?) on the file mapping", stats_line)
    assert said and int(said[1]) == len(mapped) and (said[2] == "computes") == (len(mapped) == 1), stats_line
    assert "units loaded" in stats_line or "unit loaded" in stats_line, stats_line  # loads over passes, not units
    for k, noun in _counted(line) + _counted(stats_line):  # "1 unit", "2 units"
        assert (k == 1) == (not noun.endswith("s")), (k, noun, line, stats_line)


def test_chat_with_a_system_message_equals_transformers(dirs: dict[str, Path]) -> None:
    """``--system`` (issue 26) goes before the user's message in the chat template, as stock's template renders it;
    without ``--chat`` it is a usage error."""
    d = dirs["chat"]
    r = cli("generate", d, "--chat", "--system", "be terse", "--prompt", "you and I", "--max-new-tokens", NEW,
            "--device", "cpu")
    assert r.returncode == 0, r.stderr
    want, _ = reference(d, "you and I", chat=True, system="be terse", do_sample=False)
    assert r.stdout == want + "\n", (r.stdout, want)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    plain = tok.apply_chat_template([{"role": "user", "content": "you and I"}], add_generation_prompt=True)
    with_sys = tok.apply_chat_template([{"role": "system", "content": "be terse"}, {"role": "user", "content": "you and I"}],
                                       add_generation_prompt=True)
    assert plain != with_sys  # the template renders the system message: the test can fail
    r = cli("generate", d, "--system", "be terse", "--prompt", "you and I", "--device", "cpu")
    assert r.returncode == 2 and "--system" in r.stderr and "--chat" in r.stderr, r.stderr


def test_ids_output_streams_one_id_at_a_time(capsys: pytest.CaptureFixture[str]) -> None:
    """``--ids`` output is printed as each id is generated (issue 26), not all at the end: the streamer skips the
    prompt, writes every new id at once, then a newline."""
    import torch

    from tiered.cli import _IdStreamer

    s = _IdStreamer()
    s.put(torch.tensor([[1, 2, 3]]))  # the prompt
    assert capsys.readouterr().out == ""
    s.put(torch.tensor([42]))
    assert capsys.readouterr().out == "42"
    s.put(torch.tensor([7]))
    assert capsys.readouterr().out == " 7"
    s.end()
    assert capsys.readouterr().out == "\n"


def test_ids_in_ids_out_without_a_tokenizer(dirs: dict[str, Path]) -> None:
    ids = [5, 17, 42, 99, 3]
    r = cli("generate", dirs["notok"], "--ids", "--prompt", " ".join(map(str, ids)), "--max-new-tokens", NEW,
            "--device", "cpu")
    assert r.returncode == 0, r.stderr
    _, want = reference(dirs["notok"], "", ids=ids, do_sample=False)
    assert r.stdout.split() == [str(i) for i in want], (r.stdout, want)


def test_prompt_dash_reads_standard_input(dirs: dict[str, Path]) -> None:
    """``--prompt -`` takes the prompt from standard input (issue 26): the tokens equal stock's for the same ids; an
    empty standard input is a usage error (exit 2) that says how to pass one."""
    ids = [5, 17, 42, 99, 3]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "tiered.cli", "generate", str(dirs["notok"]), "--ids", "--prompt", "-",
           "--max-new-tokens", str(NEW), "--device", "cpu"]
    r = subprocess.run(cmd, input=" ".join(map(str, ids)) + "\n", capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=env)
    assert r.returncode == 0, r.stderr
    _, want = reference(dirs["notok"], "", ids=ids, do_sample=False)
    assert r.stdout.split() == [str(i) for i in want], (r.stdout, want)
    r = subprocess.run(cmd, input="", capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 2 and "standard input was empty" in r.stderr, r.stderr


def test_sampling_options_reach_generate(dirs: dict[str, Path]) -> None:
    d = dirs["chat"]
    opts = {"temperature": 1.5, "top_p": 0.95, "top_k": 50, "seed": 3}
    args = ["--do-sample"] + [x for k, v in opts.items() for x in ("--" + k.replace("_", "-"), v)]
    r = cli("generate", d, "--prompt", "I was at one", "--max-new-tokens", NEW, "--ring-gb", 1, "--device", "cpu", *args)
    assert r.returncode == 0, r.stderr
    want, _ = reference(d, "I was at one", do_sample=True, **opts)
    assert r.stdout == want + "\n", (r.stdout, want)
    assert want != reference(d, "I was at one", do_sample=False)[0]  # sampling, not greedy


# ---------------------------------------------------------------------------------------------- stats


def _wait_idle(m: torch.nn.Module, timeout: float = 30) -> None:
    """Until every read-ahead job the last pass issued has finished (the loader is idle)."""
    end = time.monotonic() + timeout
    while any(not f.done() for f in list(m._tiered.streamer.pending.values())):
        assert time.monotonic() < end, "prefetch did not finish"
        time.sleep(0.01)


def test_brief_counts_embeddings_read_by_rows_apart_and_says_whose_peak_rss(ckpts: Checkpoints, facts: dict) -> None:
    """``Stats.brief()``: the units streamed are the placement's streamed ones (an embedding read by rows is counted
    apart, not among them: before, "N of N units streamed" with one of them never streamed), and the peak RSS is
    said to be the process's (VmHWM), not tiered's alone."""
    with tiered.load(ckpts["llama"], device="cpu", ring_gb=facts["ring_gb"]) as m, torch.no_grad():
        m(torch.tensor([[5, 17, 42, 99]]))
        p = tiered.stats(m).placement
        line = tiered.stats(m).brief()
    n = len(p.streamed) + len(p.host)
    assert p.rows and not p.resident and n == facts["units"] - len(p.rows), p
    assert f"{n} of {facts['units']} units streamed ({len(p.rows)} embedding read by rows)" in line, line
    assert "process peak RSS" in line and "VmHWM" in line, line


@pytest.mark.parametrize("prefetch", [1, 2])
def test_bytes_of_a_pass_are_the_units_it_used(prefetch: int, ckpts: Checkpoints, facts: dict) -> None:
    """One pass counts exactly its units' bytes (from the plan), however much the idle lookahead read ahead.

    The lookahead at the end of a pass reads the next pass's first units while the model is idle; counting
    bytes when read (the old accounting) gave the first pass those bytes too.
    """
    ids = torch.tensor([[5, 17, 42, 99]])
    with tiered.load(ckpts["llama"], device="cpu", ring_gb=facts["ring_gb"], prefetch=prefetch) as m:
        plan = m._tiered.plan
        p = tiered.stats(m).placement
        ring_units = sorted([*p.host, *p.streamed])  # the embedding reads its rows instead (tiered/rows.py)
        assert len(ring_units) == len(plan.units) - 1
        emb = next(u for u in plan.units if u.index not in ring_units).targets[0]
        rows = len(set(ids.flatten().tolist())) * emb.shape[1] * emb.copies[0].src.dtype.itemsize
        per_pass = sum(plan.units[j].src_bytes for j in ring_units) + rows
        s0 = tiered.stats(m).snapshot()
        assert s0["resident_units"] == 0 and s0["read_bytes"] == s0["streamed_bytes"] == 0, s0
        last = s0
        for n in (1, 2, 3):
            with torch.no_grad():
                m(input_ids=ids)
            _wait_idle(m)
            s = tiered.stats(m).snapshot()
            ahead = sum(plan.units[j].src_bytes for j in m._tiered.streamer.pending)
            assert ahead > 0  # the next pass's first units were really read while idle
            assert s["streamed_bytes"] - last["streamed_bytes"] == per_pass, (n, s)
            assert s["embedding_bytes"] == n * rows, s
            assert s["streamed_bytes"] == n * per_pass and s["units_streamed"] == n * len(ring_units), s
            assert s["prefetch_idle_bytes"] == ahead, (s, ahead)
            assert s["read_bytes"] == s["load_bytes"] + s["streamed_bytes"] + s["prefetch_idle_bytes"], s
            assert s["read_bytes"] > n * per_pass  # what the old per-read count would have charged to n passes
            last = s
        text = str(tiered.stats(m))
        assert f"{gb(3 * per_pass)} used by passes ({3 * len(ring_units)} units loaded, {size(3 * rows)} of embedding rows)" \
            in text, text
        assert f"{gb(ahead)} read ahead and not used (yet)" in text, text


def test_resident_model_reads_once_and_says_so(ckpts: Checkpoints, facts: dict) -> None:
    with tiered.load(ckpts["llama"], device="cpu", ring_gb=1) as m:
        for _ in range(2):
            with torch.no_grad():
                m(input_ids=torch.tensor([[1, 2, 3]]))
        s = tiered.stats(m).snapshot()
        assert s["resident_units"] == s["units"] == facts["units"], s
        assert s["load_bytes"] == s["read_bytes"] == facts["src_bytes"] and s["streamed_bytes"] == 0, s
        assert s["prefetch_idle_bytes"] == 0, s
        text = str(tiered.stats(m))
        assert f"all {facts['units']} units resident, read once at load; nothing streams" in text, text
        assert "used by passes" not in text and not ZERO_GB.search(text), text


def test_figures_carry_their_unit_and_three_significant_digits() -> None:
    assert [sig3(x) for x in (2.049, 17.69, 362.4, 0.000362, 0.0)] == ["2.05", "17.7", "362", "0.000362", "0"]
    assert gb(2_200_000_000) == "2.20 GB" and gib(2.05 * 2**30) == "2.05 GiB"
    assert gb(362_000) == "0.000362 GB"  # a tiny model's bytes are not "0.00 GB"
    s = Stats(read_bytes=3 * 10**9, read_s=2.0, streamed_bytes=2 * 10**9, ring_bytes=2**30, units=4)
    text = str(s)
    assert "read 3.00 GB at 1.50 GB/s" in text and "2.00 GB used by passes" in text, text
    assert "1.00 GB read ahead" in text and "of 1.00 GiB" in text, text
    # every number is followed by its unit (or is a count: units, hits/misses, seconds)
    for m in re.finditer(r"(\d+(?:\.\d+)?)( ?)(\S*)", text):
        assert m.group(3).rstrip(";,)") in {"GB", "GB/s", "GiB", "s", "units", "of", "at", "used", "read", ""} \
            or "/" in m.group(0), (m.group(0), text)


def test_generate_moe_with_an_expert_cache(tmp_path: Path) -> None:
    """A Mixtral streamed with routed experts and --expert-cache-gb: stock's greedy ids, and the summary says how
    many experts the cache holds and how many picks it served."""
    import models

    d = models.mixtral(tmp_path / "moe", num_experts=8, top_k=2, max_shard_size="200KB")
    ids = [5, 17, 42, 99, 3]
    layer = max(sum(p.numel() * p.element_size() for p in lay.parameters())
                for lay in transformers.AutoModelForCausalLM.from_pretrained(d).model.layers)
    r = cli("generate", d, "--ids", "--prompt", " ".join(map(str, ids)), "--max-new-tokens", NEW, "--device", "cpu",
            "--ring-gb", layer * 0.6 / 2**30, "--expert-cache-gb", 0.001)
    assert r.returncode == 0, r.stderr
    _, want = reference(d, "", ids=ids, do_sample=False)
    assert r.stdout.split() == [str(i) for i in want], (r.stdout, want)
    assert "routed experts" in r.stderr and "the expert cache holds" in r.stderr, r.stderr
    r = cli("generate", d, "--ids", "--prompt", "1 2", "--device", "cpu", "--expert-cache-gb", -1)
    assert r.returncode == 2 and "--expert-cache-gb" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------- inspect --io


def _inspect_json(*args: object) -> dict:
    r = cli("inspect", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("tied", [True, False])
def test_inspect_units_says_a_tied_head_reads_its_embeddings_bytes(tmp_path: Path, tied: bool) -> None:
    """`tiered inspect --units`: a tied head is a unit of its own that reads the embedding's checkpoint bytes (no
    tensor of its own: the listed sizes then add up to more than the model), so the listing says so, by name, in the
    text and the JSON (``same_bytes_as``); an untied head says nothing (a new user's trial, twenty-third session)."""
    import models
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    d = models.save_model(transformers.LlamaForCausalLM(cfg), tmp_path / "m", seed=1, dtype=torch.float32,
                          max_shard_size=None)
    units = {u["name"]: u for u in _inspect_json(d, "--units")["units"]}
    assert units["lm_head"]["same_bytes_as"] == ("model.embed_tokens" if tied else None)
    assert all(u["same_bytes_as"] is None for n, u in units.items() if n != "lm_head")
    r = cli("inspect", d, "--units")
    assert r.returncode == 0 and ("(tied: model.embed_tokens's bytes)" in r.stdout) == tied, r.stdout


def test_inspect_io_changes_the_cpu_placement_as_load_does(dirs: dict[str, Path], facts: dict) -> None:
    """On the CPU, --io decides which streamed units compute on the file mapping (zero copy: io=mmap only) and which
    are copied into the ring: inspect's placement names them as tiered.load maps them, says which io it assumed,
    and the units' tiers do not change with it."""
    d, ring = dirs["notok"], facts["ring_gb"]  # a ring that streams the model
    got = {}
    for io in ("mmap", "pread", "direct"):
        pl = _inspect_json(d, "--ring-gb", ring, "--io", io)["placement"]
        assert pl["options"]["io"] == io == pl["io"]
        with tiered.load(d, device="cpu", ring_gb=ring, io=io) as m:
            assert set(pl["mapped"]) == set(m._tiered.streamer.loader.mapped), io
            assert len(pl["mapped"]) == tiered.stats(m).mapped_units and not pl["page_cache"]
        got[io] = pl
    streamed = got["mmap"]["streamed"]
    assert streamed and sorted(got["mmap"]["mapped"]) == sorted(streamed)  # the tiny Llama: every one maps
    assert got["pread"]["mapped"] == got["direct"]["mapped"] == []
    for io in ("pread", "direct"):
        assert {k: got[io][k] for k in ("resident", "host", "streamed", "rows", "units")} == \
            {k: got["mmap"][k] for k in ("resident", "host", "streamed", "rows", "units")}
    n = len(streamed)
    r = cli("inspect", d, "--ring-gb", ring, "--io", "direct")
    assert r.returncode == 0 and "prefetch=2, io=direct)" in r.stdout, r.stdout
    assert f"io=direct: 0 of the {n} streamed units compute on views of the file mapping" in r.stdout, r.stdout
    r = cli("inspect", d, "--ring-gb", ring)  # no --io: tiered.load's default
    assert r.returncode == 0 and f"io=mmap: {n} of the {n} streamed units" in r.stdout, r.stdout
    r = cli("inspect", d, "--io", "pread")  # --io alone asks for the placement (default ring: 4 GiB on this host)
    assert r.returncode == 0 and "placement (cpu, ring_gb=4 (automatic: the default 4 GiB" in r.stdout, r.stdout
    assert "io=pread)" in r.stdout, r.stdout


def test_inspect_says_the_default_ring_here(dirs: dict[str, Path]) -> None:
    """``tiered inspect`` says what ``ring_gb`` not given picks on this machine, and why (issue 23), as tiered.load
    then takes it."""
    from tiered.hostmem import host_memory_available
    from tiered.policy import auto_ring_bytes

    d = dirs["notok"]
    dr = _inspect_json(d, "--units")["default_ring"]
    avail, where = host_memory_available()
    ring, why = auto_ring_bytes(avail, where, False, 0)
    assert dr["gb"] == ring / 2**30 > 0 and where in dr["why"]
    assert _inspect_json(d)["default_ring"]["gb"] == dr["gb"]  # from the headers alone: the same ring (the model fits)
    r = cli("inspect", d)
    assert r.returncode == 0 and f"default ring here (ring_gb not given): {ring / 2**30:.3g} GiB" in r.stdout, r.stdout
    r = cli("inspect", d, "--units")
    assert r.returncode == 0 and f"default ring here (ring_gb not given): {ring / 2**30:.3g} GiB" in r.stdout, r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("default ring here"))
    assert "((" not in line and "))" not in line, line  # one level of parentheses: readable
    r = cli("inspect", d, "--units", "--ring-gb", 0.01)  # a ring given: the default's line says it is not the one used
    assert r.returncode == 0 and "default ring here (ring_gb not given; not used: --ring-gb given)" in r.stdout, r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("placement ("))
    assert "((" not in line and "))" not in line and "host_gb=0 (none: ring_gb given" in line, line
    assert dr["host_why"].startswith("none: the whole model stays loaded") and dr["io"] == "mmap"
    assert "default host tier here: 0 GiB (none: the whole model stays loaded); io=auto reads with mmap" in r.stdout
    with tiered.load(d, device="cpu") as m:
        p = tiered.stats(m).placement
        assert p.ring_why.startswith("automatic") and (p.host_gb, p.host_why, p.io) == (0, dr["host_why"], dr["io"])


@pytest.mark.parametrize("case", ["llama_big_vocab", "gpt2_long_positions"])
def test_inspect_ring_needed_names_a_unit_that_goes_through_the_ring(case: str, tmp_path: Path) -> None:
    """``ring needed`` names the largest unit the ring holds with the defaults, never an embedding read by rows
    (which never enters the ring): ``llama_big_vocab``, an untied Llama whose embedding is as large as its head (the
    largest units: the embedding comes first); ``gpt2_long_positions``, a GPT-2 whose position table (read by rows)
    is larger than any other unit. The unit named is the one tiered.load's placement sizes the ring by, and the
    figure printed is a ring that load takes."""
    if case == "llama_big_vocab":
        cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model, dtype = transformers.LlamaForCausalLM(cfg), torch.bfloat16
    else:
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=4096, n_embd=64, n_layer=2, n_head=4)
        model, dtype = transformers.GPT2LMHeadModel(cfg), torch.float32
    d = models.save_model(model, tmp_path / case, seed=5, dtype=dtype, max_shard_size=None)
    info = _inspect_json(d, "--units")
    size = {u["name"]: u["bytes"] for u in info["units"]}
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        streams = streaming_ring_gb(probe)
    with tiered.load(d, device="cpu", ring_gb=streams) as m:  # what load reads by rows, and the unit it sizes the ring by
        p = tiered.stats(m).placement
        by_rows = {m._tiered.plan.units[i].name for i in p.rows}
        need = p.largest_unit_bytes
    biggest_row_read = max(size[n] for n in by_rows)
    assert by_rows and biggest_row_read >= max(size.values()), (by_rows, size)  # the case the message got wrong
    r = cli("inspect", d, "--units")
    assert r.returncode == 0, r.stderr
    said = re.search(r"^ring needed[^\n]*?: >= ([0-9.]+) GiB \(largest unit (?:through the ring )?([\w.]+)\)",
                     r.stdout, re.M)
    assert said, r.stdout
    name = said[2]
    assert name not in by_rows, r.stdout
    # a linear head larger than the ring computes in pieces of rows on the mapping: the least ring is the largest
    # other unit's, and the head is named beside it
    heads = {u["name"] for u in info["linear_pieces_units"]}
    assert name not in heads and size[name] == max(b for n, b in size.items() if n not in by_rows | heads)
    assert info["largest_ring_unit"] == {"name": name, "bytes": size[name]}
    assert (need == size[name]) if not heads else (need == max(size[n] for n in heads) > size[name]), (need, heads)
    assert all(f"({n}, up to" in r.stdout for n in heads), r.stdout
    ring = float(said[1])
    assert ring * GiB >= page_up(size[name])
    tiered.load(d, device="cpu", ring_gb=ring, prefetch=0).close()  # the ring said is one that runs
    least = page_up(size[name]) / GiB  # (the figure said is rounded up to 0.001 GiB)
    with tiered.load(d, device="cpu", ring_gb=least, prefetch=0) as m:  # the least: the heads in pieces of rows
        assert {m._tiered.plan.units[i].name for i in m._tiered.placement.linear_pieces} == heads
    with pytest.raises(tiered.RingTooSmallError):  # and a ring below it does not run
        tiered.load(d, device="cpu", ring_gb=(page_up(size[name]) - 4096) / GiB, prefetch=0)


def test_inspect_io_says_when_load_refuses_the_ring(dirs: dict[str, Path]) -> None:
    """A ring below the largest unit: load refuses it with io=direct (copied into the ring) and io=mmap alike (on the
    mapping the unit's pages are resident while it runs, which the ring bounds), which inspect says (and its JSON
    figures show), with the ring that runs."""
    d = dirs["notok"]
    info = _inspect_json(d, "--units")
    ring = info["ring_min_gb"] / 2
    for io in ("mmap", "direct"):
        pl = _inspect_json(d, "--ring-gb", ring, "--io", io)["placement"]
        assert pl["ring_bytes"] < pl["ring_need_bytes"] == info["ring_min_gb"] * 2**30
        with pytest.raises(tiered.RingTooSmallError):
            tiered.load(d, device="cpu", ring_gb=ring, io=io)
        r = cli("inspect", d, "--ring-gb", ring, "--io", io)
        assert r.returncode == 0 and "tiered.load refuses this ring" in r.stdout, r.stdout
    tiered.load(d, device="cpu", ring_gb=info["ring_min_gb"], io="mmap").close()


def test_inspect_io_auto_resolves_as_load_does(dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """--io auto is resolved against the page-cache room as tiered.load resolves it; when it picks O_DIRECT on the
    CPU, the units it keeps on the mapping (larger than the ring, and its page-cache tier) are load's."""
    from tiered.format import open_checkpoint

    d = dirs["notok"]
    total = open_checkpoint(d).nbytes
    monkeypatch.setattr(tiered.policy, "page_cache_reserve", lambda threads: 0)
    for room, want in ((total - 1, "direct"), (1 << 50, "mmap")):
        monkeypatch.setattr(tiered.machine, "page_cache_room", lambda room=room: (room, "cgroup /x memory.max=1"))
        assert main(["inspect", str(d), "--ring-gb", "0.0002", "--io", "auto", "--json"]) == 0
        pl = json.loads(capsys.readouterr().out)["placement"]
        assert pl["options"]["io"] == "auto" and pl["io"] == want
        with tiered.load(d, device="cpu", ring_gb=0.0002, io="auto") as m:
            s = tiered.stats(m)
            assert s.io == want
            assert set(pl["mapped"]) == set(m._tiered.streamer.loader.mapped)
            assert len(pl["page_cache"]) == s.page_cache_units
            # io_probe: the reader measures backends and read shapes while streaming, as the load's reader does
            assert pl["io_probe"] == m._tiered.streamer.loader.reader.adapt == (want == "direct")
        if want == "direct":
            assert pl["page_cache"], pl  # a page-cache tier was kept ...
            assert len(pl["page_cache"]) < len(pl["streamed"])  # ... and it is not every streamed unit
        assert main(["inspect", str(d), "--ring-gb", "0.0002", "--io", "auto"]) == 0
        out = capsys.readouterr().out
        assert f"io=auto -> {want})" in out
        # what io=auto measures while streaming is said where it measures (O_DIRECT), with the shapes it will try
        shapes = ", ".join(tiered.reader.shape_name(r, k) for r, k in tiered.reader.read_shapes(pl["threads"]))
        assert (f"O_DIRECT's read shapes ({shapes};" in out) == (want == "direct"), out


def test_inspect_io_direct_predicts_every_pass_from_the_disk(dirs: dict[str, Path]) -> None:
    """CUDA placement (planned on any machine with --gpu-gb): io=direct bypasses the page cache, so the warm
    prediction is the disk's; mmap and pread read a warm pass from the page cache."""
    d = dirs["notok"]
    args = (d, "--device", "cuda", "--ring-gb", 0.01, "--gpu-gb", 0)
    pr = {io: _inspect_json(*args, "--io", io)["placement"]["predicted"] for io in ("mmap", "pread", "direct")}
    assert pr["mmap"] == pr["pread"]
    assert pr["mmap"]["warm_s_per_token"] < pr["mmap"]["cold_s_per_token"] == pr["direct"]["cold_s_per_token"]
    assert pr["direct"]["warm_s_per_token"] == pr["direct"]["cold_s_per_token"] > 0
    r = cli("inspect", *args, "--io", "direct")
    assert r.returncode == 0 and "io=direct bypasses the page cache" in r.stdout, r.stdout
    assert "from a warm page cache" not in r.stdout


# ---------------------------------------------------------------------------------------------- inspect from headers

# The real `tiered` package in a fresh interpreter (_DRIVE).
_RUN_MAIN = "import json, sys, time\n" + _DRIVE


def _run_main(cases: list[list[str]]) -> tuple[dict, subprocess.CompletedProcess]:
    r = subprocess.run([sys.executable, "-c", _RUN_MAIN, json.dumps(cases)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r


def _raw_shard(path: Path, names: list[str]) -> None:
    """A valid safetensors file of one F32 element per name (written without torch or safetensors)."""
    header = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
                         for i, n in enumerate(names)}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4 * len(names)))


@pytest.fixture(scope="module")
def bad_dirs(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model directories `tiered inspect` must refuse: config.json not JSON, a truncated shard, PyTorch weights only,
    a tensor in two shards."""
    root = tmp_path_factory.mktemp("bad_inspect")
    out = {}
    out["nojson"] = Path(shutil.copytree(dirs["notok"], root / "nojson"))
    (out["nojson"] / "config.json").write_text("{not json")
    out["cut"] = Path(shutil.copytree(dirs["notok"], root / "cut"))
    shard = sorted(out["cut"].glob("*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size - 100)
    out["bin"] = root / "bin"
    out["bin"].mkdir()
    shutil.copy(dirs["notok"] / "config.json", out["bin"])
    (out["bin"] / "pytorch_model.bin").write_bytes(b"\0" * 64)
    out["dup"] = root / "dup"
    out["dup"].mkdir()
    shutil.copy(dirs["notok"] / "config.json", out["dup"])
    _raw_shard(out["dup"] / "a.safetensors", ["x", "y"])
    _raw_shard(out["dup"] / "b.safetensors", ["y"])
    return out


def test_inspect_reads_the_headers_without_torch(dirs: dict[str, Path], minilm_dir: Path,
                                                 bad_dirs: dict[str, Path]) -> None:
    """Plain `tiered inspect` (issue 26): config.json and the safetensors headers only. torch, transformers, numpy and
    safetensors are never imported (what made it take ~10 s: the speed itself is measured outside the unit tests) —
    MiniLM, the tiny sharded Llama, its JSON, cuda's headroom; its errors, and --units' bad shards, are said before torch too."""
    d = str(dirs["notok"])
    ok = [["inspect", str(minilm_dir)], ["inspect", d], ["inspect", d, "--json"], ["inspect", d, "--device", "cuda"]]
    bad = [["inspect", str(bad_dirs["nojson"])], ["inspect", str(bad_dirs["cut"])], ["inspect", str(bad_dirs["bin"])],
           ["inspect", str(bad_dirs["dup"])], ["inspect", str(bad_dirs["cut"]), "--units"],
           ["inspect", str(dirs["garbage_notok"]), "--all"], ["inspect", d + "-missing"], ["inspect", d, "--io", "x"]]
    res, r = _run_main(ok + bad)
    assert res["heavy"] == [], (res, r.stderr)
    for argv, code, _secs in res["runs"]:
        assert code == (0 if argv in ok else 1 if "-missing" not in argv[1] and argv[-1] != "x" and
                        "nojson" not in argv[1] else 2), (argv, code, r.stderr)
    assert "BertModel, 104 tensors" in r.stdout and "add --units" in r.stdout, r.stdout


def test_inspect_errors_say_what_is_wrong(dirs: dict[str, Path], bad_dirs: dict[str, Path],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Usage errors (exit 2) as the other commands give them; a checkpoint that cannot be read is a runtime error
    (exit 1) with the message tiered.load gives, with or without --units."""
    from tiered.errors import DuplicateTensorError
    from tiered.format import open_checkpoint

    with pytest.raises(SystemExit) as e:
        main(["inspect", str(bad_dirs["nojson"])])
    assert e.value.code == 2 and "tiered inspect: error: MODEL_DIR" in capsys.readouterr().err
    for flags in (["--dtype", "int4"], ["--device", "tpu"], ["--ring-gb", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["inspect", str(dirs["notok"]), *flags])
        assert e.value.code == 2 and flags[0] in capsys.readouterr().err, flags
    with pytest.raises(DuplicateTensorError) as want:
        open_checkpoint(bad_dirs["dup"])
    for name, says in (("cut", "truncated"), ("bin", "convert it with `tiered reshard`"), ("dup", str(want.value))):
        for extra in ([], ["--units"]):
            assert main(["inspect", str(bad_dirs[name]), *extra]) == 1, (name, extra)
            err = capsys.readouterr().err
            assert err.startswith("tiered: error: ") and says in err, (name, extra, err)


def test_inspect_refuses_what_a_load_refuses_without_a_traceback(dirs: dict[str, Path], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A shard path that is a directory, a dangling symlink or a FIFO, and a quantization method tiered does not
    decode: plain inspect (no torch) and --units both exit 1 with a message naming the file, never a traceback; a
    tensor name with a non-ASCII digit is just a name."""
    cfg = (dirs["notok"] / "config.json").read_text()
    cases = {}
    for name in ("dir", "dangling", "fifo", "bnb"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(cfg)
        cases[name] = d
    (cases["dir"] / "model.safetensors").mkdir()
    (cases["dangling"] / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    os.mkfifo(cases["fifo"] / "model.safetensors")
    shutil.copytree(dirs["notok"], cases["bnb"], dirs_exist_ok=True)
    doc = json.loads(cfg)
    doc["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (cases["bnb"] / "config.json").write_text(json.dumps(doc))
    says = {"dir": "not a regular file", "dangling": "no such file", "fifo": "not a regular file",
            "bnb": "quant_method='bitsandbytes', which tiered does not decode"}
    for name, d in cases.items():
        for extra in ([], ["--units"]):
            assert main(["inspect", str(d), *extra]) == 1, (name, extra)
            err = capsys.readouterr().err
            assert err.startswith("tiered: error: ") and says[name] in err and "Traceback" not in err, (name, extra, err)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(cfg)
    _raw_shard(odd / "model.safetensors", ["model.layers.\u00b2.w", "model.layers.1.w"])
    assert main(["inspect", str(odd)]) == 0
    from tiered import inspection, quant

    assert inspection.DECODED_METHODS == quant.STREAMED


_SAME = ("model_dir", "architecture", "shards", "tensors", "checkpoint_bytes", "dtypes", "bytes_by_dtype",
         "data_aligned_4k", "index_names_missing_from_shards")


@pytest.mark.parametrize("name", ["llama", "minilm", "gptj", "mixtral", "fp8", "resharded", "compressed"])
def test_inspect_from_headers_gives_the_figures_of_units(name: str, dirs: dict[str, Path], minilm_dir: Path,
                                                        ckpts: Checkpoints, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The header report's figures (shards, tensors, bytes, dtypes, quantized stored bytes) are --units' (the model
    built), figure for figure; its layout facts agree with the units'; a ring the model fits is the same default."""
    from tiered.inspection import inspect_dir
    from tiered.spec_dtypes import SPEC_DTYPE_TORCH_NAMES
    from tiered.tensor_info import DTYPES

    assert {k: str(v).removeprefix("torch.") for k, v in DTYPES.items()} == SPEC_DTYPE_TORCH_NAMES
    if name == "fp8":
        d = models.fp8_block(ckpts["llama"], tmp_path / "fp8")
    elif name == "resharded":
        d = tmp_path / "resharded"
        tiered.reshard(dirs["notok"], d, quiet=True)
    elif name == "compressed":  # coded tensors count as the dtype and bytes they decode to, as open_checkpoint's do
        pytest.importorskip("zstandard")
        from tiered import lossless

        monkeypatch.setattr(lossless, "MIN_CODED_BYTES", 1024)
        d = tmp_path / "compressed"
        tiered.reshard(ckpts["llama"], d, quiet=True, compress=True)
    else:
        d = {"llama": dirs["notok"], "minilm": minilm_dir}.get(name) or ckpts[name]
    head, full = _inspect_json(d), inspect_dir(d)
    assert {k: head[k] for k in _SAME} == {k: full[k] for k in _SAME}
    assert set(head["skipped_tensors"]) == set(full["skipped_tensors"])
    assert full["tensors"] == sum(s["tensors"] for s in head["shards"])
    q = full["quantized"]
    assert (head["quantized"] is None) == (q is None) == (name != "fp8")
    if q:
        keys = ("method", "block", "tensors", "stored_bytes")
        assert {k: head["quantized"][k] for k in keys} == {k: q[k] for k in keys}
        assert "quantized: fp8 (weight_block_size [32, 32]), 28 tensors of codes" in cli("inspect", d).stdout
    z = head["compressed"]
    assert (z is None) == (name != "compressed")
    if z:
        from tiered.format import open_checkpoint
        from tiered.lossless import LosslessInfo

        coded = [t for t in open_checkpoint(d).tensors.values() if isinstance(t, LosslessInfo)]
        assert z["tensors"] == len(coded) >= 5 and not z["unreadable"]
        assert (z["stored_bytes"], z["plain_bytes"]) == (sum(t.stored for t in coded), sum(t.nbytes for t in coded))
        assert f"compressed (tiered reshard --compress): {len(coded)} tensors stored in" in cli("inspect", d).stdout
    lay = head["layout"]
    assert lay["blocks"] == len({u["layer"] for u in full["units"] if u["layer"] is not None}) > 0
    if full["units_contiguous_on_disk"] == len(full["units"]) and full["stream_ordered"]:
        assert lay["blocks_contiguous_on_disk"] == lay["blocks"] and lay["blocks_in_order"], lay
    if name == "resharded":
        assert lay["blocks_contiguous_on_disk"] == lay["blocks"] and head["data_aligned_4k"]
    if full["default_ring"]["host_why"].startswith("none: the whole model stays loaded"):
        assert head["default_ring"]["gb"] == full["default_ring"]["gb"]
    out = cli("inspect", d, "--units", "--json")
    assert out.returncode == 0 and {k: json.loads(out.stdout)[k] for k in _SAME} == {k: full[k] for k in _SAME}


def test_generate_trust_remote_code(ckpts: Checkpoints, tmp_path: Path) -> None:
    """``tiered generate`` on a directory with its own model code (``auto_map``): refused without
    ``--trust-remote-code`` (the advice names the flag); with it, stock's greedy tokens
    (``from_pretrained(..., trust_remote_code=True)``)."""
    d = models.custom_code(ckpts["llama"], tmp_path / "toy")
    ids = [5, 17, 42, 99, 3]
    args = ("generate", d, "--ids", "--prompt", " ".join(map(str, ids)), "--max-new-tokens", NEW, "--device", "cpu")
    r = cli(*args)
    assert r.returncode == 1 and "--trust-remote-code" in r.stderr, r.stderr
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
    r = cli(*args, "--trust-remote-code")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(i) for i in want], (r.stdout, want)


def test_compute_threads_flag(dirs: dict[str, Path], facts: dict) -> None:
    """``--compute-threads N`` reaches torch (a streamed run equals stock's text), and a bad value is a usage error
    naming the flag, before torch is imported."""
    d = dirs["chat"]
    r = cli("generate", d, "--prompt", "I was at one", "--max-new-tokens", NEW, "--ring-gb", facts["ring_gb"],
            "--device", "cpu", "--compute-threads", 1)
    assert r.returncode == 0, r.stderr
    assert r.stdout == reference(d, "I was at one")[0] + "\n"
    for bad in ("0", "x"):
        r = cli("generate", d, "--compute-threads", bad)
        assert r.returncode == 2 and "--compute-threads" in r.stderr and "auto" in r.stderr
