"""SingleBD reference: the textbook block diffusion loop, one block at a time.

Decode the current block until it is final (same `Policy`, so the same M2T / T2T rules), then run one
more forward over its final tokens to store their K/V (the storing bubble MultiBD's decode-store overlap
removes), commit, and start the next block. The last block is stored too (and counted), unless max_nfe is
reached first. The Block Buffer engine with N_buf = 1, or with tau_add > 1, must reproduce it token for
token and forward for forward.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mbd.decoding.naive import Reference, ReferenceResult


class SingleBD(Reference):
    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int]) -> ReferenceResult:
        prompt = list(prompt_ids)
        B, dev = self.block, self.device
        p, committed, cache, block = self.start(prompt)
        gen, self.merge = self.generator(p), None
        nfe = 0
        while True:
            start, final = len(committed), False
            while not final:
                logits = self.forward(committed, block, cache)
                nfe += 1
                block, n_final, _, _, stop = self.update(p, logits, block, 0, start, len(prompt), gen)
                final = n_final == 1
                if final and (stop or start + B >= p.gen_end):
                    if nfe < p.max_nfe:
                        self.forward(committed, block, cache)  # store the last block's K/V
                        nfe += 1
                    return self.finalize(p, committed + block[0].tolist(), len(prompt), nfe, "done", [])
                if nfe >= p.max_nfe:
                    return self.finalize(p, committed + block[0].tolist(), len(prompt), nfe, "max_nfe", [])
            self.forward(committed, block, cache)  # store the final block's K/V
            nfe += 1
            committed = committed + block[0].tolist()
            if cache is not None:
                cache.commit(0, B)
            if nfe >= p.max_nfe:
                return self.finalize(p, committed, len(prompt), nfe, "max_nfe", [])
            block = torch.full((1, B), self.mask_id, device=dev)
            self.merge = None
