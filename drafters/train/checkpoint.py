"""Moved to `specserve.drafters.nets.checkpoint` (shared by serving and training). This name is the
same module object, so imports and attribute patches through either name agree."""

import sys

from specserve.drafters.nets import checkpoint as _moved

sys.modules[__name__] = _moved
