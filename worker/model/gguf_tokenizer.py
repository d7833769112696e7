"""A `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata: the vocabulary, merges,
token types (control tokens become special, user-defined ones added tokens), BOS/EOS and the
pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`. Byte-level BPE ("gpt2") only: a
SentencePiece vocabulary ("llama") is refused by name.
"""

from __future__ import annotations

from .config import CheckpointError

# GGUF token types (llama.cpp's llama_token_type).
CONTROL, USER_DEFINED = 3, 4

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> how the text is split before BPE (as each model's tokenizer.json does).
PRE_TOKENIZERS = {
    "default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2",
    # GPT-2's split after every digit on its own (StarCoder's tokenizer and its descendants).
    "smollm": "digits+gpt2", "starcoder": "digits+gpt2", "refact": "digits+gpt2", "codeshell": "digits+gpt2",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3",
    "qwen2": "qwen2",
}


def build_tokenizer(get, source: str):
    """`get(key, kind, required=..., default=...)` reads metadata (gguf_file._Meta.get)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = get("tokenizer.ggml.model", str)
    if model != "gpt2":
        raise CheckpointError(f"{source}: tokenizer.ggml.model={model!r} is not supported "
                              f"(supported: 'gpt2', byte-level BPE)")
    pre = get("tokenizer.ggml.pre", str, required=False, default="default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported "
                              f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    tokens = get("tokenizer.ggml.tokens", list)
    merges = get("tokenizer.ggml.merges", list)
    types = get("tokenizer.ggml.token_type", list, required=False, default=[1] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(f"{source}: {len(tokens)} tokens but {len(types)} token types")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens holds {len(tokens) - len(vocab)} duplicate token(s)")
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{source}: tokenizer.ggml.merges entry {merge!r} is not two tokens")
        pairs.append((parts[0], parts[1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[pre])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    if get("tokenizer.ggml.add_bos_token", bool, required=False, default=False):
        bos_id = get("tokenizer.ggml.bos_token_id")
        if bos_id >= len(tokens):
            raise CheckpointError(f"{source}: tokenizer.ggml.bos_token_id={bos_id} is outside the vocabulary")
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, bos_id)])
    return tok


def _pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    pattern = LLAMA3_SPLIT if kind == "llama3" else QWEN2_SPLIT
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
