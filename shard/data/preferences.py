"""Preference rows (`train.objective=dpo`): a prompt with a chosen and a rejected answer, in the columns
`data.prompt_field`, `data.chosen_field` and `data.rejected_field` of a documents corpus (data.path).

Each answer is a row as fine-tuning reads one (shard/data/formats.py): text prompt and answer are prompt +
answer tokenized whole, the answer and the EOS after it trained; a chat's messages (the prompt a list of
messages, the answers a list continuing it, or one assistant text) are rendered with the tokenizer's chat
template, and only the answer's assistant turns are trained, not any in the prompt. A text prompt with chat
answers is one user message. Each answer becomes (inputs, targets, mask) of `data.seq_len` tokens: its
first seq_len + 1 tokens (a longer one is cut at the end), padding after it out of the mask. A pair either
of whose answers has no trained token left in the window is dropped (the build says how many).

Batches: `inputs`, `targets`, `chosen_mask` (the chosen answer's; under the names the step and the plan
read for a language model's batch), `rejected_inputs`, `rejected_targets`, `rejected_mask`; all (rows,
seq_len). The pairs are read into memory once (preference sets are thousands to a few hundred thousand rows).
"""

import numpy as np

from shard.data import documents, formats, token_cache
from shard.data import tokenizer as tokenizer_lib
from shard.data.sources import held_out_indices
from shard.errors import UserError, warn

KEYS = ("inputs", "targets", "chosen_mask", "rejected_inputs", "rejected_targets", "rejected_mask")


def columns(cfg) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) columns, each set."""
    names = {"data.prompt_field": cfg.prompt_field, "data.chosen_field": cfg.chosen_field,
             "data.rejected_field": cfg.rejected_field}
    if missing := [k for k, v in names.items() if not v]:
        raise UserError(f"train.objective=dpo reads preference rows: set {', '.join(missing)} (the columns holding "
                        "the prompt, the chosen answer and the rejected one)")
    if cfg.completion_field:
        raise UserError(f"data.completion_field={cfg.completion_field!r} is for prompt/completion fine-tuning; "
                        "preference rows name data.chosen_field and data.rejected_field instead")
    return cfg.prompt_field, cfg.chosen_field, cfg.rejected_field


class Pairs:
    """Preference pairs in memory, as arrays (pairs, seq_len) under KEYS; random access by rows."""

    def __init__(self, arrays: dict):
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays["inputs"])

    def read_batch(self, indices: np.ndarray) -> dict:
        return {k: v[indices] for k, v in self.arrays.items()}

    def subset(self, rows: np.ndarray) -> "Pairs":
        return Pairs({k: v[rows] for k, v in self.arrays.items()})


def splits(cfg) -> tuple[Pairs, Pairs]:
    """(train pairs, eval pairs) of data.path, held out by data.eval_fraction as documents are."""
    if cfg.name != "documents":
        raise UserError(f"train.objective=dpo reads preference rows from data.name=documents (data.name={cfg.name})")
    if cfg.mixture:
        raise UserError("train.objective=dpo reads one corpus (data.path); data.mixture is for language modelling")
    names = columns(cfg)
    tok = tokenizer_lib.load(cfg.tokenizer)
    pairs = read(documents.corpus_files(cfg.path), names, tok, cfg.seq_len)
    if len(pairs) < 2:
        raise UserError(f"data.path={cfg.path!r} holds {len(pairs)} usable preference pair(s); it needs at least 2 "
                        "(one to hold out)")
    train, held = held_out_indices(len(pairs), cfg.eval_fraction)
    return pairs.subset(train), pairs.subset(held)


def read(files, names: tuple[str, str, str], tok, seq_len: int) -> Pairs:
    formatter = formats.Formatter(names[:1], tok)
    sep = tokenizer_lib.separator(tok)[0]
    out = {k: [] for k in KEYS}
    dropped = 0
    for path in files:
        for batch in documents.rows(path, names):
            for n, (prompt, chosen, rejected) in enumerate(batch):
                where = f"{path}:row {n + 1}"
                both = [answer(formatter, tok, sep, prompt, a, k, names, where, seq_len)
                        for a, k in ((chosen, 1), (rejected, 2))]
                if any(b is None for b in both):
                    dropped += 1
                    continue
                for prefix, (inputs, targets, mask) in zip(("", "rejected_"), both):
                    out[prefix + "inputs"].append(inputs)
                    out[prefix + "targets"].append(targets)
                    out["chosen_mask" if not prefix else "rejected_mask"].append(mask)
    if dropped:
        warn(f"{dropped} preference pair(s) dropped: an answer empty, or with no token inside data.seq_len={seq_len}")
    if not out["inputs"]:
        return Pairs({k: np.zeros((0, seq_len), np.float32 if k.endswith("mask") else np.int32) for k in KEYS})
    return Pairs({k: np.stack(v) for k, v in out.items()})


def answer(formatter, tok, sep, prompt, value, column: int, names, where: str, seq_len: int):
    """(inputs, targets, mask) of the prompt followed by one answer, seq_len each; None when nothing of the
    answer is trained inside the window."""
    row = _row(formatter, prompt, value, column, names, where)
    if row is None:
        return None
    (ids, offsets, _), = tok.encode_rows([row.text], [row.special])
    around = (len(tok.head), len(tok.tail)) if row.special else (0, 0)
    mask = token_cache.trained_mask(offsets, row.trained, len(row.text), *around)
    if tok.eos is None or not len(ids) or ids[-1] != tok.eos:  # the answer's end is trained, as fine-tuning does
        ids, mask = np.concatenate([ids, sep]), np.concatenate([mask, np.full(len(sep), mask[-1] if len(mask) else 0)])
    ids, mask = ids[:seq_len + 1], mask[1:seq_len + 1]  # a target's mask: its token's
    if not mask.any():
        return None
    inputs, targets, weights = (np.zeros(seq_len, np.int32) for _ in range(3))
    inputs[:len(ids) - 1], targets[:len(ids) - 1], weights[:len(mask)] = ids[:-1], ids[1:], mask
    return inputs, targets, weights.astype(np.float32)


def _row(formatter, prompt, value, column: int, names, where: str):
    """The formats.Row of the prompt followed by the answer, only the answer trained."""
    if not isinstance(prompt, (list, tuple)) and not isinstance(value, (list, tuple)):
        prompt = formats.text_value(prompt, f"data.prompt_field={names[0]!r}", where)
        text = formats.text_value(value, f"{KEY_NAMES[column]}={names[column]!r}", where)
        return formats.Row(prompt + text, [(len(prompt), len(prompt) + len(text))], True) if text else None
    asked = prompt if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt or ""}]
    said = value if isinstance(value, (list, tuple)) else [{"role": "assistant", "content": value or ""}]
    if not said:
        return None
    whole = formatter.chat(formats._messages([*asked, *said], f"{names[0]!r} and {names[column]!r}", where), where)
    cut = len(formatter.prompt(list(asked)))  # the conversation up to the answer, ready for it
    spans = [(max(lo, cut), hi) for lo, hi in (whole.trained if whole else []) if hi > cut]
    return formats.Row(whole.text, spans, whole.special) if spans else None


KEY_NAMES = {1: "data.chosen_field", 2: "data.rejected_field"}
