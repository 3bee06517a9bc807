"""Two servers started at once on the same float model: one quantizes it, the other waits for that result,
and both serve the same whole checkpoint (the lock and the atomic folder of commands/serve.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.hub import make_tiny_checkpoint

SERVABLE = "import sys; from quasar_hf.commands.serve import servable_checkpoint; print(servable_checkpoint(sys.argv[1]))"


@pytest.mark.slow
def test_two_processes_quantizing_one_model_both_serve_one_whole_checkpoint(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "base")
    env = {**os.environ, "QUASAR_HF_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", SERVABLE, str(base)]
    processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [process.communicate(timeout=600) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], [err for _, err in results]
    folders = {out.strip().splitlines()[-1] for out, _ in results}
    assert len(folders) == 1
    logs = "".join(err for _, err in results)
    assert logs.count("quantizing it with the defaults") == 1 and logs.count("quantized from") == 1
    served = Path(folders.pop())
    siblings = [p.name for p in served.parent.iterdir() if p != served and not p.name.endswith(".lock")]
    assert siblings == [], f"left beside the checkpoint: {siblings}"
    from transformers import AutoModelForCausalLM

    import quasar_hf  # noqa: F401 - registers the Quasar model type

    model = AutoModelForCausalLM.from_pretrained(served).eval()
    out = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)
