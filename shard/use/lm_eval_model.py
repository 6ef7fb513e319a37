"""A loaded model as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`), which lm_eval's
`simple_evaluate` takes in place of its own: shard/use/evaluate.py (`python -m shard.eval`) and training's
evaluation (shard/run/lm_eval_hook.py) hand it the run's model and tokenizer. Imported only where lm-eval is
installed (the `eval` extra).

It answers lm_eval's three requests as lm_eval's `hf` model answers them on the run's Hugging Face export:
- loglikelihood: TemplateLM's split of each (context, continuation) pair (the whole text encoded, the context's
  tokens taken off its front; an empty context is the prefix token, BOS else EOS), the sequence cut to the last
  `max_length + 1` tokens, scored in one pass (shard/use/score.py: batches of `batch_size` sequences, longest
  first, laid over the mesh), the continuation's log-probabilities summed, greedy where each is the argmax;
- loglikelihood_rolling: lm_eval's disjoint rolling windows of `max_length` tokens over the text (the first
  after the prefix token), each window's log-likelihood added up;
- generate_until: greedy (or sampled, where the task's generation_kwargs ask) by the run's generation loop
  (shard/use/generate.py's Generator, prompts of a batch left-padded), at most `max_gen_toks` tokens, stopping
  at the tokenizer's end tokens, the text cut at the first of `until`; the context left-truncated to
  `max_length - max_gen_toks` tokens.

Text is encoded as transformers' tokenizer encodes it (tok_encode: with the special tokens around a text, unless
the text already starts with the prefix token's text or lm_eval asks for none), so the ids are the `hf` model's.
"""

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from shard.data import tokenizer as tokenizer_lib
from shard.errors import UserError
from shard.use import generate, sampling, score

DEFAULT_MAX_LENGTH = 2048  # lm_eval's hf model's, for a model without a fixed context
DEFAULT_MAX_GEN_TOKS = 256


class ShardLM(TemplateLM):
    def __init__(self, generator, tokenizer, vocab: int, batch_size: int = 1, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, progress: bool = False):
        super().__init__()
        self.g, self.tok, self.vocab = generator, tokenizer, vocab
        self.batch_size, self.progress = max(1, int(batch_size)), progress
        self.max_length = max_length or generator.context or DEFAULT_MAX_LENGTH
        self.max_gen_toks = max_gen_toks
        self.scorer = score.Scorer(generator, vocab, top=1)
        # where the tokenizer has no EOS (bytes): what separates documents in training, a newline
        self._eot = tokenizer.eos if tokenizer.eos is not None else int(tokenizer_lib.separator(tokenizer)[0][0])
        self.ends = tokenizer.end_ids

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos if self.tok.bos is not None else self._eot

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:  # a text that starts with the prefix token's text gets no second one
            prefix = self.tok.special_text(self.prefix_token_id)
            add_special_tokens = not (prefix and string.startswith(prefix))
        return self.tok.encode(string, special=bool(add_special_tokens))

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    # ------------------------------------------------------------------ chat (--apply_chat_template)

    @property
    def tokenizer_name(self) -> str:
        return self.tok.identity()

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tok.chat_template or "" if chat_template else None

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the tokenizer's chat template renders it (shard/data/chat_template.py, as
        transformers' apply_chat_template): ready for the assistant's turn, or without add_generation_prompt
        ending in the last message's own text (transformers' continue_final_message)."""
        from shard.data import formats

        formatter = formats.Formatter(("messages",), self.tok)
        if formatter.template is None:
            raise UserError("--apply_chat_template: the run's tokenizer has no chat template")
        text = formatter.render(chat_history, add_generation_prompt, "--apply_chat_template")[0]
        if not add_generation_prompt and chat_history:
            last = str(chat_history[-1].get("content", "")).strip()
            if last and last in text:
                text = text[:text.rindex(last) + len(last)]
        return text

    # ------------------------------------------------------------------ scores

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Each (key, context ids, continuation ids): the continuation's log-likelihood and whether it is greedy."""
        rows, lengths = [], []
        for _, context, continuation in requests:
            if not continuation:
                raise UserError("lm_eval asked for the log-likelihood of an empty continuation")
            rows.append((list(context) + list(continuation))[-(self.max_length + 1):])
            lengths.append(len(continuation))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # alike lengths share a padded batch
        scored = dict(zip(order, self.scorer([rows[i] for i in order], self.batch_size)))
        out = []
        for i, n in enumerate(lengths):
            s = scored[i]
            out.append((float(np.sum(s.logprobs[-n:], dtype=np.float64)), bool(np.all(s.greedy[-n:]))))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, predicted))
                owners.append(i)
        totals = np.zeros(len(requests), np.float64)
        for owner, (ll, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += ll
        return [float(t) for t in totals]

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        eos = None if self.tok.eos is None else self.tok.special_text(self.tok.eos) or self.tok.decode([self.tok.eos])
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1])
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos or None)
            new = int(kwargs.pop("max_gen_toks", kwargs.pop("max_new_tokens", self.max_gen_toks)))
            sample = bool(kwargs.pop("do_sample", False)) and float(kwargs.get("temperature", 1.0)) > 0
            setting = sampling.Sampling(temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                                        top_k=int(kwargs.get("top_k", 0) or 0), top_p=float(kwargs.get("top_p", 1.0)),
                                        vocab=self.vocab)
            room = self.max_length - new
            if room < 1:
                raise UserError(f"a task asks for {new} new tokens (max_gen_toks), as many as the model's context "
                                f"of {self.max_length}: nothing of the prompt would fit")
            members = sorted(members, key=lambda i: -len(self.tok_encode(requests[i].args[0])))
            for at in range(0, len(members), self.batch_size):
                batch = members[at:at + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in batch]
                made = self.g(prompts, new, setting, seed=0, eos=self.ends or None)
                for i, row in zip(batch, np.asarray(made).tolist()):
                    row = generate.until_eos(row, self.ends) if self.ends else row
                    out[i] = postprocess_generated_text(self.tok.decode(row), until, None)
        return out
