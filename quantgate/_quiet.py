"""Imported first by quantgate/__init__.py, before anything imports transformers.

transformers imports torchao eagerly; on CPU builds torchao logs that its CUDA extensions are absent,
and torch's pytree logs a deprecation for torchao's enums. Neither affects quantgate: keep them quiet.
"""

import logging

for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
