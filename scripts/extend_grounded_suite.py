"""Rebuild quasar_hf/data/prompts/grounded.jsonl version 2: the 12 version-1 items + 24 more.

Why: 12 prompts leave the mean acceptance length L of two verifiers too noisy to compare within a
few percent (per-prompt L ranges 1.3 to 4.2 on SmolLM2). The new items follow the version-1
conventions: an instruction written for quasar_hf (rewrite / edit / summarize / extract, 6 each)
over one CPython 3.11 `pydoc_data.topics` entry. Run: python scripts/extend_grounded_suite.py
"""

import json
from pathlib import Path
from pydoc_data.topics import topics

SUITE = Path(__file__).resolve().parents[1] / "quasar_hf" / "data" / "prompts" / "grounded.jsonl"
NEW_ITEMS = [  # (task, topic, instruction)
    (
        "rewrite",
        "atom-identifiers",
        "Rewrite the following documentation in plain, simple English for a beginner. Keep every technical fact.",
    ),
    ("rewrite", "truth", "Rewrite the following text as a short numbered list of rules."),
    ("rewrite", "nonlocal", "Rewrite the following reference text as a friendly tutorial paragraph."),
    ("rewrite", "booleans", "Rewrite the following text for a reader who knows JavaScript but not Python, keeping every fact."),
    ("rewrite", "floating", "Rewrite the following documentation as a question-and-answer list."),
    ("rewrite", "unary", "Rewrite the following text in shorter sentences, keeping every technical fact."),
    (
        "edit",
        "yield",
        'Edit the following text: replace every occurrence of the word "function" with "routine" and change nothing else.',
    ),
    (
        "edit",
        "exprlists",
        "Fix the formatting of the following text: remove the line of asterisks under the title and keep the rest exactly as it is.",
    ),
    (
        "edit",
        "power",
        'Edit the following text so that it is written in the first person plural ("we"), keeping the content the same.',
    ),
    ("edit", "in", "Correct the following text to use American spelling and keep everything else exactly as it is."),
    (
        "edit",
        "bitwise",
        'Edit the following text: put every grammar rule (lines containing "::=") in a Markdown code block and leave the rest unchanged.',
    ),
    ("edit", "typesmodules", "Edit the following text into the present continuous tense where possible, changing nothing else."),
    ("summarize", "integers", "Summarize the following documentation in three sentences."),
    ("summarize", "specialattrs", "Summarize the following text in one paragraph for a Python programmer."),
    ("summarize", "dynamic-features", "Give a one-sentence summary of the following text."),
    ("summarize", "context-managers", "Summarize the following documentation as five bullet points."),
    ("summarize", "slicings", "Summarize the following text for a beginner in at most four sentences."),
    ("summarize", "augassign", "Write a short summary of the following text, then list its two most important rules."),
    ("extract", "id-classes", "List every Python keyword and built-in name that appears in the following text, one per line."),
    (
        "extract",
        "atom-literals",
        'Extract the grammar rule (the line containing "::=") from the following text and explain each part of it.',
    ),
    ("extract", "conversions", "Extract all code examples from the following text, verbatim, in a Markdown code block."),
    (
        "extract",
        "attribute-references",
        'Extract every sentence of the following text that contains the word "attribute", verbatim, one per line.',
    ),
    (
        "extract",
        "bltin-code-objects",
        "List every function or built-in named in the following text and say in a few words what the text says about it.",
    ),
    (
        "extract",
        "typesmethods",
        "Extract the names of all attributes mentioned in the following text (words written like __name__), one per line.",
    ),
]
ORIGIN = "instruction: written for quasar_hf; text: CPython 3.11.7 pydoc_data.topics['{}'] (the Python Language Reference)"
LICENCE = "instruction: Apache-2.0 (quasar_hf); text: PSF-2.0"


def main() -> None:
    old = [json.loads(line) for line in SUITE.read_text(encoding="utf-8").splitlines() if line.strip()][:12]
    items = [{**item, "version": 2} for item in old]
    for offset, (task, topic, instruction) in enumerate(NEW_ITEMS):
        content = f"{instruction}\n\n---\n{topics[topic].strip()}\n---"
        items.append(
            {
                "id": f"grounded-{12 + offset:03d}",
                "suite": "grounded",
                "version": 2,
                "task": task,
                "messages": [{"role": "user", "content": content}],
                "origin": ORIGIN.format(topic),
                "licence": old[0]["licence"] if "licence" in old[0] else LICENCE,
            }
        )
    SUITE.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
    print(f"wrote {len(items)} items to {SUITE}")


if __name__ == "__main__":
    main()
