"""Model shape: one dataclass for both families, read from a Hugging Face config.json or a preset.

Every number the forward pass uses comes from here. config.json keys have moved between
transformers releases (n_ctx/n_positions, rope_theta/rope_scaling/rope_parameters): we read
what the file says and refuse, naming the key and the file, when something required is absent.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A model folder that cannot be loaded; the message says what is wrong and where."""


# RoPE variants we implement. Others (yarn, dynamic, longrope, ...) are refused by name.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str                   # "gpt2" or "llama" (also Mistral, Qwen2): which forward function runs
    vocab_size: int             # rows of the token embedding and of the LM head
    d_model: int                # residual stream width (n_embd / hidden_size)
    n_layers: int               # transformer blocks
    n_heads: int                # query heads
    n_kv_heads: int             # key/value heads (GQA); equals n_heads for GPT-2
    head_dim: int               # width of one head; d_model // n_heads unless the config says otherwise
    d_ff: int                   # MLP hidden width (4*d_model for GPT-2, intermediate_size for Llama)
    max_positions: int          # positions >= this are refused (learned table size / trained context)
    norm_eps: float             # LayerNorm (GPT-2) or RMSNorm (Llama) epsilon
    eos_token_id: int           # end-of-text: generation stops here
    # LM head reuses the token embedding matrix. None only from read_config when a Llama
    # config.json does not say: load_checkpoint then decides by whether lm_head.weight exists.
    tie_word_embeddings: bool | None
    activation: str             # "gelu_tanh" (GPT-2) or "silu" (Llama SwiGLU)
    rope_theta: float | None = None   # Llama only: RoPE base
    # Llama only: RoPE scaling as in config.json, e.g. {"rope_type": "llama3", "factor": 8.0, ...};
    # None = plain RoPE. Only SUPPORTED_ROPE_TYPES reach here.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    extra_eos_token_ids: tuple[int, ...] = ()  # further stop ids (Llama 3 lists several)
    # Llama family only: a query at position p attends to keys at p - sliding_window < j <= p
    # (Mistral's sliding_window); None = the whole context.
    sliding_window: int | None = None
    # Llama family only: the q, k and v projections add a bias (Qwen2; o_proj has none).
    qkv_bias: bool = False

    def describe(self) -> str:
        """The family as error messages name it: which tensors a checkpoint of it holds."""
        return self.arch + (" with q/k/v biases (Qwen2)" if self.qkv_bias else "")

    def layer_windows(self) -> list[int | None]:
        """The window each layer attends within (None: the whole context); one for all layers today."""
        return [self.sliding_window] * self.n_layers

    def to_json(self) -> str:
        """Canonical text of every field: part of the model fingerprint. A field added later is left
        out while it has the value every earlier model implied (no q/k/v biases), so an upgrade keeps
        earlier models' fingerprints, and the pages kvnodes hold for them, valid."""
        fields = asdict(self)
        if not fields["qkv_bias"]:
            del fields["qkv_bias"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))


# ----------------------------------------------------------------------------- presets

BYTE_VOCAB = 257      # 256 byte values + end-of-text
BYTE_EOS = 256

PRESETS: dict[str, ModelConfig] = {
    # The embedded default: runs offline, fast enough for tests on two cores.
    "tiny": ModelConfig(
        arch="gpt2", vocab_size=BYTE_VOCAB, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4,
        head_dim=64, d_ff=1024, max_positions=1024, norm_eps=1e-5, eos_token_id=BYTE_EOS,
        tie_word_embeddings=True, activation="gelu_tanh",
    ),
    # GPT-2 small's compute shape (the vocab is the byte tokenizer's): for benchmarks.
    "gpt2-small-shape": ModelConfig(
        arch="gpt2", vocab_size=BYTE_VOCAB, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
        head_dim=64, d_ff=3072, max_positions=1024, norm_eps=1e-5, eos_token_id=BYTE_EOS,
        tie_word_embeddings=True, activation="gelu_tanh",
    ),
}

# Fixed seeds of the preset weights (see init.py).
PRESET_SEEDS = {"tiny": 1234, "gpt2-small-shape": 5678}


# ----------------------------------------------------------------------------- config.json

GPT2_ARCHITECTURES = {"GPT2LMHeadModel", "GPT2Model"}
LLAMA_ARCHITECTURES = {"LlamaForCausalLM", "LlamaModel"}
MISTRAL_ARCHITECTURES = {"MistralForCausalLM", "MistralModel"}   # Llama's tensors, plus a sliding window
QWEN2_ARCHITECTURES = {"Qwen2ForCausalLM", "Qwen2Model"}          # Llama's, plus q/k/v biases
GPT2_ACTIVATIONS = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}  # all tanh-approximated GELU


