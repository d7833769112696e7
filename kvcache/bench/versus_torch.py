"""`kvcache bench versus-torch`: the engine beside transformers on PyTorch, the same weights, in one
run: prefill tokens/s of one prompt, decode tokens/s at batch 1 and batch 8. Goals: prefill >= 0.9x,
decode batch 1 >= 0.9x, batch 8 >= 0.8x. Both sides take the greedy token of the same float32 model;
the first prompt's logits are compared first, so the two run the same model.

Needs torch and transformers (`make bench-torch-deps`); the engine itself never imports them.
Engine and torch runs alternate (decode: step by step), so both see the same machine load; each
figure is a median. `--profile` adds where the engine's decode steps spend their time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import numpy as np

from kvcache.bench.report import dump_json, machine, print_table

GOALS = {"prefill": 0.9, "decode_1": 0.9, "decode_8": 0.8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-small-shape",
                        help="gpt2-small-shape (default), tiny, smollm2-135m, a .gguf file or a checkpoint folder")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for prefill (default 512)")
    parser.add_argument("--decode-context", type=int, default=128, help="prompt length before decoding (default 128)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps measured per run (default 32)")
    parser.add_argument("--batch", type=int, default=8, help="the larger decode batch (default 8)")
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads (default 2)")
    parser.add_argument("--numerics", default="invariant", choices=["invariant", "fast"],
                        help="the engine's numerics (default invariant, the engine's default)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is shown (default 3)")
    parser.add_argument("--profile", action="store_true", help="also print the engine's decode profile (cProfile)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    if min(args.prompt_tokens, args.decode_context, args.decode_tokens, args.batch, args.threads, args.repeats) < 1:
        print("kvcache bench versus-torch: error: every count must be positive", file=sys.stderr)
        return 2
    try:
        import torch
        import transformers
    except ImportError as exc:
        print(f"kvcache bench versus-torch: error: {exc.name} is not installed: `make bench-torch-deps` installs "
              f"torch and transformers (a bench extra, never the engine's)", file=sys.stderr)
        return 2
    from worker.engine.engine import Engine
    from worker.model import CheckpointError, load_model

    try:
        model = load_model(args.model, invariant=args.numerics == "invariant")
        theirs = torch_model(args.model, model.config)
    except (CheckpointError, ValueError) as exc:
        print(f"kvcache bench versus-torch: error: {exc}", file=sys.stderr)
        return 2
    longest = max(args.prompt_tokens, args.decode_context + args.decode_tokens + 1)
    if longest > model.config.max_positions:
        print(f"kvcache bench versus-torch: error: {longest} tokens exceed the model's "
              f"{model.config.max_positions} positions", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    page = 16
    engine = Engine(model, kv_dtype="float32", page_tokens=page,
                    num_blocks=(-(-longest // page) + 1) * (args.batch + 2), max_num_seqs=args.batch,
                    max_num_batched_tokens=max(args.prompt_tokens, args.batch))
    rng = np.random.default_rng(0)
    vocab = min(model.config.vocab_size, 50_000)

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, vocab, size=n)]

    side = TorchSide(theirs, torch)
    result = {"bench": "versus-torch", "machine": machine(), "model": model.name,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "numpy": np.__version__},
              "options": {k: v for k, v in vars(args).items() if k != "run"}}
    result["agreement"] = agreement(model, side, prompt(min(64, args.prompt_tokens)))
    result["prefill"] = measure_prefill(engine, side, prompt, args)
    result["decode"] = [measure_decode(engine, side, prompt, args, b) for b in sorted({1, args.batch})]
    if args.profile:
        result["profile"] = profile_decode(engine, prompt, args)
    if args.json:
        dump_json(result)
        return 0
    print_report(result)
    return 0


def torch_model(name: str, config):
    """transformers' model of `config` holding the same float32 weights as load_model(name)."""
    import torch
    import transformers

    from worker.model import load_model_tensors

    tensors = load_model_tensors(name)
    c = config
    if c.arch == "gpt2":
        hf = transformers.GPT2Config(vocab_size=c.vocab_size, n_positions=c.max_positions, n_embd=c.d_model,
                                     n_layer=c.n_layers, n_head=c.n_heads, n_inner=c.d_ff,
                                     activation_function="gelu_new", layer_norm_epsilon=c.norm_eps,
                                     tie_word_embeddings=bool(c.tie_word_embeddings),
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=c.eos_token_id, eos_token_id=c.eos_token_id)
        state = {("lm_head.weight" if n == "lm_head.weight" else "transformer." + n): t for n, t in tensors.items()}
    else:
        from worker.model.hf_export import hf_config

        hf = transformers.AutoConfig.for_model(**hf_config(c, None, c.eos_token_id))
        state = {(n if n == "lm_head.weight" else "model." + n): t for n, t in tensors.items()}
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict({n: torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32))
                                                 for n, t in state.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and c.tie_word_embeddings) and not m.endswith(".attn.bias")]
    if missing or unexpected:
        raise ValueError(f"transformers' {type(model).__name__} did not take the weights: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


class TorchSide:
    """transformers' forward with its KV cache, greedy, under torch.inference_mode."""

    def __init__(self, model, torch):
        import inspect

        self.model, self.torch = model, torch
        # transformers 5.25 renamed past_key_values to cache (the old name warns)
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def logits(self, ids: list[int]) -> np.ndarray:
        with self.torch.inference_mode():
            return self.model(self.torch.tensor([ids]), use_cache=False).logits[0].float().numpy()

    def prefill(self, prompts: list[list[int]]):
        """-> (past key values, the greedy next token of each prompt)."""
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor(prompts), use_cache=True)
            return self._cache(out), out.logits[:, -1].argmax(-1)

    def decode(self, past, tokens):
        with self.torch.inference_mode():
            out = self.model(tokens[:, None], use_cache=True, **{self.cache_arg: past})
            return self._cache(out), out.logits[:, -1].argmax(-1)

    def _cache(self, out):
        return getattr(out, "cache", None) or out.past_key_values


