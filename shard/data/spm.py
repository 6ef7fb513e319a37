"""A SentencePiece `tokenizer.model` as a `tokenizers` Tokenizer, built as transformers 5 builds it for a
folder that has the .model but no tokenizer.json, so that `to_tokenizers(...).encode(text,
add_special_tokens=False).ids` is `AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)
.input_ids` and `decode(ids, skip_special_tokens=True)` is its decode.

transformers picks one of three pipelines by tokenizer_config.json's `tokenizer_class`:
- LlamaTokenizer, GemmaTokenizer: the class's own fixed pipeline around a BPE model whose merges are every
  split of a piece into two pieces, ranked by the piece's id (whatever the .model's algorithm);
- none named (or TokenizersBackend, PreTrainedTokenizerFast): the generic one, which follows the .model's
  own settings (normalizer spec, BPE merges ranked by piece score, Unigram, user-defined pieces kept whole).
Its added tokens are then config's `added_tokens_decoder`, the named special tokens and the extra special
tokens (the .model's control and user-defined pieces when the config lists none), added in that order, so
new ones get the ids transformers gives them. BOS/EOS around a text are the caller's: no post-processor.

Not read: special_tokens_map.json and added_tokens.json, which transformers consults only when the config
has no `added_tokens_decoder`.
"""

import re
from pathlib import Path

from shard.data import pipelines, tokenizer_files
from shard.errors import UserError, first_line

