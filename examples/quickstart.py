"""Quantize the embedded SmolLM2-135M-Instruct to Quasar W8A8, save it, reload it, generate with Quasar.

python examples/quickstart.py [--out smollm2-quasar]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quasar_hf  # noqa: F401  (registers quant_method "quasar", generate(quasar=...))
from quasar_hf import QuasarConfig
from quasar_hf.models import smollm2_135m_instruct

PROMPT = (
    "Rewrite the following paragraph so that it is easier to read, keeping every fact.\n\n"
    "The committee, having considered the proposal submitted by the working group at its last meeting, "
    "decided that the proposal, which concerns the reorganisation of the archive, should be postponed "
    "until the working group has submitted a revised budget for the reorganisation of the archive."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="smollm2-quasar")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    path = smollm2_135m_instruct()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QuasarConfig(), dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.out)  # reload: no calibration

    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    for quasar in (False, True):
        started = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=args.max_new_tokens, do_sample=False, quasar=quasar, return_dict_in_generate=True
        )
        seconds = time.perf_counter() - started
        new = out.sequences.shape[1] - ids.shape[1]
        stats = getattr(out, "quasar_stats", None)
        extra = f", mean acceptance length L = {stats.mean_acceptance_length:.2f}" if stats else ""
        print(f"quasar={quasar}: {new / seconds:.1f} tokens/s{extra}")
        print(tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True))


if __name__ == "__main__":
    main()
