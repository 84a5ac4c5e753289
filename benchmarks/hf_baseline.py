"""A plain HuggingFace-transformers block-diffusion loop: the baseline our engine must beat.

The way SDAR's and Fast-dLLM v2's reference `generate` code decodes: `Qwen3ForCausalLM` (the SDAR backbone, with
our SDAR weights loaded unchanged: the tensor names are the same), a `DynamicCache`, and an explicit 4D
block-causal mask. The prompt's block-aligned part is prefilled into the cache; then one block at a time: denoise
it with forwards whose K/V are cropped off the cache again, accept masked positions whose greedy confidence is
> tau (the single most confident one if none is), and when no mask is left run the final block once more to keep
its K/V (the store forward), then start the next block. A batch runs in lock step: every row waits for the
slowest row's block (and for the slowest request) - the cost continuous batching removes.

It shares no code with `mbd.decoding` (the decision rule is re-implemented here), so the token equality checked by
`verify` is a real cross-check of our SingleBD.

    python -m benchmarks.hf_baseline                # verify token equality, then time both once
    python -m benchmarks.hf_baseline --size 60m --block 32 --batch 4
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbd.config import DecodeConfig, ModelConfig  # noqa: E402
from mbd.model import build_model  # noqa: E402
from mbd.model.checkpoint import checkpoint_state  # noqa: E402

# Random SDAR (Qwen3-style) configs. "60m": 8 layers, d=512, 32,768 vocab, untied head (58.7M parameters).
# "0.5b": 28 layers, d=1024, 65,536 vocab, untied head (0.49B; the GPU acceptance run's model).
# "small": 4 layers, d=256 (7.3M). "tiny": 2 layers, d=128, 1,024 vocab (0.6M): what the full benchmark matrix (batch 16, 1,024-token
# prompts, B=32, 3 repeats) can afford on one CPU thread in 10 minutes.
SIZES = {
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "60m": dict(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "0.5b": dict(vocab_size=65536, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=64),
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}
TEMPER = 10.0  # lm_head scale: a random model becomes confident enough that M2T accepts several tokens at once


def random_sdar(size: str, block: int, max_len: int = 2048, seed: int = 0,
                temper: float = TEMPER) -> tuple[torch.nn.Module, ModelConfig]:
    """A random, tempered SDAR model whose EOS row of the LM head is zero (logit 0 never wins against the
    tempered maximum), so every request decodes its full token budget and runs are comparable. `temper`
    scales the head: the larger, the more positions pass tau_m2t per forward (a higher, trained-like TPF)."""
    v = SIZES[size]["vocab_size"]
    cfg = ModelConfig(family="sdar", mask_token_id=v - 1, eos_token_id=v - 2, pad_token_id=v - 2, block_size=block,
                      max_position_embeddings=max_len, rms_norm_eps=1e-6, **SIZES[size])
    model = build_model(cfg, seed=seed).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(temper)
        model.lm_head.weight[cfg.eos_token_id].zero_()
    return model, cfg


def to_qwen3(model: torch.nn.Module, cfg: ModelConfig):
    """The same weights in transformers' Qwen3ForCausalLM (SDAR checkpoints are Qwen3 ones; the names match)."""
    import transformers

    hf_cfg = transformers.Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias, attn_implementation="sdpa")
    dtype = next(model.parameters()).dtype
    hf = transformers.Qwen3ForCausalLM(hf_cfg).to(dtype).eval()
    missing, unexpected = hf.load_state_dict(checkpoint_state(model), strict=False)
    if unexpected or any("rotary" not in k for k in missing):
        raise RuntimeError(f"weight names differ: missing {missing}, unexpected {unexpected}")
    return hf.to(next(model.parameters()).device)


@dataclass
class PlainResult:
    token_ids: list[list[int]]  # per row: generated tokens, cut at the first stop token and the token budget
    num_generated: list[int]  # per row: tokens up to and including the stop token
    nfe: int  # forwards of the batch (store forwards included, prefill not)
    decode_s: float
    prefill_s: float


