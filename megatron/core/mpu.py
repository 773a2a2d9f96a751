"""``import megatron.core.mpu``: Megatron's legacy name of :mod:`megatron.core.parallel_state`.

This module is that module (``sys.modules`` maps both names to it), so its state is shared.
"""

import sys

from megatron.core import parallel_state

sys.modules[__name__] = parallel_state
