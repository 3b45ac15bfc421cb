"""The README's first snippet (issue 26): copied verbatim, with its model directory set to the demo's SmolLM2-135M,
it prints stock transformers' answer to its question, then one short stats line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]


def test_the_first_snippet_prints_the_answer(smollm2: Path, tmp_path: Path) -> None:
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert '"path/to/model_dir"' in code
    script = tmp_path / "snippet.py"
    script.write_text(code.replace('"path/to/model_dir"', repr(str(smollm2))))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2).eval()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20)
    want = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    lines = r.stdout.splitlines()
    assert lines[0] == want and want.strip(), (r.stdout, want)
    assert len(lines) == 2 and lines[1].startswith("tiered: model ") and "peak RSS" in lines[1] and len(lines[1]) < 160