class PlainBlockDiffusion:
    """SingleBD with greedy M2T (threshold tau) on a transformers causal LM, batched in lock step."""

    def __init__(self, hf_model, block: int, mask_id: int, stop_ids: set[int]):
        self.model, self.block, self.mask_id, self.stop_ids = hf_model, block, mask_id, stop_ids
        self.device = next(hf_model.parameters()).device
        # transformers >= 5.24 names the cache argument `cache` (`past_key_values` is deprecated there)
        params = inspect.signature(hf_model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _forward(self, ids: torch.Tensor, start: int, cache, mask: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(start, start + ids.shape[1], device=self.device).expand(ids.shape[0], -1)
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                          **{self._cache_kw: cache}).logits

    def _accept(self, logits: torch.Tensor, block: torch.Tensor, tau: float) -> torch.Tensor:
        """One M2T update of `block` [b, B]: masked positions with confidence > tau; if a row accepts none,
        its single most confident masked position."""
        logits[..., self.mask_id] = float("-inf")
        conf, x0 = logits.float().softmax(-1).max(-1)
        masked = block == self.mask_id
        score = torch.where(masked, conf, torch.full_like(conf, -1.0))
        accept = score > tau
        fallback = masked.any(1) & ~accept.any(1)
        accept[fallback, score[fallback].argmax(1)] = True
        return torch.where(accept, x0, block)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], tau: float, max_new_tokens: int | list[int],
                 max_length: int) -> PlainResult:
        """max_new_tokens: one budget, or one per row (the batch runs until its longest row is done)."""
        lens = {len(p) for p in prompts}
        if len(lens) != 1:
            raise ValueError("the plain loop runs a batch in lock step: prompts must have equal lengths")
        from transformers import DynamicCache

        P, B, b, dev = lens.pop(), self.block, len(prompts), self.device
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * b
        gen_end = [min(P + n, max_length) for n in budgets]
        ids = torch.tensor(prompts, device=dev)
        aligned = P // B * B
        cache = DynamicCache()
        t0 = time.perf_counter()
        if aligned:  # block-causal prefill
            blk = torch.arange(aligned, device=dev) // B
            mask = (blk[None, :] <= blk[:, None]).expand(b, 1, aligned, aligned)
            self._forward(ids[:, :aligned], 0, cache, mask)
        t1 = time.perf_counter()
        start = aligned
        block = torch.full((b, B), self.mask_id, device=dev)
        block[:, : P - aligned] = ids[:, aligned:]
        out = [[] for _ in range(b)]
        done = [False] * b
        nfe = 0
        while True:
            full = torch.ones(b, 1, B, start + B, dtype=torch.bool, device=dev)  # the block sees all before it
            while (block == self.mask_id).any():
                logits = self._forward(block, start, cache, full)
                cache.crop(-B)  # denoising forwards keep no K/V
                nfe += 1
                block = self._accept(logits, block, tau)
            rows = block.tolist()
            for r in range(b):
                for p, t in enumerate(rows[r]):
                    if not done[r] and P <= start + p < gen_end[r]:
                        out[r].append(t)
                        done[r] = t in self.stop_ids
                done[r] |= start + B >= gen_end[r]
            if all(done):
                break
            self._forward(block, start, cache, full)  # store forward: the final block's K/V stay
            nfe += 1
            start += B
            block = torch.full((b, B), self.mask_id, device=dev)
        t2 = time.perf_counter()
        toks = [o[:-1] if o and o[-1] in self.stop_ids else o for o in out]
        return PlainResult(toks, [len(o) for o in out], nfe, t2 - t1, t1 - t0)


def singlebd_config(tau: float, max_new_tokens: int, max_length: int) -> DecodeConfig:
    """Our SingleBD with the plain loop's rule: greedy, M2T at tau, no T2T, no activation."""
    return DecodeConfig(buffer_size=1, max_new_tokens=max_new_tokens, max_length=max_length, max_nfe=1_000_000,
                        tau_m2t=tau)


def verify(model, cfg: ModelConfig, hf, prompts: list[list[int]], tau: float, max_new: int, max_len: int) -> None:
    """Raise unless the plain loop (batched) and our engine's SingleBD give identical tokens for every prompt."""
    from mbd.decoding import Engine, EngineConfig

    plain = PlainBlockDiffusion(hf, cfg.block_size, cfg.mask_token_id, {cfg.eos_token_id})
    got = plain.generate(prompts, tau, max_new, max_len)
    engine = Engine(model, None, singlebd_config(tau, max_new, max_len), EngineConfig(max_batch_rows=len(prompts)))
    want = engine.generate(prompts)
    for i, (g, w) in enumerate(zip(got.token_ids, want)):
        if g != w.token_ids:
            k = next((j for j, (x, y) in enumerate(zip(g, w.token_ids)) if x != y), min(len(g), len(w.token_ids)))
            raise AssertionError(f"prompt {i}: plain loop and SingleBD differ at generated token {k}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tau", type=float, default=0.3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    max_len = args.prompt_len + args.max_new_tokens + args.block
    model, cfg = random_sdar(args.size, args.block, max_len)
    hf = to_qwen3(model, cfg)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size - 2, (args.batch, args.prompt_len), generator=g).tolist()
    verify(model, cfg, hf, prompts, args.tau, args.max_new_tokens, max_len)
    r = PlainBlockDiffusion(hf, args.block, cfg.mask_token_id, {cfg.eos_token_id}).generate(
        prompts, args.tau, args.max_new_tokens, max_len)
    tokens = sum(r.num_generated)
    print(f"identical tokens to our SingleBD for {args.batch} prompts; plain loop: {tokens} tokens, "
          f"NFE {r.nfe}, TPS {tokens / r.decode_s:.1f}, step {1e3 * r.decode_s / r.nfe:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