def read_config(folder: str | Path) -> ModelConfig:
    """Read `config.json` of an HF folder into a ModelConfig, or raise CheckpointError."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {folder}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config_from_dict(raw, str(path), generation_config=_read_generation_config(Path(folder)))


def config_from_dict(raw: dict, source: str, generation_config: dict | None = None) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{source}: missing key 'model_type'")
    architectures = raw.get("architectures") or []
    if model_type == "gpt2":
        known = GPT2_ARCHITECTURES
    elif model_type == "llama":
        known = LLAMA_ARCHITECTURES
    elif model_type == "mistral":
        known = MISTRAL_ARCHITECTURES
    elif model_type == "qwen2":
        known = QWEN2_ARCHITECTURES
    else:
        raise CheckpointError(
            f"{source}: unsupported architecture model_type={model_type!r} "
            f"(architectures={architectures}); supported: gpt2, llama, mistral, qwen2")
    unknown = [a for a in architectures if a not in known]
    if unknown:
        raise CheckpointError(
            f"{source}: unsupported architectures {unknown} for model_type={model_type!r}; "
            f"supported: {sorted(known)}")
    reader = _Reader(raw, source)
    eos, extra_eos = _eos_ids(raw, generation_config, source)
    if model_type == "gpt2":
        return _gpt2_config(reader, eos, extra_eos)
    config = _llama_config(reader, eos, extra_eos)
    if model_type == "mistral" and reader.has("sliding_window"):   # null in later Mistrals: no window
        config = replace(config, sliding_window=reader.get("sliding_window"))
    if model_type == "qwen2":   # Qwen2Attention: q/k/v with bias, o_proj without, whatever the config says
        config = replace(config, qkv_bias=True, sliding_window=_qwen2_window(reader, config.n_layers))
    return config


def _qwen2_window(r: _Reader, n_layers: int) -> int | None:
    """Qwen2's sliding window, as Qwen2Config derives it: only with use_sliding_window, on the
    layers `layer_types` marks "sliding_attention" (absent: those at index >= max_window_layers).
    A window on every layer or on none runs exactly; on some layers only, it is refused."""
    use = r.raw.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise CheckpointError(f"{r.source}: key 'use_sliding_window' should be true/false, got {use!r}")
    if not use:
        return None
    layer_types = r.raw.get("layer_types")
    if layer_types is not None:
        if (not isinstance(layer_types, list) or len(layer_types) != n_layers
                or any(t not in ("full_attention", "sliding_attention") for t in layer_types)):
            raise CheckpointError(f"{r.source}: key 'layer_types' should list 'full_attention' or "
                                  f"'sliding_attention' for each of the {n_layers} layers, got {layer_types!r}")
        windowed, rule = [t == "sliding_attention" for t in layer_types], "layer_types"
    else:
        first = r.raw.get("max_window_layers")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise CheckpointError(f"{r.source}: use_sliding_window=true needs key 'max_window_layers' "
                                  f"(a count of layers >= 0), got {first!r}")
        windowed, rule = [i >= first for i in range(n_layers)], f"max_window_layers={first}"
    if not any(windowed):
        return None
    if all(windowed):
        return r.get("sliding_window")
    raise CheckpointError(
        f"{r.source}: use_sliding_window=true with {rule} puts a sliding window on {sum(windowed)} of the "
        f"{n_layers} layers only; a window on some layers and not others is not supported (every layer or "
        f"none is): set use_sliding_window to false to run every layer on the whole context, as the "
        f"published Qwen2 and Qwen2.5 configs do")


class _Reader:
    """Typed access to config.json keys; a missing key is an error naming key and file."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def get(self, *keys: str, kind=int):
        for key in keys:
            if self.raw.get(key) is not None:
                value = self.raw[key]
                if kind is bool:
                    if not isinstance(value, bool):
                        raise CheckpointError(f"{self.source}: key {key!r} should be true/false, got {value!r}")
                    return value
                if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                    raise CheckpointError(f"{self.source}: key {key!r} should be a positive integer, got {value!r}")
                if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise CheckpointError(f"{self.source}: key {key!r} should be a number, got {value!r}")
                return kind(value)
        names = " or ".join(repr(k) for k in keys)
        raise CheckpointError(f"{self.source}: missing key {names}")

    def refuse_if(self, key: str, bad, why: str):
        if key in self.raw and self.raw[key] is not None and bad(self.raw[key]):
            raise CheckpointError(f"{self.source}: {key}={self.raw[key]!r} is not supported ({why})")


def _eos_ids(raw: dict, generation_config: dict | None, source: str) -> tuple[int, tuple[int, ...]]:
    value = raw.get("eos_token_id")
    if value is None and generation_config:
        value = generation_config.get("eos_token_id")
    if value is None:
        raise CheckpointError(f"{source}: missing key 'eos_token_id' (also absent from generation_config.json)")
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{source}: key 'eos_token_id' should be an id or a list of ids, got {value!r}")
    return ids[0], tuple(ids[1:])


def _read_generation_config(folder: Path) -> dict | None:
    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from e
    return data if isinstance(data, dict) else None


