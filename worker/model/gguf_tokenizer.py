"""A `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata, as llama.cpp tokenizes
with the same file. Two kinds of vocabulary (`tokenizer.ggml.model`):

- "gpt2", byte-level BPE (SmolLM, Llama 3, Qwen2): the vocabulary, merges, token types (control
  tokens become special, user-defined ones added tokens), BOS and the pre-tokenizer llama.cpp
  names in `tokenizer.ggml.pre`.
- "llama", SentencePiece BPE with byte fallback (Llama 1/2, Mistral 7B, TinyLlama): pieces with
  "▁" for spaces, a score per piece and no merges. SentencePiece merges, at each step, the
  adjacent pair whose joined piece scores highest; a BPE whose merges are every split of every
  normal piece into two known pieces, ranked by the joined piece's score, merges the same pairs
  in the same order (what llama.cpp's llm_tokenizer_spm and Hugging Face's GGUF converter do; a
  Unigram model over the same scores tokenizes differently). Characters outside the vocabulary
  become their UTF-8 bytes (`<0x0A>` pieces). A "▁" is prepended to each run of text between
  special tokens (`tokenizer.ggml.add_space_prefix`, on by default) and stripped again when decoding.

Any other kind ("bert", "t5", "rwkv", ...) is refused by name.
"""

from __future__ import annotations

from .config import CheckpointError

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"   # SentencePiece's visible space
SUPPORTED_MODELS = "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"

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
    if model == "llama":
        return _sentencepiece_bpe(get, source)
    if model != "gpt2":
        raise CheckpointError(f"{source}: tokenizer.ggml.model={model!r} is not supported "
                              f"(supported: {SUPPORTED_MODELS})")
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


def _sentencepiece_bpe(get, source: str):
    """tokenizer.ggml.model = "llama" (module docstring); merges in the file, if any, are ignored
    as llama.cpp ignores them: the scores rank the merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens = get("tokenizer.ggml.tokens", list)
    scores = get("tokenizer.ggml.scores", list, required=False)
    if scores is None:
        raise CheckpointError(f"{source}: missing metadata key 'tokenizer.ggml.scores' (a SentencePiece "
                              f"vocabulary needs the score of each piece to know which pieces to merge first)")
    types = get("tokenizer.ggml.token_type", list, required=False, default=[NORMAL] * len(tokens))
    for key, values in (("tokenizer.ggml.scores", scores), ("tokenizer.ggml.token_type", types)):
        if len(values) != len(tokens):
            raise CheckpointError(f"{source}: {len(tokens)} tokens but {len(values)} entries in {key}")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens holds {len(tokens) - len(vocab)} duplicate token(s)")
    unk_id = get("tokenizer.ggml.unknown_token_id", required=False, default=0)   # llama.cpp's default
    unk = tokens[unk_id] if 0 <= unk_id < len(tokens) else None   # for bytes without a <0x..> piece (some files say -1)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, types), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    space_prefix = get("tokenizer.ggml.add_space_prefix", bool, required=False, default=True)
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if space_prefix else [])
                                          + [normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    # llama.cpp splits the text at control, unknown and user-defined tokens before tokenizing.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind in (CONTROL, UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    # SentencePiece vocabularies add BOS unless the file says otherwise (llama.cpp's default).
    _add_bos_eos(tok, get, source, tokens, get("tokenizer.ggml.add_bos_token", bool, required=False, default=True),
                 get("tokenizer.ggml.add_eos_token", bool, required=False, default=False))
    return tok


def _merges_by_score(tokens: list[str], scores: list, types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces of the vocabulary, the best-scored piece's
    first. Ties go to the lower id: SentencePiece numbers its BPE pieces in merge order, so even a
    file whose scores are all equal (gguf's converter writes -1000 for every piece when it had only
    a tokenizer.json) merges in SentencePiece's order."""
    parts = {t for t, kind in zip(tokens, types) if kind in (NORMAL, USER_DEFINED)}
    ranked = []
    for i, (piece, kind) in enumerate(zip(tokens, types)):
        if kind != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in parts and right in parts:
                ranked.append((-float(scores[i]), i, left, right))
    ranked.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in ranked]


def _add_bos_eos(tok, get, source: str, tokens: list[str], add_bos: bool, add_eos: bool) -> None:
    from tokenizers import processors

    ends = {}
    for name, wanted in (("bos", add_bos), ("eos", add_eos)):
        if wanted:
            token_id = get(f"tokenizer.ggml.{name}_token_id")
            if token_id >= len(tokens):
                raise CheckpointError(f"{source}: tokenizer.ggml.{name}_token_id={token_id} is outside the vocabulary")
            ends[name] = (tokens[token_id], token_id)
    if not ends:
        return
    bos = f"{ends['bos'][0]} " if "bos" in ends else ""
    eos = f" {ends['eos'][0]}" if "eos" in ends else ""
    tok.post_processor = processors.TemplateProcessing(single=f"{bos}$A{eos}", pair=f"{bos}$A{eos} {bos}$B{eos}",
                                                       special_tokens=sorted(set(ends.values())))
