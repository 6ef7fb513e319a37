"""The text pipelines (normalizer, pre-tokenizer, decoder) that transformers' tokenizer classes build
around a vocabulary, whether it comes from tokenizer.json, a SentencePiece .model or vocab.json + merges.txt.

transformers 5 rebuilds these classes' pipelines in their constructors instead of taking tokenizer.json's
own (a Llama folder's tokenizer.json has the legacy normalizer; LlamaTokenizer runs Metaspace), so the
same rebuild is what encodes as AutoTokenizer does. `CLASSES` maps a tokenizer class (without "Fast": the one
shard/data/auto_class.py says transformers builds) to its pipeline; `CLASS_DEFAULTS` to the special tokens its
constructor names when the config leaves them out.
"""

# Qwen2's pre-tokenizer split (the expression transformers' Qwen2Tokenizer uses)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
# Qwen3.5's: combining marks (\p{M}) stay with the letters they mark
QWEN3_5_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def llama(tok, config: dict) -> None:
    """Metaspace with no normalizer; a prefix space where add_prefix_space says (default yes), before the
    first chunk only unless `legacy` is truthy (transformers' _get_prepend_scheme; the class's legacy=False)."""
    from tokenizers import decoders, pre_tokenizers

    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else prefix
    scheme = ("always" if config.get("legacy", False) else "first") if prefix else "never"
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))


def gemma(tok, config: dict) -> None:
    """Spaces become "▁", no dummy prefix."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])


def qwen2(tok, config: dict, split: str = QWEN2_SPLIT) -> None:
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")), use_regex=False)])
    tok.decoder = decoders.ByteLevel()


def qwen3_5(tok, config: dict) -> None:
    qwen2(tok, config, QWEN3_5_SPLIT)


def gpt2(tok, config: dict) -> None:
    from tokenizers import decoders, pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")))
    tok.decoder = decoders.ByteLevel()


CLASSES = {"LlamaTokenizer": llama, "GemmaTokenizer": gemma, "Qwen2Tokenizer": qwen2, "Qwen3_5Tokenizer": qwen3_5,
           "GPT2Tokenizer": gpt2}
CLASS_DEFAULTS = {
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "GemmaTokenizer": {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                       "mask_token": "<mask>"},
    "GPT2Tokenizer": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
    "Qwen2Tokenizer": {"eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "Qwen3_5Tokenizer": {"eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
}


def class_name(config: dict) -> str | None:
    """tokenizer_config.json's tokenizer_class without "Fast" (transformers 5 has one class of each)."""
    name = config.get("tokenizer_class")
    return name[:-4] if isinstance(name, str) and name.endswith("Fast") else name