def _gpt2_config(r: _Reader, eos: int, extra_eos: tuple[int, ...]) -> ModelConfig:
    d_model = r.get("n_embd")
    n_heads = r.get("n_head")
    if d_model % n_heads:
        raise CheckpointError(f"{r.source}: n_embd={d_model} is not a multiple of n_head={n_heads}")
    activation = r.get("activation_function", kind=str)
    if activation not in GPT2_ACTIVATIONS:
        raise CheckpointError(
            f"{r.source}: activation_function={activation!r} is not supported "
            f"(supported: tanh-approximated GELU {sorted(GPT2_ACTIVATIONS)})")
    r.refuse_if("scale_attn_weights", lambda v: v is not True, "attention must be scaled by 1/sqrt(head_dim)")
    r.refuse_if("scale_attn_by_inverse_layer_idx", lambda v: v is True, "per-layer attention scaling")
    r.refuse_if("add_cross_attention", lambda v: v is True, "cross-attention")
    return ModelConfig(
        arch="gpt2",
        vocab_size=r.get("vocab_size"),
        d_model=d_model,
        n_layers=r.get("n_layer"),
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=d_model // n_heads,
        # GPT2Config documents n_inner=None (absent or null) as 4 * n_embd.
        d_ff=r.get("n_inner") if r.has("n_inner") else 4 * d_model,
        # Older releases wrote n_ctx, newer ones n_positions (the learned position table).
        max_positions=r.get("n_positions", "n_ctx"),
        norm_eps=r.get("layer_norm_epsilon", kind=float),
        eos_token_id=eos,
        extra_eos_token_ids=extra_eos,
        # GPT2LMHeadModel ties its head unless the config says otherwise.
        tie_word_embeddings=r.get("tie_word_embeddings", kind=bool) if r.has("tie_word_embeddings") else True,
        activation="gelu_tanh",
    )


def _llama_config(r: _Reader, eos: int, extra_eos: tuple[int, ...]) -> ModelConfig:
    d_model = r.get("hidden_size")
    n_heads = r.get("num_attention_heads")
    # Absent num_key_value_heads means plain multi-head attention (LlamaConfig's documented rule).
    n_kv_heads = r.get("num_key_value_heads") if r.has("num_key_value_heads") else n_heads
    if n_heads % n_kv_heads:
        raise CheckpointError(
            f"{r.source}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv_heads}")
    if r.has("head_dim"):
        head_dim = r.get("head_dim")
    elif d_model % n_heads:
        raise CheckpointError(f"{r.source}: hidden_size={d_model} is not a multiple of num_attention_heads={n_heads}")
    else:
        head_dim = d_model // n_heads
    if head_dim % 2:
        raise CheckpointError(f"{r.source}: head_dim={head_dim} must be even for RoPE")
    activation = r.get("hidden_act", kind=str)
    if activation != "silu":
        raise CheckpointError(f"{r.source}: hidden_act={activation!r} is not supported (Llama uses 'silu')")
    r.refuse_if("attention_bias", lambda v: v is True, "attention projections with bias")
    r.refuse_if("mlp_bias", lambda v: v is True, "MLP projections with bias")
    rope_theta, rope_scaling = _rope(r)
    return ModelConfig(
        arch="llama",
        vocab_size=r.get("vocab_size"),
        d_model=d_model,
        n_layers=r.get("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_ff=r.get("intermediate_size"),
        max_positions=r.get("max_position_embeddings"),
        norm_eps=r.get("rms_norm_eps", kind=float),
        eos_token_id=eos,
        extra_eos_token_ids=extra_eos,
        # Checkpoint loading decides from the files when the config does not say (see checkpoint.py);
        # LlamaConfig writes this key in every release we know of.
        tie_word_embeddings=r.get("tie_word_embeddings", kind=bool) if r.has("tie_word_embeddings") else None,
        activation="silu",
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
    )


def _rope(r: _Reader) -> tuple[float, dict | None]:
    """RoPE base and scaling, from `rope_parameters` (newer releases) or `rope_theta` + `rope_scaling`."""
    params = r.raw.get("rope_parameters")
    if params is not None:
        where = "rope_parameters"
        if not isinstance(params, dict):
            raise CheckpointError(f"{r.source}: rope_parameters should be an object, got {params!r}")
        if params.get("rope_theta") is None:
            raise CheckpointError(f"{r.source}: missing key 'rope_parameters.rope_theta'")
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        where = "rope_scaling"
        theta = r.get("rope_theta", kind=float)
        scaling = r.raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise CheckpointError(f"{r.source}: rope_scaling should be an object or null, got {scaling!r}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise CheckpointError(f"{r.source}: rope_theta should be a positive number, got {theta!r}")
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        raise CheckpointError(f"{r.source}: missing key '{where}.rope_type'")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{r.source}: {where} rope_type={rope_type!r} is not implemented (supported: {list(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), None
    required = ["factor"]
    if rope_type == "llama3":
        required += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    values = {"rope_type": rope_type}
    for key in required:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{r.source}: missing or invalid key '{where}.{key}' for rope_type {rope_type!r}")
        values[key] = float(value)
    if rope_type == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]:
        raise CheckpointError(f"{r.source}: {where}: high_freq_factor must exceed low_freq_factor")
    return float(theta), values
