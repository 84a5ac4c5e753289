"""benchmarks/buffer_physics.py attributes every decode forward of a run to its shape, and times the bare forward
of each shape on a live row without disturbing the engine: its physics ratio rests on both."""

import torch

from benchmarks.buffer_physics import ShapeLog, bare_forwards, decode
from benchmarks.decode import decode_config
from benchmarks.hf_baseline import random_sdar
from mbd.decoding import Engine, EngineConfig


def test_every_decode_forward_is_logged_with_its_shape_and_timed_bare():
    model, cfg = random_sdar("tiny", 4, 256)
    engine = Engine(model, None, decode_config(2, 4, 0.3), EngineConfig(max_batch_rows=1))
    log = ShapeLog(engine)
    prompts = torch.randint(0, cfg.vocab_size - 2, (3, 12), generator=torch.Generator().manual_seed(0)).tolist()
    steps0 = engine.stats.steps
    tokens, nfe, steps = decode(engine, log, prompts[:2], 16)
    assert tokens == 2 * 16
    assert len(steps) == engine.stats.steps - steps0 == nfe  # one row: every forward belongs to one request
    shapes = sorted({s for s, _ in steps})
    assert all(0 <= a <= s <= 2 for s, a in shapes) and any(s == 2 for s, _ in shapes)
    assert sum(dt is None for _, dt in steps) == 2  # the steps that also prefilled a prompt are not timed
    bare = bare_forwards(engine, prompts[2], shapes, 2)
    assert set(bare) == set(shapes) and all(t > 0 for t in bare.values())
    assert not engine.has_unfinished()
    # the same prompts through a fresh engine, with and without the log: logging changes nothing that is decoded
    runs = []
    for logged in (True, False):
        e = Engine(model, None, decode_config(2, 4, 0.3), EngineConfig(max_batch_rows=1))
        if logged:
            ShapeLog(e)
        runs.append([(r.token_ids, r.nfe) for r in e.generate(prompts[:2], params={"max_new_tokens": 16})])
    assert runs[0] == runs[1] and sum(n for _, n in runs[0]) == nfe
