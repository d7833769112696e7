"""Load a GGUF file (llama.cpp's format) of the Llama family: metadata into a ModelConfig, tensors
dequantized to float32 by the `gguf` package's own dequantizers and renamed to the Hugging Face
names llama.py runs, the tokenizer built from `tokenizer.ggml.*`, and the chat template. Anything
we cannot run exactly is refused with a CheckpointError naming the key, tensor or type at fault.
The file's layout is read here (GGUFFile), not by gguf's GGUFReader: that one makes a NumPy view
of each string, over two seconds of CPU for the default model's 49k tokens and merges, which
every worker start paid.

"qwen2" is the Llama forward plus q/k/v biases, its metadata under "qwen2.*".
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .config import CheckpointError, ModelConfig
from .gguf_tokenizer import build_tokenizer
from .llama import tensor_shapes

# Architectures whose tensors and rope match llama.py, and those of them whose Q/K rows the
# converter permuted (see _read_tensors); which of them add q/k/v biases: blk.N.attn_q/attn_k/attn_v.bias,
# required, and no attn_output bias.
SUPPORTED_ARCHS = ("llama", "qwen2")
PERMUTED_QK_ARCHS = ("llama",)
QKV_BIAS_ARCHS = ("qwen2",)

# GGUF tensor name -> canonical (llama.py) name; "{i}" is the layer.
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}


def supported_types():
    import gguf

    T = gguf.GGMLQuantizationType
    return {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
            T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}


@dataclass
class GGUFModel:
    config: ModelConfig
    tensors: dict[str, np.ndarray]      # canonical name -> float32, HF layout
    tokenizer: object                    # tokenizers.Tokenizer
    chat_template: str | None
    bos_token_id: int | None


def read_gguf(path: str | Path, with_tensors: bool = True) -> GGUFModel:
    """Config, tokenizer and template from the metadata; the tensors too unless with_tensors=False
    (then `tensors` is empty: what clients that only tokenize, or size pages, need)."""
    path = Path(path)
    reader = _open(path)
    meta = _Meta(reader, str(path))
    config = gguf_config(meta)
    # No output.weight: the head is the token embedding (tied).
    config = dataclasses.replace(config, tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors))
    permuted = meta.get("general.architecture", str) in PERMUTED_QK_ARCHS
    tensors = _read_tensors(reader, config, str(path), permuted) if with_tensors else {}
    tokenizer = build_tokenizer(meta.get, str(path))
    template = meta.get("tokenizer.chat_template", str, required=False)
    return GGUFModel(config, tensors, tokenizer, template, meta.get("tokenizer.ggml.bos_token_id", required=False))


def _open(path: Path) -> "GGUFFile":
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        return GGUFFile(path)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file, or truncated ({e})") from e


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: object          # gguf.GGMLQuantizationType
    shape: tuple[int, ...]       # GGUF's order, fastest dimension first (ne0 = the input width)
    data: np.ndarray             # a read-only view of the file: typed for float and integer types, else the bytes


# GGUF metadata value types (gguf.GGUFValueType) -> struct formats; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32


class GGUFFile:
    """A GGUF file's metadata and tensors, read as gguf.GGUFReader reads them. `fields`: key ->
    value, strings left as bytes (decoded by _Meta.get, so a bad one is named by its key) and
    arrays as lists (an array of arrays flattened, as GGUFReader does); `tensors` in file order.
    ValueError, KeyError or struct.error for a file that is not GGUF, or is truncated."""

    def __init__(self, path: Path):
        import gguf

        with open(path, "rb") as file:
            self._buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # ValueError when empty
        if self._buffer[:4] != b"GGUF":
            raise ValueError("GGUF magic invalid")
        self._offset = 4
        self._order = "<"
        version = self._scalar("I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._order = ">"
            version = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} (supported: {', '.join(map(str, _SUPPORTED_VERSIONS))})")
        tensor_count, kv_count = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, object] = {}
        types: dict[str, int] = {}
        for _ in range(kv_count):
            key = self._string().decode("utf-8")
            if key in self.fields:
                raise KeyError(f"duplicate metadata key {key}")
            types[key] = self._scalar("I")
            self.fields[key] = self._value(types[key])
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if "general.alignment" in types and types["general.alignment"] != _UINT32:
            raise ValueError("Bad type for general.alignment field")
        if alignment == 0 or alignment & (alignment - 1):
            raise ValueError("Invalid alignment: must be a non-zero power of two")
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(gguf, start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(self._order + fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> bytes:
        length = self._scalar("Q")
        end = self._offset + length
        if end > len(self._buffer):
            raise ValueError("a string runs past the end of the file")
        value, self._offset = self._buffer[self._offset:end], end
        return value

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._scalar("I"), self._scalar("Q")
            if item_kind in _SCALAR_FORMATS:  # the numbers in one read
                fmt = f"{self._order}{count}{_SCALAR_FORMATS[item_kind]}"
                values = list(struct.unpack_from(fmt, self._buffer, self._offset))
                self._offset += struct.calcsize(fmt)
                return values
            values = []
            for _ in range(count):
                value = self._value(item_kind)
                values.extend(value) if item_kind == _ARRAY else values.append(value)
            return values
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"Unknown/unhandled field type {kind}")
        return self._scalar(_SCALAR_FORMATS[kind])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string().decode("utf-8")
        n_dims = self._scalar("I")
        dims = struct.unpack_from(f"{self._order}{n_dims}Q", self._buffer, self._offset)
        self._offset += 8 * n_dims
        return name, dims, self._scalar("I"), self._scalar("Q")

    def _tensor(self, gguf, start: int, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensor:
        """The tensor's data as GGUFReader gives it: float and integer types as their own dtype in
        NumPy order, quantized ones as bytes (gguf.quant_shape_to_byte_shape)."""
        T = gguf.GGMLQuantizationType
        tensor_type = T(raw_type)
        n_elements = math.prod(dims)
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        n_bytes = n_elements * type_size // block_size
        begin = start + offset
        if begin + n_bytes > len(self._buffer):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        shape = tuple(reversed(dims))
        typed = {T.F16: "f2", T.F32: "f4", T.F64: "f8", T.I8: "i1", T.I16: "i2", T.I32: "i4", T.I64: "i8"}
        if tensor_type in typed:
            dtype, count = np.dtype(self._order + typed[tensor_type]), n_elements
        else:
            dtype, count, shape = np.uint8, n_bytes, gguf.quant_shape_to_byte_shape(shape, tensor_type)
        data = np.frombuffer(self._buffer, dtype=dtype, count=count, offset=begin).reshape(shape)
        return GGUFTensor(name, tensor_type, dims, data)


class _Meta:
    """Typed access to GGUF metadata; a missing or ill-typed key is an error naming it and the file."""

    def __init__(self, reader: GGUFFile, source: str):
        self.fields, self.source = reader.fields, source

    def get(self, key: str, kind=int, required: bool = True, default=None):
        value = self.fields.get(key)
        if value is None:
            if required:
                raise CheckpointError(f"{self.source}: missing metadata key {key!r}")
            return default
        try:
            value = _decoded(value)
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.source}: metadata key {key!r} is unreadable ({e})") from e
        ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              str: lambda v: isinstance(v, str),
              bool: lambda v: isinstance(v, bool),
              list: lambda v: isinstance(v, list)}[kind]
        if not ok(value):
            raise CheckpointError(f"{self.source}: metadata key {key!r} should be {kind.__name__}, "
                                  f"got {str(value)[:80]!r}")
        return kind(value) if kind in (int, float) else value


def _decoded(value):
    """A metadata value with its strings (GGUFFile keeps bytes) as str, UTF-8 as GGUF's are."""
    if isinstance(value, bytes):
        return str(value, encoding="utf-8")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [str(item, encoding="utf-8") for item in value]
    return value


