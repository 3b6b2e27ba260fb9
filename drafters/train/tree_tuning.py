"""Moved to `specserve.drafters.nets.tree_tuning` (shared by serving and training). This name is the
same module object, so imports and attribute patches through either name agree."""

import sys

from specserve.drafters.nets import tree_tuning as _moved

sys.modules[__name__] = _moved
