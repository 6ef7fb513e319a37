"""lm-evaluation-harness tasks written offline: a multiple-choice task, a generation task and a rolling
log-likelihood task over local JSON Lines files (`dataset_path: json`), so that lm_eval reads no hub."""

import json
import os
from pathlib import Path

TASKS = ("tiny_mc", "tiny_gen", "tiny_roll")
COLOURS = ["red", "green", "blue", "yellow"]


def offline() -> None:
    """lm_eval and datasets never reach a hub (set before either is imported where possible)."""
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"


def write(folder: Path, n: int = 12) -> Path:
    """The three tasks' YAML files and data in `folder` (an --include_path): `n` documents each."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        answer = i % 4
        rows.append({"question": f"the cat sat on the mat {i}. which colour?", "choices": COLOURS, "answer": answer})
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gen = [{"question": f"Question: what is {i} + {i}?\nAnswer:", "answer": f" {2 * i}"} for i in range(n)]
    (folder / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gen))
    roll = [{"text": f"le fromage est bon {i}. " * (1 + i % 5)} for i in range(n)]
    (folder / "roll.jsonl").write_text("".join(json.dumps(r) + "\n" for r in roll))

    def data(name):
        return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}\ntest_split: test\n"
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + data("mc.jsonl") + "output_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "fewshot_split: test\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + data("gen.jsonl") + "output_type: generate_until\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \" 3\", \"what\"]\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    (folder / "tiny_roll.yaml").write_text(
        "task: tiny_roll\n" + data("roll.jsonl") + "output_type: loglikelihood_rolling\n"
        "doc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    return folder