BPE_TYPE, UNIGRAM_TYPE = 2, 1  # TrainerSpec.model_type
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # SentencePiece piece types
NAMED = tokenizer_files.SPECIAL_KEYS
SPM_CLASSES = ("LlamaTokenizer", "GemmaTokenizer")  # the classes with their own pipeline over a .model
GENERIC = (None, "TokenizersBackend")
# transformers' clean_up_tokenization, applied in order to the decoded text
CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
           (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def to_tokenizers(model_file: Path, config: dict, name: str | None = None):
    """The `tokenizers.Tokenizer` that transformers builds from `model_file` and `config` (the parsed
    tokenizer_config.json beside it, {} when there is none) with the class `name` (shard/data/auto_class.py's
    choice), by default the one `config` names."""
    proto = read(model_file)
    if name is None:
        name = config.get("tokenizer_class")
        # PreTrainedTokenizerFast is TokenizersBackend in transformers 5 (PreTrainedTokenizer is another class)
        name = "TokenizersBackend" if name == "PreTrainedTokenizerFast" else pipelines.class_name(config)
    if name in SPM_CLASSES:
        tok = (_llama if name == "LlamaTokenizer" else _gemma)(proto, config)
        named = {**pipelines.CLASS_DEFAULTS[name]}
        extras = _spm_specials(proto, user_defined=True)
    elif name in GENERIC:
        tok = _generic(proto, config)
        spec = proto.trainer_spec  # the generic path names bos/eos/unk after the .model's pieces
        named = {key: piece or default for key, i, piece, default in (
            ("bos_token", spec.bos_id, spec.bos_piece, "<s>"), ("eos_token", spec.eos_id, spec.eos_piece, "</s>"),
            ("unk_token", spec.unk_id, spec.unk_piece, "<unk>")) if i >= 0}
        extras = _spm_specials(proto, user_defined=False)  # user-defined pieces are the pre-tokenizer's
    else:
        raise UserError(f"{model_file}: tokenizer_class {name} is not supported for a "
                        "SentencePiece model without tokenizer.json (supported: LlamaTokenizer, GemmaTokenizer, "
                        "TokenizersBackend or none)")
    _add_tokens(tok, proto, config, named, extras, generic=name in GENERIC)
    tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
    if config.get("clean_up_tokenization_spaces") and (
            type(tok.model).__name__ != "BPE"
            or config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")):
        _clean_up_on_decode(tok)
    return tok


def read(model_file: Path):
    """The parsed ModelProto of `model_file`; a UserError when it is not a SentencePiece BPE or Unigram model."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(Path(model_file).read_bytes())
    except (OSError, DecodeError) as e:
        raise UserError(f"{model_file}: not a readable SentencePiece model: {first_line(e)}") from None
    if not proto.pieces:  # protobuf accepts many non-model files as an empty message
        raise UserError(f"{model_file}: not a readable SentencePiece model: it holds no pieces")
    if proto.trainer_spec.model_type not in (BPE_TYPE, UNIGRAM_TYPE):
        raise UserError(f"{model_file}: SentencePiece model type {proto.trainer_spec.model_type} is not "
                        "supported (only BPE and Unigram)")
    return proto


# ----------------------------------------------------------------------------- the class pipelines

def _id_ranked_bpe(proto, **options):
    """A byte-fallback BPE over all pieces whose merges are each piece's two-piece splits, ordered by the
    piece's id and then by the left part's length (transformers' `generate_merges` without scores)."""
    from tokenizers.models import BPE

    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    merges = [(token[:k], token[k:]) for token in vocab for k in range(1, len(token))
              if token[:k] in vocab and token[k:] in vocab]
    return BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None, **options)


def _llama(proto, config):
    from tokenizers import Tokenizer

    tok = Tokenizer(_id_ranked_bpe(proto))  # the class gives its BPE no unk token
    pipelines.llama(tok, config)
    return tok


def _gemma(proto, config):
    from tokenizers import Tokenizer

    tok = Tokenizer(_id_ranked_bpe(proto, unk_token=str(_token(config.get("unk_token", "<unk>")))))
    pipelines.gemma(tok, config)
    return tok


# ----------------------------------------------------------------------------- the generic pipeline

def _generic(proto, config):
    """The pipeline that follows the .model's own settings (transformers' build_tokenizer_from_spm_proto)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE, Unigram

    spec, norm = proto.trainer_spec, proto.normalizer_spec
    legacy = config.get("legacy", True)
    if spec.model_type == UNIGRAM_TYPE:
        names = [piece.piece for piece in proto.pieces]
        model = Unigram(vocab=[(piece.piece, piece.score) for piece in proto.pieces], unk_id=spec.unk_id,
                        byte_fallback=spec.byte_fallback)
    else:
        names = _renamed(proto, config.get("added_tokens_decoder") or {})
        model = BPE(vocab={token: i for i, token in enumerate(names)}, merges=_score_ranked_merges(proto, names),
                    unk_token=spec.unk_piece, fuse_unk=True, byte_fallback=spec.byte_fallback, dropout=None,
                    ignore_merges=any(piece.type == USER_DEFINED for piece in proto.pieces))
    tok = Tokenizer(model)

    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:  # spaces only: SentencePiece leaves newlines and tabs alone
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if norm.add_dummy_prefix and legacy:
        # SentencePiece adds its prefix even before a leading space, where Metaspace would add none
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
    tok.normalizer = normalizers.Sequence(steps)

    splits = []
    if norm.add_dummy_prefix:
        splits.append(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always" if legacy else "first",
                                               split=False))
    user_defined = sorted((names[i] for i, piece in enumerate(proto.pieces) if piece.type == USER_DEFINED),
                          key=len, reverse=True)
    if user_defined:  # emitted whole, never merged: each is a chunk of its own
        splits.append(pre_tokenizers.Split(Regex("|".join(map(re.escape, user_defined))), "isolated"))
    if splits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(splits)

    steps = [decoders.Replace("▁", " ")] + ([decoders.ByteFallback()] if spec.byte_fallback else [])
    if norm.add_dummy_prefix:  # fused first so that only the text's first space goes
        steps += [decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    elif spec.byte_fallback:
        steps.append(decoders.Fuse())
    tok.decoder = decoders.Sequence(steps)
    if spec.model_type == UNIGRAM_TYPE:
        # transformers deep-copies this tokenizer, through its JSON, whose parser can move a score by one
        # unit in the last place: the same round trip keeps Viterbi's ties as transformers breaks them
        tok = Tokenizer.from_str(tok.to_str())
    return tok


def _renamed(proto, added: dict) -> list[str]:
    """Piece names by id, with the config's added_tokens_decoder names in place of the .model's; a rename
    onto a name another piece keeps is skipped (two pieces may swap names)."""
    names = {int(i): str(_token(token)) for i, token in added.items()}
    pieces = [piece.piece for piece in proto.pieces]
    kept = {piece for i, piece in enumerate(pieces) if i not in names}
    return [names[i] if i in names and names[i] not in kept else piece for i, piece in enumerate(pieces)]


def _score_ranked_merges(proto, names: list[str]) -> list[tuple[str, str]]:
    """Each normal piece's two-normal-piece splits, ordered by the piece's score (highest first), then its id,
    then the left part's length: SentencePiece's own merge order."""
    normal = {names[i]: (-piece.score, i) for i, piece in enumerate(proto.pieces) if piece.type == NORMAL}
    ranked = [(rank, (token[:k], token[k:])) for token, rank in normal.items() for k in range(1, len(token))
              if token[:k] in normal and token[k:] in normal]
    ranked.sort(key=lambda item: item[0])  # stable: splits of one piece stay in left-length order
    return [pair for _, pair in ranked]


# ----------------------------------------------------------------------------- added tokens

def _spm_specials(proto, user_defined: bool) -> list:
    """The .model's control pieces (special) and, if asked, its user-defined pieces (not special), as the
    extra special tokens transformers takes from a .model when the config lists none."""
    from tokenizers import AddedToken

    kinds = (CONTROL, USER_DEFINED) if user_defined else (CONTROL,)
    return [AddedToken(piece.piece, normalized=False, special=piece.type == CONTROL)
            for piece in proto.pieces if piece.type in kinds]


def _add_tokens(tok, proto, config: dict, named: dict, spm_extras: list, generic: bool) -> None:
    """Adds, in transformers' order, the config's added_tokens_decoder (by id), then the named and
    model-specific special tokens and the extra special tokens that it does not already hold."""
    from tokenizers import AddedToken

    by_id = sorted(((int(i), _token(t)) for i, t in (config.get("added_tokens_decoder") or {}).items()),
                   key=lambda item: item[0])
    decoded = [t for _, t in by_id]
    by_content = {str(t): t for t in decoded}

    # Named tokens: the config's, else the pipeline's defaults; one the decoder holds is that AddedToken
    for key in NAMED:
        if key in config:
            named[key] = config[key]
    named = {key: by_content.get(str(_token(value)), _token(value)) for key, value in named.items()
             if value is not None}
    # Model-specific ones (boi_token, ...): other "*_token" keys (AddedToken dicts before strings), then
    # a dict of extra_special_tokens
    specific = {key: _token(v) for key, v in config.items()
                if key.endswith("_token") and key not in NAMED and isinstance(v, dict) and "__type" in v}
    specific.update((key, v) for key, v in config.items()
                    if key.endswith("_token") and key not in NAMED and isinstance(v, str))
    extras = config.get("extra_special_tokens")
    if not extras and "additional_special_tokens" in config:
        extras = config["additional_special_tokens"]  # its older name
    elif "extra_special_tokens" not in config:
        extras = spm_extras
    if isinstance(extras, dict):
        specific.update(extras)
        extras = spm_extras
    named.update((key, _token(value)) for key, value in specific.items() if value is not None)
    extras = [_token(t) for t in extras or []]

    if generic and proto.normalizer_spec.add_dummy_prefix:
        # matched on the raw text, so that each chunk between them gets its own dummy prefix
        decoded = [AddedToken(**{**t.__getstate__(), "normalized": False}) for t in decoded]
    held = {str(t) for t in decoded}
    tokens = list(decoded)
    for t in [*named.values(), *extras]:
        if str(t) not in held and t not in tokens:  # by content against the decoder, by value against the rest
            tokens.append(t)
    names = {str(t) for t in named.values()}
    for i, t in enumerate(tokens):
        if isinstance(t, str):
            tokens[i] = AddedToken(t, special=True)
        elif not t.special and str(t) in names:
            t.special = True
    if tokens:
        tok.add_tokens(tokens)


def _token(value):
    """A config's token: a string, or an AddedToken from its serialized dict."""
    from tokenizers import AddedToken

    if isinstance(value, dict):
        fields = {k: v for k, v in value.items() if k != "__type"}
        return AddedToken(fields.pop("content"), **fields)
    return value


def _clean_up_on_decode(tok) -> None:
    """transformers' clean_up_tokenization_spaces, as decoder steps on the whole (fused) text."""
    from tokenizers import decoders

    steps = [tok.decoder] if tok.decoder is not None else []
    tok.decoder = decoders.Sequence(steps + [decoders.Fuse()]
                                    + [decoders.Replace(a, b) for a, b in CLEANUP])
