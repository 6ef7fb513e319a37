"""Which tokenizer class transformers 5's AutoTokenizer builds a folder's tokenizer with: the class that
tokenizer_config.json names (else config.json's `tokenizer_class`), unless config.json's `model_type` overrides
it, as AutoTokenizer.from_pretrained decides in transformers/models/auto/tokenization_auto.py:

- a tokenizer of the folder's own code (tokenizer_config.json's `auto_map`): the named class, no override;
- LlamaTokenizer over a byte-level tokenizer.json (Llama 3 style): the file as written, as LlamaTokenizer
  hard-codes Metaspace (except for the model types whose named class is known to be wrong);
- a model type registered to another class than the named one: the file as written where that class is
  TokenizersBackend (Phi-3, Mistral, OLMo 2: their configs say LlamaTokenizer or GPT2Tokenizer); the registered
  class where the type is in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS (a qwen2 model whose config says
  LlamaTokenizer); else the named class;
- no class named: the model type's registered class, else the file as written.

The data below is transformers 5.24's, named as that file names it; only the model types whose class matters
here are listed (those registered to the file as written or to a class shard/data/pipelines.py builds, and those
of a family an export writes).
"""

GENERIC = "TokenizersBackend"  # the file as written (a lone SentencePiece .model: its generic conversion)

# TOKENIZER_MAPPING_NAMES: model type -> its registered class, for the classes that matter here
_REGISTERED_BY_CLASS = {
    GENERIC: """
        EvollaModel arctic aria beam bigbird_pegasus camembertv2-base canary chatlm cohere_asr ernie4_5 ernie4_5_moe
        flex_olmo fuyu glm glm4 glm4_moe glm4_moe_lite glm4v glm4v_moe glm_image glmasr got_ocr2 gpt_bigcode
        gradium_phonon_tts granite granitemoe granitemoehybrid granitemoeshared h2ovl_chat hyperclovax hyperclovax_vlm
        internlm2 internlm3 iquestcoder jamba kimi_k25 kimi_linear kosmos-2 llava llava_next mimo_v2_flash minicpm3
        minicpm_ocr minicpmv minicpmv4_6 minicpmv4_7 minimax_m2 ministral ministral3 mistral mistral3 mistral_large4
        mixtral modernbert modernbert-decoder molmo molmo2 nemo_speechlm nemotron nvfp4 nystromformer olmo2 olmo3
        olmo_hybrid omniasr opencua openvla paddleocr_vl pegasus_x persimmon phi3 phi3_v phimoe pix2struct pixtral
        pocket_tts smolvlm stablelm step3_vl umt5 vipllava voxtral voxtral_realtime xlm-roberta-xl""",
    "GemmaTokenizer": """
        diffusion_gemma gemma gemma2 gemma3 gemma3_text gemma3n gemma3n_text recurrent_gemma shieldgemma2 t5gemma
        zaya""",
    "GPTNeoXTokenizer": "falcon_mamba gpt_neox mamba mamba2 mpt olmo olmoe rwkv xlstm",  # read as written here; an
    # export written as olmoe names the run's class, which its registered class would garble (a .model's pieces)
    "GPT2Tokenizer": """
        blip-2 codegen dbrx emu3 gpt2 gpt_neo gptj hyperclovax_vision_v2 instructblip instructblipvideo jais2 opt
        phi starcoder2""",
    "LlamaTokenizer": "idefics idefics2",
    "Qwen2Tokenizer": """
        audioflamingo3 colqwen2 cosmos3_omni dots3_note fun_asr_nano hunyuan_vl internvl lighton_ocr
        moss_transcribe_diarize ovis2 qianfan_ocr qwen2 qwen2_5_omni qwen2_5_vl qwen2_audio qwen2_moe qwen2_vl qwen3
        qwen3_asr qwen3_moe qwen3_next qwen3_omni_moe qwen3_vl qwen3_vl_moe vibevoice""",
    "Qwen3_5Tokenizer": "qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_text qwen4_exp",
    "Siglip2Tokenizer": "siglip2",  # on the list below; a class not built here (read as written)
}
REGISTERED = {kind: cls for cls, kinds in _REGISTERED_BY_CLASS.items() for kind in kinds.split()}

# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS: where the named class and the registered one differ, the registered wins
HUB_CLASS_WRONG = frozenset("""
    arctic camembertv2-base chatlm cohere_asr ernie4_5 ernie4_5_moe fuyu h2ovl_chat hyperclovax hyperclovax_vision_v2
    hyperclovax_vlm internlm2 internlm3 iquestcoder jamba llava llava_next minicpm3 minicpmv minimax_m2 modernbert
    modernbert-decoder molmo molmo2 nemotron nvfp4 opencua openvla paddleocr_vl phi3 phi3_v phimoe qwen2 qwen3_5
    qwen3_5_moe qwen3_5_moe_text qwen4_exp siglip2 smolvlm step3_vl vipllava""".split())

MODEL_KEYS = ("model_type", "model_name", "tokenizer_class")  # what config.json says that counts here


def name(value) -> str | None:
    """A class name as transformers 5 compares them: without "Fast" (one class of each), PreTrainedTokenizerFast
    being TokenizersBackend."""
    if not isinstance(value, str) or not value:
        return None
    return GENERIC if value == "PreTrainedTokenizerFast" else value.removesuffix("Fast")


def choose(config: dict, model: dict, byte_level: bool) -> str | None:
    """The class AutoTokenizer builds the folder with (GENERIC: the file as written), or None where nothing names
    one. `config` is tokenizer_config.json, `model` config.json ({} where absent), `byte_level` whether
    tokenizer.json's pre-tokenizer or decoder is ByteLevel."""
    named = name(config.get("tokenizer_class")) or name(model.get("tokenizer_class"))
    kind = model.get("model_type")
    own = REGISTERED.get(kind) if isinstance(kind, str) else None
    remote = config.get("auto_map")
    remote = remote.get("AutoTokenizer") if isinstance(remote, dict) else remote
    if remote is not None:  # the folder's own code, which is never run here: the class it names
        return named or own
    wrong = any(isinstance(v, str) and v in HUB_CLASS_WRONG for v in (kind, model.get("model_name")))
    if named == "LlamaTokenizer" and byte_level and not wrong:
        return GENERIC
    if named is not None and own is not None and own != named:
        return own if own == GENERIC or wrong else named
    return named or own


def of_folder(config: dict, model: dict, byte_level: bool, fallback: str = GENERIC) -> tuple[str, str | None]:
    """`choose`'s class (`fallback` where nothing names one), and the same again where config.json picked it over
    what tokenizer_config.json alone gives, else None (the same files then give other tokens)."""
    cls, alone = (choose(config, m, byte_level) or fallback for m in (model, {}))
    return cls, (cls if cls != alone else None)