def agreement(model, side: TorchSide, ids: list[int]) -> dict:
    """The two models' logits over one prompt: the same model if they agree to float32 rounding."""
    from worker.model.dense import reference_logits

    ours, theirs = reference_logits(model, ids), side.logits(ids)
    diff = float(np.max(np.abs(ours - theirs)))
    scale = float(np.max(np.abs(theirs)))
    same_argmax = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    if diff > 1e-3 * max(scale, 1.0):
        raise ValueError(f"the engine's and transformers' logits differ by up to {diff:.3g} (largest {scale:.3g}): "
                         f"not the same model, so no comparison")
    return {"tokens": len(ids), "max_abs_diff": diff, "max_abs_logit": scale, "same_argmax": same_argmax}


def measure_prefill(engine, side: TorchSide, prompt, args) -> dict:
    ours, theirs = [], []
    for _ in range(args.repeats):
        ids = prompt(args.prompt_tokens)
        start = time.perf_counter()
        engine.generate([ids], max_new_tokens=1, bypass_cache=True)
        ours.append(len(ids) / (time.perf_counter() - start))
        start = time.perf_counter()
        side.prefill([ids])
        theirs.append(len(ids) / (time.perf_counter() - start))
    e, t = statistics.median(ours), statistics.median(theirs)
    return {"prompt_tokens": args.prompt_tokens, "engine_tokens_per_s": e, "torch_tokens_per_s": t, "ratio": e / t,
            "goal": GOALS["prefill"]}


def measure_decode(engine, side: TorchSide, prompt, args, batch: int) -> dict:
    """Engine steps and torch steps alternate one by one; tokens/s from each side's median step."""
    steps = args.decode_tokens
    ours, theirs = [], []
    for _ in range(args.repeats):
        prompts = [prompt(args.decode_context) for _ in range(batch)]
        handles = [engine.add_request(p, max_new_tokens=steps + 1, bypass_cache=True, ignore_eos=True)
                   for p in prompts]
        while any(h.queue.empty() for h in handles):   # every prompt prefilled, its first token out
            engine.step()
        past, tokens = side.prefill(prompts)
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            past, tokens = side.decode(past, tokens)
            theirs.append(time.perf_counter() - start)
        assert not engine.has_unfinished(), "decode did not end after the measured steps"
    e, t = statistics.median(ours), statistics.median(theirs)
    return {"batch": batch, "context_tokens": args.decode_context, "steps": steps, "engine_tokens_per_s": batch / e,
            "torch_tokens_per_s": batch / t, "ratio": t / e, "goal": GOALS["decode_1" if batch == 1 else "decode_8"]}


def profile_decode(engine, prompt, args) -> list[dict]:
    """The functions the engine's decode steps at the larger batch spend most time in (tottime)."""
    handles = [engine.add_request(prompt(args.decode_context), max_new_tokens=args.decode_tokens + 1,
                                  bypass_cache=True, ignore_eos=True) for _ in range(args.batch)]
    while any(h.queue.empty() for h in handles):
        engine.step()
    profiler = cProfile.Profile()
    profiler.enable()
    while engine.has_unfinished():
        engine.step()
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    total = stats.total_tt
    for (file, line, func), (_, calls, tottime, cumtime, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]:
        rows.append({"function": f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({func})",
                     "calls": calls, "tottime_s": tottime, "share": tottime / total if total else 0.0})
    return rows


def print_report(result: dict) -> None:
    o, a = result["options"], result["agreement"]
    v = result["versions"]
    print(f"versus torch: {result['model']}, float32, engine numerics {o['numerics']}, torch {v['torch']} "
          f"transformers {v['transformers']} on {o['threads']} threads, median of {o['repeats']}")
    print(f"same model: logits over {a['tokens']} tokens differ by at most {a['max_abs_diff']:.2e} "
          f"(largest {a['max_abs_logit']:.2f}), argmax equal at {a['same_argmax']:.0%} of positions")
    p = result["prefill"]
    rows = [[f"prefill tokens/s ({p['prompt_tokens']}-token prompt)", p["engine_tokens_per_s"],
             p["torch_tokens_per_s"], p["ratio"], f">= {p['goal']}"]]
    for d in result["decode"]:
        rows.append([f"decode tokens/s (batch {d['batch']}, {d['context_tokens']}-token context)",
                     d["engine_tokens_per_s"], d["torch_tokens_per_s"], d["ratio"], f">= {d['goal']}"])
    print_table(["measure", "engine", "transformers", "engine/torch", "goal"], rows)
    if "profile" in result:
        print("\nengine decode profile (top functions by own time):")
        print_table(["function", "calls", "own s", "share"],
                    [[r["function"], r["calls"], r["tottime_s"], f"{r['share']:.0%}"] for r in result["profile"]])
