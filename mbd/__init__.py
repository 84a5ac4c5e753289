"""mbd: the core library of mbd-lm (no Ray import): models, MultiTF, decoding, evaluation.

Its log lines (the engine's warm-up, ...) go to stderr at INFO unless the application configured the "mbd" logger.
"""

import logging

_log = logging.getLogger("mbd")
if not _log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)
    _log.propagate = False