def gguf_config(meta: _Meta) -> ModelConfig:
    arch = meta.get("general.architecture", str)
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"{meta.source}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    a = arch + "."
    d_model = meta.get(a + "embedding_length")
    n_heads = meta.get(a + "attention.head_count")
    n_kv_heads = meta.get(a + "attention.head_count_kv", required=False, default=n_heads)
    if not n_heads or not n_kv_heads or n_heads % n_kv_heads:
        raise CheckpointError(f"{meta.source}: {a}attention.head_count={n_heads} is not a multiple of "
                              f"head_count_kv={n_kv_heads}")
    head_dim = meta.get(a + "attention.key_length", required=False, default=d_model // n_heads)
    if meta.get(a + "attention.value_length", required=False, default=head_dim) != head_dim:
        raise CheckpointError(f"{meta.source}: key and value heads of different widths are not supported")
    rope_dims = meta.get(a + "rope.dimension_count", required=False, default=head_dim)
    if rope_dims != head_dim:
        raise CheckpointError(f"{meta.source}: {a}rope.dimension_count={rope_dims} (partial rotary) is not "
                              f"supported; head_dim is {head_dim}")
    if head_dim % 2:
        raise CheckpointError(f"{meta.source}: head_dim={head_dim} must be even for RoPE")
    scaling = meta.get(a + "rope.scaling.type", str, required=False, default="none")
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": meta.get(a + "rope.scaling.factor", float)}
    elif scaling != "none":
        raise CheckpointError(f"{meta.source}: {a}rope.scaling.type={scaling!r} is not implemented "
                              f"(supported: none, linear)")
    tokens = meta.fields.get("tokenizer.ggml.tokens")
    vocab = meta.get(a + "vocab_size", required=False, default=len(tokens) if tokens is not None else None)
    if vocab is None:
        raise CheckpointError(f"{meta.source}: missing metadata key {a + 'vocab_size'!r} and no tokenizer.ggml.tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id", required=False)
    return ModelConfig(
        arch="llama",
        vocab_size=vocab,
        d_model=d_model,
        n_layers=meta.get(a + "block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_ff=meta.get(a + "feed_forward_length"),
        max_positions=meta.get(a + "context_length"),
        norm_eps=meta.get(a + "attention.layer_norm_rms_epsilon", float),
        eos_token_id=eos,
        extra_eos_token_ids=(eot,) if eot is not None and eot != eos else (),
        tie_word_embeddings=None,   # decided by the tensors (read_gguf)
        activation="silu",
        rope_theta=meta.get(a + "rope.freq_base", float, required=False, default=10000.0),
        rope_scaling=rope_scaling,
        sliding_window=meta.get(a + "attention.sliding_window", required=False) or None,
        qkv_bias=arch in QKV_BIAS_ARCHS,
    )


def _read_tensors(reader: GGUFFile, config: ModelConfig, source: str, permuted: bool) -> dict[str, np.ndarray]:
    """-> {canonical name: float32} in llama.py's order; Q/K rows unpermuted if `permuted`."""
    import gguf

    allowed = supported_types()
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = canonical_name(t.name, source)
        if t.tensor_type not in allowed:
            raise CheckpointError(f"{source}: tensor {t.name!r} has type {t.tensor_type.name}, which we cannot "
                                  f"dequantize (supported: {', '.join(sorted(x.name for x in allowed))})")
        try:
            array = gguf.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(f"{source}: tensor {t.name!r} of type {t.tensor_type.name} "
                                  f"could not be dequantized ({e})") from e
        # GGUF lists dimensions fastest first; the data is in NumPy order, [out, in] as HF stores linear weights.
        shape = tuple(int(d) for d in reversed(t.shape))
        tensors[name] = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
    expected = tensor_shapes(config)
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{source}: missing tensor {gguf_name(name)!r} of a {config.n_layers}-layer "
                                  f"{config.describe()} model")
        if tensors[name].shape != shape:
            raise CheckpointError(f"{source}: tensor {gguf_name(name)!r} has shape {list(tensors[name].shape)}, "
                                  f"expected {list(shape)} from the metadata")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"{source}: unexpected tensor {gguf_name(extra[0])!r} for a {config.n_layers}-layer "
                              f"{config.describe()} model")
    # llama.cpp's converter permutes attn_q / attn_k rows of "llama" models so its rope rotates
    # adjacent pairs (2i, 2i+1); HF rotates i with i + head_dim/2. Undone here, so one forward serves
    # both. "qwen2" files are in HF's layout already (NEOX-style rope). A q/k bias would be unpermuted
    # alike, but a "llama" file with biases is refused as having unexpected tensors, so none is.
    if permuted:
        for name in expected:
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                heads = config.n_heads if ".q_proj." in name else config.n_kv_heads
                tensors[name] = unpermute_rows(tensors[name], heads)
    return {name: tensors[name] for name in expected}


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp convert's permute(w, n_heads): rows [heads, hd/2, 2] -> [heads, 2, hd/2]
    (a weight [rows, cols] or a bias [rows])."""
    rows = w.shape[0]
    return np.ascontiguousarray(w.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape))


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert's permute: what a GGUF writer does to HF's q_proj / k_proj rows (and biases)."""
    rows = w.shape[0]
    return np.ascontiguousarray(w.reshape(n_heads, 2, rows // n_heads // 2, -1).swapaxes(1, 2).reshape(w.shape))


def canonical_name(name: str, source: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}"
    raise CheckpointError(f"{source}: unexpected tensor {name!r} (not part of a Llama-family model we can run)")


def gguf_name(canonical: str) -> str:
    for g, c in TOP_NAMES.items():
        if c == canonical:
            return g
    _, layer, rest = canonical.split(".", 2)
    return f"blk.{layer}." + next(g for g, c in LAYER_NAMES.items() if c == rest)
